package main

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/kafkaflags"
	"github.com/oncely/oncely/internal/testenv"
)

// Over TLS with SASL SCRAM: a consumer (its client options from the shared
// flags) dead-letters a record, and the CLI lists it with --tls-ca and the
// --sasl-* flags; a wrong password fails with a hint and quotes neither
// password.
func TestDLQListOverTLSAndSCRAM(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	k := testenv.NewSecureKafka(t)
	topic := k.CreateTopic(t, "orders", 1)
	dlqTopic := dlq.DefaultTopic(topic)
	k.CreateTopicNamed(t, dlqTopic, 1)
	if code, out, errs := oncely(t, "migrate", "up", "--database-url", db.URL, "--schema", db.Schema); code != 0 {
		t.Fatalf("migrate: %s %s", out, errs)
	}
	ctx := context.Background()
	rec := &kgo.Record{Topic: topic, Value: []byte("bad"), Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte("a")}}}
	if err := k.Client(t).ProduceSync(ctx, rec).FirstErr(); err != nil {
		t.Fatal(err)
	}

	pw := k.Passwords[testenv.SCRAM256User]
	var security kafkaflags.Flags
	security.TLSCA, security.SASLMechanism, security.SASLUser, security.SASLPassword = k.CAFile, "scram-sha-256", testenv.SCRAM256User, pw
	clientOpts, err := security.Opts()
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(consumer.Config{Brokers: k.Brokers, Topics: []string{topic}, Group: testenv.UniqueName("g"),
		Pool: db.Pool, Schema: db.Schema, ClientOpts: clientOpts,
		Handler: func(context.Context, pgx.Tx, *consumer.Message) error { return dlq.Permanent(errors.New("rejected")) }})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(cctx) }()
	testenv.Eventually(t, time.Minute, "the consumer to dead-letter the record over TLS and SASL", func() bool {
		return c.Stats().DeadLettered == 1
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}

	flags := []string{"dlq", "list", "--brokers", strings.Join(k.Brokers, ","), "--topic", dlqTopic, "--timeout", "5s",
		"--tls-ca", k.CAFile, "--sasl-mechanism", "scram-sha-256", "--sasl-user", testenv.SCRAM256User}
	if code, out, errs := oncely(t, append(flags, "--sasl-password", pw)...); code != 0 || !strings.Contains(out, "1 record") {
		t.Fatalf("dlq list over TLS and SCRAM: exit %d, stdout %q, stderr %q", code, out, errs)
	}
	wrong := "wrong-" + testenv.UniqueName("pw")
	code, out, errs := oncely(t, append(flags, "--sasl-password", wrong)...)
	if code != 1 || !strings.Contains(errs, "refused the credentials") {
		t.Fatalf("dlq list with a wrong password: exit %d, stderr %q; want exit 1 and a hint at the credentials", code, errs)
	}
	if strings.Contains(out+errs, wrong) || strings.Contains(out+errs, pw) {
		t.Fatalf("a password is in the output: %q %q", out, errs)
	}
	if code, _, errs := oncely(t, "dlq", "list", "--brokers", strings.Join(k.Brokers, ","), "--topic", dlqTopic, "--timeout", "3s"); code != 1 ||
		!strings.Contains(errs, "is TLS missing?") {
		t.Fatalf("dlq list without TLS: exit %d, stderr %q; want exit 1 saying TLS is missing", code, errs)
	}
}

// Neither the database password (in DATABASE_URL or --database-url) nor the
// SASL password (in KAFKA_SASL_PASSWORD) shows in -h output or in errors.
// Not parallel: it sets environment variables.
func TestSecretsStayOutOfOutput(t *testing.T) {
	const dbPassword, saslPassword = "db-pw-4c1e9a", "sasl-pw-77b2d0"
	t.Setenv("DATABASE_URL", "postgres://oncely:"+dbPassword+"@127.0.0.1:1/none")
	t.Setenv(kafkaflags.EnvSASLPassword, saslPassword)
	for _, args := range [][]string{
		{"migrate", "up", "-h"},
		{"dlq", "list", "-h"},
		{"outbox", "status", "-h"},
		{"migrate", "up", "--timeout", "1s"},
		{"migrate", "up", "--timeout", "1s", "--database-url", "postgres://oncely:" + dbPassword + "@127.0.0.1:1/none"},
		{"migrate", "up", "--database-url", "postgres://oncely:" + dbPassword + "@[::1"},
		{"dlq", "list", "--brokers", "127.0.0.1:1", "--topic", "t.dlq", "--timeout", "1s", "--sasl-mechanism", "scram-sha-512", "--sasl-user", "u"},
		{"dlq", "list", "--brokers", "127.0.0.1:1", "--topic", "t.dlq", "--sasl-mechanism", "kerberos", "--sasl-user", "u"},
	} {
		_, out, errs := oncely(t, args...)
		if strings.Contains(out+errs, dbPassword) || strings.Contains(out+errs, saslPassword) {
			t.Errorf("oncely %q printed a password: stdout %q, stderr %q", args, out, errs)
		}
	}
}
