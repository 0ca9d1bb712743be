package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook/outbound"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// oncely runs one command line in-process.
func oncely(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestMigrateCommands(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	schema := db.Schema + "_cli"
	t.Cleanup(func() { _, _ = db.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+schema+` CASCADE`) })
	base := []string{"--database-url", db.URL, "--schema", schema}

	code, out, errs := oncely(t, append([]string{"migrate", "up"}, base...)...)
	if code != 0 || !strings.Contains(out, "applied 0001_inbox") {
		t.Fatalf("migrate up: %d %q %q", code, out, errs)
	}
	if code, out, _ = oncely(t, append([]string{"migrate", "up"}, base...)...); code != 0 || !strings.Contains(out, "up to date") {
		t.Fatalf("second migrate up: %d %q", code, out)
	}
	if code, out, _ = oncely(t, append([]string{"migrate", "status"}, base...)...); code != 0 || !strings.Contains(out, "0001") || strings.Contains(out, "\tno") || strings.Contains(out, " no\n") {
		t.Fatalf("status: %d %q", code, out)
	}
	if code, out, _ = oncely(t, append([]string{"migrate", "down", "--to", "0"}, base...)...); code != 0 || !strings.Contains(out, "reverted 0001_inbox") {
		t.Fatalf("down: %d %q", code, out)
	}
	if code, out, _ = oncely(t, append([]string{"migrate", "status"}, base...)...); code != 0 || !strings.Contains(out, "no") {
		t.Fatalf("status after down: %d %q", code, out)
	}
}

func TestBadUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{}, 2, "missing command"},
		{[]string{"frobnicate", "x"}, 2, `unknown command "frobnicate"`},
		{[]string{"dlq", "purge", "--brokers", "b:9092", "--topic", "t"}, 2, `unknown subcommand "purge"`},
		{[]string{"dlq", "list", "--brokers", "b:9092"}, 2, "--topic"},
		{[]string{"dlq", "list", "--brokers", "", "--topic", "t.dlq"}, 2, "--brokers"},
		{[]string{"dlq", "list", "--brokers", "b:9092", "--topic", "t.dlq", "--class", "bogus"}, 2, "--class"},
		{[]string{"dlq", "list", "--brokers", "b:9092", "--topic", "t.dlq", "--since", "yesterday"}, 2, "--since"},
		{[]string{"dlq", "list", "--brokers", "b:9092", "--topic", "t.dlq", "--ref", "zero/1"}, 2, "--ref"},
		{[]string{"dlq", "list", "--brokers", "b:9092", "--topic", "t.dlq", "--sasl-mechanism", "kerberos"}, 2, "--sasl-mechanism"},
		{[]string{"dlq", "list", "--brokers", "b:9092", "--topic", "t.dlq", "--tls-cert", "c.pem"}, 2, "--tls-cert and --tls-key"},
		{[]string{"dlq", "list", "--brokers", "b:9092", "--topic", "t.dlq", "--nope"}, 2, "flag provided but not defined: -nope"},
		{[]string{"dlq", "redrive", "--brokers", "b:9092", "--topic", "t.dlq"}, 2, "--all"},
		{[]string{"dlq", "show", "--brokers", "b:9092", "--topic", "t.dlq"}, 2, "partition/offset"},
		{[]string{"dlq", "list", "--topic", "t.dlq", "--queue", "q.dlq"}, 2, "--topic, --stream and --queue: give one"},
		{[]string{"dlq", "list", "--stream", "S_DLQ", "--queue", "q.dlq"}, 2, "--topic, --stream and --queue: give one"},
		{[]string{"dlq", "list", "--queue", "q.dlq", "--amqp", "http://rabbit"}, 2, "--amqp"},
		{[]string{"dlq", "list", "--queue", "q.dlq", "--amqp", "amqp://u:secret@127.0.0.1:1/", "--timeout", "2s"}, 1, "RabbitMQ at amqp://"},
		{[]string{"migrate", "sideways", "--database-url", "postgres://x@127.0.0.1:1/db"}, 2, `unknown subcommand "sideways"`},
		{[]string{"migrate", "up", "--database-url", ""}, 2, "--database-url"},
		{[]string{"migrate", "up", "--database-url", "postgres://x@127.0.0.1:1/db", "--timeout", "1s"}, 1, "cannot reach Postgres at 127.0.0.1:1"},
		{[]string{"dlq", "list", "--brokers", "127.0.0.1:1", "--topic", "t.dlq", "--timeout", "2s"}, 1, "cannot read t.dlq from Kafka at 127.0.0.1:1"},
	} {
		code, _, errs := oncely(t, tc.args...)
		if code != tc.code || !strings.Contains(errs, tc.want) {
			t.Errorf("oncely %q: exit %d, stderr %q; want exit %d mentioning %q", tc.args, code, errs, tc.code, tc.want)
		}
	}
}

