package main

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/internal/jsoncheck"
	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook/outbound"
)

// migrateUp migrates db's schema with the CLI.
func migrateUp(t *testing.T, db *pgtest.DB) {
	t.Helper()
	if code, out, errs := oncely(t, "migrate", "up", "--database-url", db.URL, "--schema", db.Schema); code != 0 {
		t.Fatalf("migrate: %s %s", out, errs)
	}
}

func newStore(t *testing.T, db *pgtest.DB) *outbound.Store {
	t.Helper()
	store, err := outbound.NewStore(outbound.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	return store
}

// seedInbox migrates db's schema and fills its inbox: group g1 holds "a"
// (processed, from orders/3/17) and "b" (dead-lettered, ten days ago), g2
// holds "a" (processed without coordinates) and "c" (processed eight days
// ago).
func seedInbox(t *testing.T, db *pgtest.DB) {
	t.Helper()
	ctx := context.Background()
	migrateUp(t, db)
	in, err := dedup.New(dedup.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		for _, e := range []dedup.Entry{
			{Group: "g1", MessageID: "a", Topic: "orders", Partition: 3, Offset: 17},
			{Group: "g1", MessageID: "b", Topic: "orders", Partition: 0, Offset: 4, Outcome: dedup.DeadLettered},
			{Group: "g2", MessageID: "a", Partition: -1, Offset: -1},
			{Group: "g2", MessageID: "c", Topic: "payments", Partition: 1, Offset: 2},
		} {
			if _, err := in.Claim(ctx, tx, e); err != nil {
				return err
			}
		}
		_, err := tx.Exec(ctx, `UPDATE inbox SET processed_at = now() - CASE message_id
			WHEN 'b' THEN interval '10 days' WHEN 'c' THEN interval '8 days' END WHERE message_id IN ('b', 'c')`)
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// The inbox commands: exact counts per group and in total, a lookup by
// message id in every group (outcome, when, source coordinates when
// stored), and the retention status, whose count of expired rows is what
// the cleaner with that retention then deletes.
func TestInboxCommands(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	seedInbox(t, db)
	base := []string{"--database-url", db.URL, "--schema", db.Schema}
	run := func(want int, args ...string) string {
		t.Helper()
		code, out, errs := oncely(t, append(append([]string{"inbox"}, args...), base...)...)
		if code != want {
			t.Fatalf("oncely inbox %q: exit %d, %q %q; want exit %d", args, code, out, errs, want)
		}
		return out + errs
	}

	var count jsonInboxCount
	decodeOne(t, run(0, "count", "--json"), &count)
	want := jsonInboxCount{Total: jsonGroupCount{Processed: 3, DeadLettered: 1, Total: 4}, Groups: []jsonGroupCount{
		{Group: "g1", Processed: 1, DeadLettered: 1, Total: 2}, {Group: "g2", Processed: 2, Total: 2}}}
	if !equalJSON(t, count, want) {
		t.Errorf("count --json = %+v, want %+v", count, want)
	}
	if out := run(0, "count"); !strings.Contains(out, "g1") || !regexp.MustCompile(`\(all 2 groups\)\s+3\s+1\s+4`).MatchString(out) {
		t.Errorf("count table: %q", out)
	}
	decodeOne(t, run(0, "count", "--group", "g2", "--json"), &count)
	if count.Total.Total != 2 || len(count.Groups) != 1 {
		t.Errorf("count --group g2: %+v", count)
	}

	rows := decodeLines[jsonInboxRow](t, run(0, "get", "a", "--json"))
	if len(rows) != 2 || rows[0].Group != "g1" || rows[0].Outcome != "processed" || rows[0].Topic == nil || *rows[0].Topic != "orders" ||
		*rows[0].Partition != 3 || *rows[0].Offset != 17 || time.Since(rows[0].At) > time.Hour {
		t.Fatalf("get a: %+v", rows)
	}
	if r := rows[1]; r.Group != "g2" || r.Topic != nil || r.Partition != nil || r.Offset != nil {
		t.Errorf("get a, g2 (no coordinates stored): %+v, want null topic, partition and offset", r)
	}
	rows = decodeLines[jsonInboxRow](t, run(0, "get", "b", "--group", "g1", "--json"))
	if len(rows) != 1 || rows[0].Outcome != "dead_lettered" || time.Since(rows[0].At) < 9*24*time.Hour {
		t.Errorf("get b: %+v, want dead_lettered ten days ago", rows)
	}
	if out := run(0, "get", "a"); !strings.Contains(out, "orders/3/17") || !strings.Contains(out, "processed") {
		t.Errorf("get table: %q", out)
	}
	if out := run(1, "get", "b", "--group", "g2"); !strings.Contains(out, `"b" is not in the inbox of group g2`) {
		t.Errorf("get of a missing id: %q", out)
	}
	run(2, "get")
	run(2, "get", "a", "b")

	var ret jsonInboxRetention
	decodeOne(t, run(0, "retention", "--retention", "168h", "--json"), &ret)
	if ret.Oldest == nil || ret.Oldest.MessageID != "b" || *ret.OldestAgeSeconds < 9*24*3600 || ret.Expired != 2 ||
		ret.RetentionSeconds != 168*3600 || ret.Now.Sub(ret.Horizon) != 168*time.Hour || len(ret.ExpiredByGroup) != 2 {
		t.Fatalf("retention --json: %+v", ret)
	}
	decodeOne(t, run(0, "retention", "--retention", "216h", "--group", "g1", "--json"), &ret)
	if ret.Expired != 1 || ret.ExpiredByGroup[0].Group != "g1" || ret.ExpiredByGroup[0].DeadLettered != 1 {
		t.Errorf("retention 9 days, g1: %+v", ret)
	}
	if out := run(0, "retention", "--retention", "168h"); !strings.Contains(out, "expired\t2\n") || !strings.Contains(out, "message id b") {
		t.Errorf("retention table: %q", out)
	}
	if out := run(2, "retention"); !strings.Contains(out, "--retention: required") {
		t.Errorf("retention without --retention: %q", out)
	}
	if out := run(2, "retention", "--retention", "1m"); !strings.Contains(out, "below the minimum") {
		t.Errorf("retention below the cleaner's minimum: %q", out)
	}
	// The cleaner with that retention deletes exactly the rows reported.
	cl, err := dedup.NewCleaner(db.Pool, dedup.CleanerConfig{Schema: db.Schema, Retention: 168 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := cl.DeleteExpired(context.Background()); err != nil || n != 2 {
		t.Fatalf("the cleaner deleted %d rows (%v); inbox retention reported 2", n, err)
	}
	decodeOne(t, run(0, "retention", "--retention", "168h", "--json"), &ret)
	if ret.Expired != 0 || ret.Oldest == nil || ret.Oldest.MessageID != "a" {
		t.Errorf("retention after the cleaner: %+v", ret)
	}
}

// checkJSONLines asserts that out is JSON Lines of objects with snake_case
// keys (those of "headers" are data), and returns the number of lines.
func checkJSONLines(t *testing.T, what, out string) int {
	t.Helper()
	return jsoncheck.CheckJSONLines(t, what, out, "headers")
}

// Every command that prints data takes --json and prints JSON Lines with
// snake_case keys, so one script can read them all. (The dlq commands,
// which need Kafka, are checked in integration_test.)
func TestJSONEverywhere(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := context.Background()
	base := []string{"--database-url", db.URL, "--schema", db.Schema, "--json"}
	run := func(args ...string) string {
		t.Helper()
		code, out, errs := oncely(t, append(args, base...)...)
		if code != 0 {
			t.Fatalf("oncely %q --json: exit %d, %q", args, code, errs)
		}
		return out
	}
	if n := checkJSONLines(t, "migrate up", run("migrate", "up")); n < 5 {
		t.Errorf("migrate up --json printed %d migrations", n)
	}
	seedInbox(t, db)
	o, err := outbox.New(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	store := newStore(t, db)
	sub, err := store.CreateSubscription(ctx, db.Pool, outbound.Subscription{URL: "https://example.com/hooks", EventTypes: []string{"order.*"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if _, err := o.Enqueue(ctx, tx, outbox.Message{Topic: "t", Value: []byte("a")}, outbox.Message{Topic: "t", Value: []byte("b")}); err != nil {
			return err
		}
		_, err := store.Enqueue(ctx, tx, outbound.Event{ID: "evt_1", Type: "order.accepted", Payload: []byte(`{}`)})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var parked []string
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `UPDATE outbox SET parked_at = now(), error = 'MESSAGE_TOO_LARGE' RETURNING id::text`)
		if err != nil {
			return err
		}
		parked, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE webhook_deliveries SET status = 'dead', attempts = 3, dead_at = now(), last_status = 500, last_error = 'x'`); err != nil {
		t.Fatal(err)
	}
	id := sub.ID.String()
	for _, tc := range []struct {
		args  []string
		lines int
	}{
		{[]string{"migrate", "status"}, -1},
		{[]string{"outbox", "status"}, 1},
		{[]string{"outbox", "parked"}, 2},
		{[]string{"outbox", "retry", parked[0]}, 1},
		{[]string{"outbox", "discard", parked[1]}, 1},
		{[]string{"outbox", "retry", "--all"}, 1},
		{[]string{"inbox", "count"}, 1},
		{[]string{"inbox", "get", "a"}, 2},
		{[]string{"inbox", "retention", "--retention", "168h"}, 1},
		{[]string{"webhooks", "status"}, 1},
		{[]string{"webhooks", "redrive", "--subscription", id, "--dry-run"}, 1},
		{[]string{"webhooks", "redrive", "--all-subscriptions"}, 1},
		{[]string{"webhooks", "pause", "--subscription", id}, 1},
		{[]string{"webhooks", "resume", "--subscription", id}, 1},
		{[]string{"migrate", "down", "--to", "0"}, -1},
	} {
		n := checkJSONLines(t, strings.Join(tc.args, " "), run(tc.args...))
		if (tc.lines < 0 && n == 0) || (tc.lines >= 0 && n != tc.lines) {
			t.Errorf("oncely %q --json: %d lines, want %d", tc.args, n, tc.lines)
		}
	}
}

// The webhooks commands never print a credential of a subscription URL,
// in the table or in JSON; the rest of the URL is shown.
func TestWebhooksStatusRedactsCredentials(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := context.Background()
	migrateUp(t, db)
	store := newStore(t, db)
	const endpoint = "https://hook-user:hunter2pw@example.com/in?token=tok-SECRET&x=1"
	if _, err := store.CreateSubscription(ctx, db.Pool, outbound.Subscription{URL: endpoint}); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"webhooks", "status"}, {"webhooks", "status", "--json"}} {
		code, out, errs := oncely(t, append(args, "--database-url", db.URL, "--schema", db.Schema)...)
		if code != 0 {
			t.Fatalf("oncely %q: exit %d %q", args, code, errs)
		}
		for _, secret := range []string{"hook-user", "hunter2pw", "tok-SECRET", "whsec_"} {
			if strings.Contains(out+errs, secret) {
				t.Errorf("oncely %q prints %q:\n%s", args, secret, out)
			}
		}
		if !strings.Contains(out, "https://REDACTED@example.com/in?token=REDACTED&x=1") {
			t.Errorf("oncely %q does not show the redacted endpoint:\n%s", args, out)
		}
	}
	// Stored as given: the dispatcher needs the credentials.
	var stored string
	if err := db.Pool.QueryRow(ctx, `SELECT endpoint_url FROM webhook_subscriptions`).Scan(&stored); err != nil || stored != endpoint {
		t.Errorf("stored URL %q (%v), want it as given", stored, err)
	}
}

func decodeOne(t *testing.T, out string, v any) {
	t.Helper()
	if n := checkJSONLines(t, "output", out); n != 1 {
		t.Fatalf("want one JSON object, got %d lines: %q", n, out)
	}
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("decode %q: %v", out, err)
	}
}

func decodeLines[T any](t *testing.T, out string) []T {
	t.Helper()
	checkJSONLines(t, "output", out)
	var rows []T
	for line := range strings.Lines(out) {
		var v T
		if err := json.Unmarshal([]byte(line), &v); err != nil {
			t.Fatalf("decode %q: %v", line, err)
		}
		rows = append(rows, v)
	}
	return rows
}

func equalJSON(t *testing.T, a, b any) bool {
	t.Helper()
	ja, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	jb, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	return string(ja) == string(jb)
}
