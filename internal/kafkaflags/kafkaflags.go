// Package kafkaflags holds the Kafka security flags (TLS and SASL) that the
// oncely CLI and the orderworker example share, and turns them into
// franz-go options.
//
// Secrets stay out of sight: the SASL password is never a flag's default
// (flag's -h output would print it); it is read from KAFKA_SASL_PASSWORD
// when --sasl-password is not given, and no error quotes it.
package kafkaflags

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// Environment variables read for flags that are not given.
const (
	EnvSASLMechanism = "KAFKA_SASL_MECHANISM"
	EnvSASLUser      = "KAFKA_SASL_USER"
	EnvSASLPassword  = "KAFKA_SASL_PASSWORD"
)

// Flags are the parsed TLS and SASL flags.
type Flags struct {
	TLS           bool   // --tls
	TLSCA         string // --tls-ca: PEM file of CAs to trust (implies TLS)
	TLSCert       string // --tls-cert: PEM client certificate (implies TLS)
	TLSKey        string // --tls-key: PEM client key
	TLSInsecure   bool   // --tls-insecure-skip-verify (implies TLS)
	SASLMechanism string // --sasl-mechanism: plain, scram-sha-256 or scram-sha-512
	SASLUser      string // --sasl-user
	SASLPassword  string // --sasl-password, else KAFKA_SASL_PASSWORD

	fs     *flag.FlagSet
	getenv func(string) string
}

// Register adds the flags to fs. Defaults of the mechanism and the user come
// from getenv; the password is read from it by Opts, after parsing, unless
// --sasl-password was given.
func (f *Flags) Register(fs *flag.FlagSet, getenv func(string) string) {
	f.fs, f.getenv = fs, getenv
	fs.BoolVar(&f.TLS, "tls", false, "connect to Kafka with TLS")
	fs.StringVar(&f.TLSCA, "tls-ca", "", "PEM file of CA certificates to trust for Kafka (implies --tls)")
	fs.StringVar(&f.TLSCert, "tls-cert", "", "PEM client certificate for Kafka (implies --tls; needs --tls-key)")
	fs.StringVar(&f.TLSKey, "tls-key", "", "PEM client key for Kafka")
	fs.BoolVar(&f.TLSInsecure, "tls-insecure-skip-verify", false, "do not verify the Kafka brokers' certificates (implies --tls)")
	fs.StringVar(&f.SASLMechanism, "sasl-mechanism", getenv(EnvSASLMechanism),
		"Kafka SASL mechanism: plain, scram-sha-256 or scram-sha-512 (env "+EnvSASLMechanism+")")
	fs.StringVar(&f.SASLUser, "sasl-user", getenv(EnvSASLUser), "Kafka SASL user (env "+EnvSASLUser+")")
	fs.StringVar(&f.SASLPassword, "sasl-password", "",
		"Kafka SASL password (env "+EnvSASLPassword+", better: a command line is visible to every user of the machine)")
}

// Enabled reports whether TLS or SASL is asked for.
func (f *Flags) Enabled() bool {
	return f.useTLS() || f.SASLMechanism != ""
}

func (f *Flags) useTLS() bool {
	return f.TLS || f.TLSCA != "" || f.TLSCert != "" || f.TLSInsecure
}

// Opts validates the flags and returns the franz-go options they describe
// (none when neither TLS nor SASL is asked for). Errors name the flag.
func (f *Flags) Opts() ([]kgo.Opt, error) {
	if f.fs != nil && f.SASLPassword == "" && !Given(f.fs, "sasl-password") {
		f.SASLPassword = f.getenv(EnvSASLPassword)
	}
	var opts []kgo.Opt
	if f.useTLS() {
		cfg, err := f.tlsConfig()
		if err != nil {
			return nil, err
		}
		opts = append(opts, kgo.DialTLSConfig(cfg))
	}
	if f.SASLMechanism != "" {
		m, err := f.mechanism()
		if err != nil {
			return nil, err
		}
		opts = append(opts, kgo.SASL(m))
	}
	return opts, nil
}

func (f *Flags) tlsConfig() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: f.TLSInsecure} //nolint:gosec // opt-in flag
	if f.TLSCA != "" {
		pem, err := os.ReadFile(f.TLSCA)
		if err != nil {
			return nil, fmt.Errorf("--tls-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--tls-ca: no PEM certificates in %s", f.TLSCA)
		}
		cfg.RootCAs = pool
	}
	if (f.TLSCert == "") != (f.TLSKey == "") {
		return nil, errors.New("--tls-cert and --tls-key: give both or neither")
	}
	if f.TLSCert != "" {
		cert, err := tls.LoadX509KeyPair(f.TLSCert, f.TLSKey)
		if err != nil {
			return nil, fmt.Errorf("--tls-cert/--tls-key: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

func (f *Flags) mechanism() (sasl.Mechanism, error) {
	if f.SASLUser == "" {
		return nil, fmt.Errorf("--sasl-user (%s): required with --sasl-mechanism", EnvSASLUser)
	}
	if f.SASLPassword == "" {
		return nil, fmt.Errorf("--sasl-password (%s): required with --sasl-mechanism", EnvSASLPassword)
	}
	switch strings.ToLower(f.SASLMechanism) {
	case "plain":
		return plain.Auth{User: f.SASLUser, Pass: f.SASLPassword}.AsMechanism(), nil
	case "scram-sha-256":
		return scram.Auth{User: f.SASLUser, Pass: f.SASLPassword}.AsSha256Mechanism(), nil
	case "scram-sha-512":
		return scram.Auth{User: f.SASLUser, Pass: f.SASLPassword}.AsSha512Mechanism(), nil
	}
	return nil, fmt.Errorf("--sasl-mechanism (%s): unknown mechanism %q (want plain, scram-sha-256 or scram-sha-512)",
		EnvSASLMechanism, f.SASLMechanism)
}

// Explain adds a hint to a Kafka error that SASL credentials may explain:
// some brokers (kfake among them) refuse bad credentials by closing the
// connection, which the client reports as EOF.
func (f *Flags) Explain(err error) error {
	if err == nil || f.SASLMechanism == "" || !errors.Is(err, io.EOF) {
		return err
	}
	return fmt.Errorf("%w (with --sasl-mechanism %s, a broker that closes the connection has usually refused the credentials: check --sasl-mechanism, --sasl-user and the password)",
		err, f.SASLMechanism)
}

// Given reports whether the flag was set on fs's command line.
func Given(fs *flag.FlagSet, name string) bool {
	found := false
	fs.Visit(func(f *flag.Flag) { found = found || f.Name == name })
	return found
}