func TestOutboxStatusCommand(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := context.Background()
	if code, out, errs := oncely(t, "migrate", "up", "--database-url", db.URL, "--schema", db.Schema); code != 0 {
		t.Fatalf("migrate: %s %s", out, errs)
	}
	o, err := outbox.New(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := o.Enqueue(ctx, tx, outbox.Message{Topic: "t", Value: []byte("a")}, outbox.Message{Topic: "t", Value: []byte("b")})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	code, out, errs := oncely(t, "outbox", "status", "--database-url", db.URL, "--schema", db.Schema)
	if code != 0 || !strings.Contains(out, "pending\t2\n") || !strings.Contains(out, "sent_retained\t0") {
		t.Fatalf("outbox status: %d %q %q", code, out, errs)
	}
	if code, _, errs = oncely(t, "outbox", "drain", "--database-url", db.URL); code != 2 || !strings.Contains(errs, `unknown subcommand "drain"`) {
		t.Errorf("outbox drain: %d %q", code, errs)
	}
}

// The webhooks commands end to end: status, pause/resume and a redrive of a
// dead delivery (dry run first), with usage errors that name the flag.
func TestWebhooksCommands(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := context.Background()
	if code, out, errs := oncely(t, "migrate", "up", "--database-url", db.URL, "--schema", db.Schema); code != 0 {
		t.Fatalf("migrate: %s %s", out, errs)
	}
	store, err := outbound.NewStore(outbound.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	sub, err := store.CreateSubscription(ctx, db.Pool, outbound.Subscription{URL: "https://example.com/hooks"})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := store.Enqueue(ctx, tx, outbound.Event{ID: "evt_1", Type: "order.accepted", Payload: []byte(`{}`)})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// As if the dispatcher had given up on it an hour ago.
	if _, err := db.Pool.Exec(ctx, `UPDATE webhook_deliveries SET status = 'dead', attempts = 12, dead_at = now() - interval '1 hour',
		last_status = 500, last_error = 'exhausted'`); err != nil {
		t.Fatal(err)
	}
	base := []string{"--database-url", db.URL, "--schema", db.Schema}
	id := sub.ID.String()

	if code, out, errs := oncely(t, append([]string{"webhooks", "status"}, base...)...); code != 0 || !strings.Contains(out, id) || !strings.Contains(out, "1 subscriptions") {
		t.Fatalf("status: %d %q %q", code, out, errs)
	}
	code, out, _ := oncely(t, append([]string{"webhooks", "redrive", "--subscription", id, "--since", "2h", "--dry-run"}, base...)...)
	if code != 0 || !strings.Contains(out, "1 dead deliveries would be redriven") {
		t.Fatalf("dry run: %d %q", code, out)
	}
	if code, out, _ = oncely(t, append([]string{"webhooks", "redrive", "--subscription", id, "--until", "2h"}, base...)...); code != 0 || !strings.Contains(out, "0 dead deliveries redriven") {
		t.Fatalf("redrive outside the time range: %d %q", code, out)
	}
	if code, out, _ = oncely(t, append([]string{"webhooks", "redrive", "--subscription", id}, base...)...); code != 0 || !strings.Contains(out, "1 dead deliveries redriven") {
		t.Fatalf("redrive: %d %q", code, out)
	}
	var status string
	var attempts int
	if err := db.Pool.QueryRow(ctx, `SELECT status, attempts FROM webhook_deliveries`).Scan(&status, &attempts); err != nil || status != "pending" || attempts != 0 {
		t.Fatalf("after redrive: %s, %d attempts, %v; want pending with attempts reset", status, attempts, err)
	}
	if code, out, _ = oncely(t, append([]string{"webhooks", "pause", "--subscription", id, "--reason", "maintenance"}, base...)...); code != 0 || !strings.Contains(out, "paused") {
		t.Fatalf("pause: %d %q", code, out)
	}
	if code, out, _ = oncely(t, append([]string{"webhooks", "resume", "--subscription", id}, base...)...); code != 0 || !strings.Contains(out, "resumed") {
		t.Fatalf("resume: %d %q", code, out)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"webhooks", "redrive"}, "--subscription or --all-subscriptions"},
		{[]string{"webhooks", "redrive", "--subscription", "nope"}, "--subscription"},
		{[]string{"webhooks", "redrive", "--subscription", "7f0c2a52-8a45-4e58-9a3c-1c1f3f0b9b11"}, "no subscription"},
		{[]string{"webhooks", "pause"}, "--subscription is required"},
		{[]string{"webhooks", "frob"}, `unknown subcommand "frob"`},
	} {
		if code, _, errs := oncely(t, append(tc.args, base...)...); code != 2 || !strings.Contains(errs, tc.want) {
			t.Errorf("oncely %q: exit %d, %q; want 2 mentioning %q", tc.args, code, errs, tc.want)
		}
	}
}
