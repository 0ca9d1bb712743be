package integration_test

import (
	"bytes"
	"context"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/internal/kafkaflags"
	"github.com/oncely/oncely/internal/testenv"
)

// parseKafkaFlags registers the flags on a fresh flag set and parses args.
func parseKafkaFlags(t *testing.T, args []string, env map[string]string) (*kafkaflags.Flags, *bytes.Buffer) {
	t.Helper()
	var out bytes.Buffer
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(&out)
	var f kafkaflags.Flags
	f.Register(fs, func(k string) string { return env[k] })
	if err := fs.Parse(args); err != nil && err != flag.ErrHelp {
		t.Fatal(err)
	}
	return &f, &out
}

// pingWithFlags connects to brokers with the options of the flags and asks for
// metadata.
func pingWithFlags(t *testing.T, brokers []string, f *kafkaflags.Flags) error {
	t.Helper()
	opts, err := f.Opts()
	if err != nil {
		t.Fatalf("Opts: %v", err)
	}
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...), kgo.DialTimeout(3 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	return f.Explain(cl.Ping(ctx))
}

// The flags against a kfake cluster that takes only TLS with SASL SCRAM:
// the right ones connect, and each wrong one fails with an error that
// says what is wrong and quotes no password.
func TestKafkaFlagsConnectWithTLSAndSCRAM(t *testing.T) {
	t.Parallel()
	k := testenv.NewSecureKafka(t)
	pw256, pw512 := k.Passwords[testenv.SCRAM256User], k.Passwords[testenv.SCRAM512User]
	wrong := "wrong-" + testenv.UniqueName("pw")
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want string // "" connects; else in the error
	}{
		{name: "SCRAM-SHA-256, password from the environment",
			args: []string{"--tls-ca", k.CAFile, "--sasl-mechanism", "scram-sha-256", "--sasl-user", testenv.SCRAM256User},
			env:  map[string]string{kafkaflags.EnvSASLPassword: pw256}},
		{name: "SCRAM-SHA-512, everything from the environment",
			args: []string{"--tls-ca", k.CAFile},
			env: map[string]string{kafkaflags.EnvSASLMechanism: "SCRAM-SHA-512", kafkaflags.EnvSASLUser: testenv.SCRAM512User,
				kafkaflags.EnvSASLPassword: pw512}},
		{name: "the flag's password wins over the environment's",
			args: []string{"--tls-ca", k.CAFile, "--sasl-mechanism", "scram-sha-512", "--sasl-user", testenv.SCRAM512User, "--sasl-password", pw512},
			env:  map[string]string{kafkaflags.EnvSASLPassword: wrong}},
		{name: "wrong password",
			args: []string{"--tls-ca", k.CAFile, "--sasl-mechanism", "scram-sha-256", "--sasl-user", testenv.SCRAM256User, "--sasl-password", wrong},
			want: "refused the credentials"},
		{name: "a password of the other mechanism",
			args: []string{"--tls-ca", k.CAFile, "--sasl-mechanism", "scram-sha-512", "--sasl-user", testenv.SCRAM256User, "--sasl-password", pw256},
			want: "refused the credentials"},
		{name: "certificate not trusted",
			args: []string{"--tls", "--sasl-mechanism", "scram-sha-256", "--sasl-user", testenv.SCRAM256User, "--sasl-password", pw256},
			want: "certificate"},
		{name: "no TLS",
			args: []string{"--sasl-mechanism", "scram-sha-256", "--sasl-user", testenv.SCRAM256User, "--sasl-password", pw256},
			want: "is TLS missing?"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, _ := parseKafkaFlags(t, tc.args, tc.env)
			err := pingWithFlags(t, k.Brokers, f)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("connect: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("connect: %v; want an error mentioning %q", err, tc.want)
			}
			if err != nil {
				for _, pw := range []string{pw256, pw512, wrong} {
					if strings.Contains(err.Error(), pw) {
						t.Fatalf("the error %q quotes a password", err)
					}
				}
			}
		})
	}
}

// Bad flags fail before connecting, naming the flag and never quoting the
// password; -h does not print the password from the environment.
func TestKafkaFlagsErrors(t *testing.T) {
	t.Parallel()
	const secret = "pw-never-shown-7f3a"
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	if err := os.WriteFile(notPEM, []byte("nothing here"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{kafkaflags.EnvSASLPassword: secret}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--sasl-mechanism", "kerberos", "--sasl-user", "u"}, "--sasl-mechanism"},
		{[]string{"--sasl-mechanism", "plain"}, "--sasl-user"},
		{[]string{"--sasl-mechanism", "plain", "--sasl-user", "u", "--sasl-password", ""}, "--sasl-password"},
		{[]string{"--tls-cert", "c.pem"}, "--tls-cert and --tls-key"},
		{[]string{"--tls-ca", filepath.Join(dir, "missing.pem")}, "--tls-ca"},
		{[]string{"--tls-ca", notPEM}, "--tls-ca: no PEM certificates"},
		{[]string{"--tls-cert", notPEM, "--tls-key", notPEM}, "--tls-cert/--tls-key"},
	} {
		f, _ := parseKafkaFlags(t, tc.args, env)
		_, err := f.Opts()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one naming %q", tc.args, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), secret) {
			t.Errorf("%q: the error %q quotes the password", tc.args, err)
		}
	}
	f, help := parseKafkaFlags(t, []string{"-h"}, env)
	if !strings.Contains(help.String(), "-sasl-password") || strings.Contains(help.String(), secret) {
		t.Errorf("-h output lists no --sasl-password, or prints the password:\n%s", help)
	}
	if f.Enabled() {
		t.Error("no TLS or SASL flag given, but Enabled")
	}
	if opts, err := f.Opts(); err != nil || len(opts) != 0 {
		t.Errorf("no flags: %d options, %v; want none", len(opts), err)
	}
}
