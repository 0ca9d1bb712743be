package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/outbox"
)

// The parked-row commands end to end: status counts parked rows, parked
// lists them (table and JSON), retry un-parks one or all, discard deletes
// one, and ids that are not parked or not ids are refused.
func TestOutboxParkedCommands(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := context.Background()
	base := []string{"--database-url", db.URL, "--schema", db.Schema}
	if code, out, errs := oncely(t, append([]string{"migrate", "up"}, base...)...); code != 0 {
		t.Fatalf("migrate: %s %s", out, errs)
	}
	o, err := outbox.New(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := o.Enqueue(ctx, tx, outbox.Message{Topic: "t", Key: []byte("k"), Value: []byte("a")},
			outbox.Message{Topic: "t", Key: []byte("k"), Value: []byte("b")}, outbox.Message{Topic: "t", Value: []byte("c")})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// As a relay would have parked them: a and c; b waits behind a.
	park := func(value string) int64 {
		t.Helper()
		var id int64
		if err := db.Pool.QueryRow(ctx, `UPDATE outbox SET parked_at = now(), error = 'MESSAGE_TOO_LARGE: too big'
			WHERE value = $1 RETURNING id`, []byte(value)).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	a, c := park("a"), park("c")
	run := func(want int, args ...string) string {
		t.Helper()
		code, out, errs := oncely(t, append(append([]string{"outbox"}, args...), base...)...)
		if code != want {
			t.Fatalf("oncely outbox %q: exit %d, %q %q; want exit %d", args, code, out, errs, want)
		}
		return out + errs
	}

	if out := run(0, "status"); !strings.Contains(out, "parked\t2\n") || !strings.Contains(out, "pending\t1\n") {
		t.Fatalf("status: %q; want 2 parked, 1 pending", out)
	}
	if out := run(0, "parked"); !strings.Contains(out, "2 parked rows") || !strings.Contains(out, "MESSAGE_TOO_LARGE: too big") {
		t.Fatalf("parked: %q", out)
	}
	lines := strings.Split(strings.TrimSpace(run(0, "parked", "--json")), "\n")
	var rows []jsonParked
	for _, l := range lines {
		var j jsonParked
		if err := json.Unmarshal([]byte(l), &j); err != nil {
			t.Fatalf("parked --json line %q: %v", l, err)
		}
		rows = append(rows, j)
	}
	if len(rows) != 2 || rows[0].ID != a || rows[0].Key == nil || *rows[0].Key != "k" || rows[0].Held != 1 || rows[0].Size != 1+1+int64(len("message-id"))+36 ||
		rows[1].ID != c || rows[1].Key != nil || rows[0].ParkedAt.IsZero() || rows[0].Error != "MESSAGE_TOO_LARGE: too big" {
		t.Fatalf("parked --json: %+v", rows)
	}

	if out := run(0, "retry", fmt.Sprint(a)); !strings.Contains(out, fmt.Sprintf("retried\t%d", a)) {
		t.Fatalf("retry: %q", out)
	}
	var errText *string
	if err := db.Pool.QueryRow(ctx, `SELECT error FROM outbox WHERE id = $1 AND parked_at IS NULL`, a).Scan(&errText); err != nil || errText != nil {
		t.Fatalf("row %d after retry: error %v, %v; want pending again with no error", a, errText, err)
	}
	if out := run(1, "retry", fmt.Sprint(a)); !strings.Contains(out, "no parked row") {
		t.Errorf("second retry: %q", out)
	}
	if out := run(0, "discard", fmt.Sprint(c), "--timeout", "10s"); !strings.Contains(out, fmt.Sprintf("discarded\t%d", c)) {
		t.Fatalf("discard: %q", out)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE id = $1`, c).Scan(&n); err != nil || n != 0 {
		t.Fatalf("row %d after discard: %d rows, %v", c, n, err)
	}
	park("b")
	if out := run(0, "retry", "--all"); !strings.Contains(out, "1 parked rows retried") {
		t.Fatalf("retry --all: %q", out)
	}
	if out := run(0, "parked"); !strings.Contains(out, "0 parked rows") {
		t.Fatalf("parked after retry --all: %q", out)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"retry"}, "name at least one parked row id"},
		{[]string{"discard"}, "name at least one parked row id"},
		{[]string{"retry", "7", "--all"}, "not both"},
		{[]string{"discard", "x1"}, `"x1" is not an outbox row id`},
		{[]string{"parked", "--limit", "-1"}, "--limit"},
		{[]string{"status", "3"}, "unexpected argument"},
	} {
		if out := run(2, tc.args...); !strings.Contains(out, tc.want) {
			t.Errorf("oncely outbox %q: %q; want it to mention %q", tc.args, out, tc.want)
		}
	}
}
