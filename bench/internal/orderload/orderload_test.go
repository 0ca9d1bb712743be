package orderload

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/migrations"
)

// TestApplyAndVerify applies orders set-based and per record, checks each
// customer's seqs, and that Verify catches an order applied twice.
func TestApplyAndVerify(t *testing.T) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var b [4]byte
	_, _ = rand.Read(b[:])
	schema := "orderload_test_" + hex.EncodeToString(b[:])
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Skipf("no database: %v", err)
	}
	defer pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	m, err := migrations.New(pool, migrations.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil {
		t.Fatal(err)
	}
	for _, stmt := range Tables(schema) {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	s, err := NewStore(schema)
	if err != nil {
		t.Fatal(err)
	}
	inbox := dedup.MustNew(schema)

	// Customers a, b, a, a in one batch, then one more a per record: a's
	// seqs must be 1, 2, 3 in offset order, then 4.
	custs := []string{"a", "b", "a", "a", "a"}
	orders := make([]Order, len(custs))
	srcs := make([]Source, len(custs))
	for i, c := range custs {
		orders[i] = Order{OrderID: "o" + string(rune('0'+i)), CustomerID: c, AmountCents: int64(10 * (i + 1))}
		srcs[i] = Source{MessageID: MessageID(i), Topic: "t", Offset: int64(i)}
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		entries := make([]dedup.Entry, 4)
		for i := range entries {
			entries[i] = dedup.Entry{MessageID: srcs[i].MessageID, Topic: "t", Offset: srcs[i].Offset}
		}
		if _, err := inbox.ClaimMany(ctx, tx, "g", entries); err != nil {
			return err
		}
		return s.ApplyMany(ctx, tx, orders[:4], srcs[:4])
	})
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if fresh, err := s.HandClaim(ctx, tx, "g", srcs[4]); err != nil || !fresh {
			t.Errorf("HandClaim: fresh %v, err %v", fresh, err)
			return err
		}
		return s.Apply(ctx, tx, orders[4], srcs[4])
	})
	if err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT convert_from(value, 'UTF8')::jsonb->>'order_id', (convert_from(value, 'UTF8')::jsonb->>'seq')::int
		FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()+` ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	seqs := map[string]int{}
	var (
		id  string
		seq int
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &seq}, func() error { seqs[id] = seq; return nil }); err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"o0": 1, "o1": 1, "o2": 2, "o3": 3, "o4": 4}
	for k, v := range want {
		if seqs[k] != v {
			t.Errorf("seq of %s = %d, want %d (all: %v)", k, seqs[k], v, seqs)
		}
	}
	if _, err := s.Verify(ctx, pool, 5); err != nil {
		t.Fatalf("Verify after applying each order once: %v", err)
	}

	// The same order applied a second time, as without an inbox.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return s.Apply(ctx, tx, orders[4], srcs[4]) })
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Verify(ctx, pool, 5); err == nil {
		t.Fatal("Verify passed with an order applied twice")
	}
}
