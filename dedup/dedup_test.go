package dedup_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/migrations"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// setup gives the test its own schema with oncely's tables and an Inbox on it.
func setup(t *testing.T) (*pgtest.DB, *dedup.Inbox, context.Context) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	db := pgtest.Postgres(t)
	m, err := migrations.New(db.Pool, migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	in, err := dedup.New(dedup.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	return db, in, ctx
}

// claimTx claims e in a transaction of its own and commits it.
func claimTx(t *testing.T, ctx context.Context, pool *pgxpool.Pool, in *dedup.Inbox, e dedup.Entry) bool {
	t.Helper()
	var claimed bool
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		claimed, err = in.Claim(ctx, tx, e)
		return err
	})
	if err != nil {
		t.Fatalf("claim %+v: %v", e, err)
	}
	return claimed
}

func inboxCount(t *testing.T, ctx context.Context, db *pgtest.DB, where string, args ...any) int {
	t.Helper()
	q := "SELECT count(*) FROM " + sqlident.Table(db.Schema, "inbox")
	if where != "" {
		q += " WHERE " + where
	}
	var n int
	if err := db.Pool.QueryRow(ctx, q, args...).Scan(&n); err != nil {
		t.Fatalf("count inbox rows: %v", err)
	}
	return n
}

func TestNew(t *testing.T) {
	t.Parallel()
	in, err := dedup.New(dedup.Config{})
	if err != nil {
		t.Fatalf("New with defaults: %v", err)
	}
	if in.Schema() != sqlident.DefaultSchema {
		t.Errorf("default Schema() = %q, want %q", in.Schema(), sqlident.DefaultSchema)
	}
	for _, schema := range []string{`x"; drop table y`, "Upper", "pg_catalog", strings.Repeat("s", 64)} {
		_, err := dedup.New(dedup.Config{Schema: schema})
		if err == nil {
			t.Errorf("New(Schema: %q) succeeded, want an error", schema)
		} else if !strings.Contains(err.Error(), "Config.Schema") {
			t.Errorf("New(Schema: %q) error %q does not name Config.Schema", schema, err)
		}
	}
}

func TestClaimThenDuplicate(t *testing.T) {
	t.Parallel()
	for name, claim := range claimWays {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testClaimThenDuplicate(t, claim)
		})
	}
}

func testClaimThenDuplicate(t *testing.T, claimWay func(context.Context, *pgxpool.Pool, *dedup.Inbox, dedup.Entry, string) (bool, error)) {
	db, in, ctx := setup(t)
	claim := func(e dedup.Entry) bool {
		t.Helper()
		ok, err := claimWay(ctx, db.Pool, in, e, `SELECT $1::text, $2::bigint`)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	e := dedup.Entry{Group: "g", MessageID: "m-1", Topic: "orders", Partition: 3, Offset: 42}
	if !claim(e) {
		t.Fatal("first Claim = false, want true")
	}
	if claim(e) {
		t.Fatal("second Claim of the same (group, id) = true, want false")
	}
	// A redelivery at another offset is still the same message.
	e2 := e
	e2.Offset, e2.Partition = 99, 0
	if claim(e2) {
		t.Fatal("Claim of the same id from another offset = true, want false")
	}

	var (
		topic, outcome string
		partition      int32
		offset         int64
	)
	err := db.Pool.QueryRow(ctx, `SELECT topic, partition, "offset", outcome FROM `+sqlident.Table(db.Schema, "inbox")+
		` WHERE consumer_group = 'g' AND message_id = 'm-1'`).Scan(&topic, &partition, &offset, &outcome)
	if err != nil {
		t.Fatal(err)
	}
	if topic != "orders" || partition != 3 || offset != 42 || outcome != string(dedup.Processed) {
		t.Errorf("row = %s/%d/%d %s, want the first claim's orders/3/42 processed", topic, partition, offset, outcome)
	}
	if n := inboxCount(t, ctx, db, ""); n != 1 {
		t.Errorf("inbox has %d rows, want 1", n)
	}
}

func TestClaimTwiceInOneTransaction(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	e := dedup.Entry{Group: "g", MessageID: "m"}
	for i, want := range []bool{true, false} {
		got, err := in.Claim(ctx, tx, e)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("Claim #%d in one transaction = %v, want %v", i+1, got, want)
		}
	}
}

func TestClaimGroupsAreIndependent(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	for _, g := range []string{"billing", "shipping"} {
		if !claimTx(t, ctx, db.Pool, in, dedup.Entry{Group: g, MessageID: "same-id"}) {
			t.Errorf("group %s: first Claim of same-id = false, want true", g)
		}
	}
	for _, g := range []string{"billing", "shipping"} {
		if claimTx(t, ctx, db.Pool, in, dedup.Entry{Group: g, MessageID: "same-id"}) {
			t.Errorf("group %s: second Claim of same-id = true, want false", g)
		}
	}
	if n := inboxCount(t, ctx, db, "message_id = 'same-id'"); n != 2 {
		t.Errorf("inbox has %d rows for same-id, want one per group (2)", n)
	}
}

func TestClaimRolledBackIsNotClaimed(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	e := dedup.Entry{Group: "g", MessageID: "m"}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := in.Claim(ctx, tx, e); err != nil || !ok {
		t.Fatalf("Claim = %v, %v; want true", ok, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := in.Lookup(ctx, db.Pool, "g", "m"); !errors.Is(err, dedup.ErrNotClaimed) {
		t.Errorf("Lookup after rollback: %v, want ErrNotClaimed", err)
	}
	if !claimTx(t, ctx, db.Pool, in, e) {
		t.Error("Claim after a rolled-back claim = false, want true")
	}
}

func TestClaimInvalidEntry(t *testing.T) {
	t.Parallel()
	in, err := dedup.New(dedup.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// A nil DBTX: the checks must refuse before any statement is sent.
	for _, e := range []dedup.Entry{
		{MessageID: "m"},
		{Group: "g"},
		{},
	} {
		if ok, err := in.Claim(ctx, nil, e); ok || !errors.Is(err, dedup.ErrInvalidEntry) {
			t.Errorf("Claim(%+v) = %v, %v; want false, ErrInvalidEntry", e, ok, err)
		}
	}
	// A nil pool: BeginClaim too refuses before it connects.
	if tx, ok, err := in.BeginClaim(ctx, nil, dedup.Entry{MessageID: "m"}); tx != nil || ok || !errors.Is(err, dedup.ErrInvalidEntry) {
		t.Errorf("BeginClaim without a group = %v, %v, %v; want ErrInvalidEntry", tx, ok, err)
	}
	if ok, err := in.Claim(ctx, nil, dedup.Entry{Group: "g", MessageID: "m", Outcome: "done"}); ok || err == nil {
		t.Errorf("Claim with outcome \"done\" = %v, %v; want an error", ok, err)
	}
	if _, err := in.ClaimMany(ctx, nil, "g", []dedup.Entry{{MessageID: "a"}, {MessageID: ""}}); !errors.Is(err, dedup.ErrInvalidEntry) {
		t.Errorf("ClaimMany with an empty id: %v, want ErrInvalidEntry", err)
	}
	if _, err := in.ClaimMany(ctx, nil, "", []dedup.Entry{{MessageID: "a"}}); !errors.Is(err, dedup.ErrInvalidEntry) {
		t.Errorf("ClaimMany without a group: %v, want ErrInvalidEntry", err)
	}
	if err := in.SetOutcome(ctx, nil, "g", "m", "done"); err == nil {
		t.Error("SetOutcome(\"done\") succeeded, want an error")
	}
}

func TestClaimMany(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	for _, id := range []string{"old-1", "old-2"} {
		if !claimTx(t, ctx, db.Pool, in, dedup.Entry{Group: "g", MessageID: id}) {
			t.Fatalf("pre-claim %s failed", id)
		}
	}
	// The same ids in another group must not count as claimed in "g".
	if !claimTx(t, ctx, db.Pool, in, dedup.Entry{Group: "other", MessageID: "new-3"}) {
		t.Fatal("pre-claim other/new-3 failed")
	}

	entries := []dedup.Entry{
		{MessageID: "new-1", Topic: "t", Partition: 0, Offset: 10},
		{MessageID: "old-1", Topic: "t", Partition: 0, Offset: 11},
		{MessageID: "new-2", Topic: "t", Partition: 1, Offset: 12},
		{MessageID: "new-1", Topic: "t", Partition: 0, Offset: 13}, // in-batch duplicate
		{Group: "g", MessageID: "old-2", Topic: "t", Partition: 1, Offset: 14},
		{MessageID: "new-3", Topic: "t", Partition: 2, Offset: 15, Outcome: dedup.DeadLettered},
		{MessageID: "new-2", Topic: "t", Partition: 1, Offset: 16}, // in-batch duplicate
		{MessageID: "new-1", Topic: "t", Partition: 0, Offset: 17}, // in-batch duplicate
	}
	orig := slices.Clone(entries)
	want := []bool{true, false, true, false, false, true, false, false}

	var got []bool
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var err error
		got, err = in.ClaimMany(ctx, tx, "g", entries)
		return err
	})
	if err != nil {
		t.Fatalf("ClaimMany: %v", err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("ClaimMany = %v, want %v", got, want)
	}
	if !slices.Equal(entries, orig) {
		t.Errorf("ClaimMany modified the caller's entries:\n got %+v\nwant %+v", entries, orig)
	}
	if n := inboxCount(t, ctx, db, "consumer_group = 'g'"); n != 5 {
		t.Errorf("group g has %d rows, want 5 (old-1, old-2, new-1, new-2, new-3)", n)
	}
	// Each new row carries its first occurrence's position and outcome.
	var offset int64
	err = db.Pool.QueryRow(ctx, `SELECT "offset" FROM `+sqlident.Table(db.Schema, "inbox")+
		` WHERE consumer_group = 'g' AND message_id = 'new-1'`).Scan(&offset)
	if err != nil || offset != 10 {
		t.Errorf("new-1 offset = %d, %v; want the first occurrence's 10", offset, err)
	}
	if o, err := in.Lookup(ctx, db.Pool, "g", "new-3"); err != nil || o != dedup.DeadLettered {
		t.Errorf("Lookup(g, new-3) = %q, %v; want dead_lettered", o, err)
	}

	// The whole batch again: nothing is new.
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var err error
		got, err = in.ClaimMany(ctx, tx, "g", entries)
		return err
	})
	if err != nil {
		t.Fatalf("ClaimMany again: %v", err)
	}
	if slices.Contains(got, true) || len(got) != len(entries) {
		t.Errorf("ClaimMany of an already claimed batch = %v, want all false", got)
	}
}

func TestClaimManyEmptyAndWrongGroup(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	got, err := in.ClaimMany(ctx, db.Pool, "g", nil)
	if err != nil || got == nil || len(got) != 0 {
		t.Errorf("ClaimMany(nil) = %#v, %v; want an empty slice", got, err)
	}
	_, err = in.ClaimMany(ctx, db.Pool, "g", []dedup.Entry{{MessageID: "a"}, {Group: "h", MessageID: "b"}})
	if err == nil {
		t.Fatal("ClaimMany with an entry of another group succeeded, want an error")
	}
	if n := inboxCount(t, ctx, db, ""); n != 0 {
		t.Errorf("a refused ClaimMany left %d rows, want 0", n)
	}
}

// TestBeginClaimMany checks that BeginClaimMany claims like ClaimMany, in
// the transaction it returns: rolled back, nothing stays claimed.
func TestBeginClaimMany(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	if !claimTx(t, ctx, db.Pool, in, dedup.Entry{Group: "g", MessageID: "old"}) {
		t.Fatal("pre-claim old failed")
	}
	entries := []dedup.Entry{{MessageID: "a", Offset: 1}, {MessageID: "old", Offset: 2}, {MessageID: "b", Offset: 3}, {MessageID: "a", Offset: 4}}
	want := []bool{true, false, true, false}

	tx, got, err := in.BeginClaimMany(ctx, db.Pool, "g", entries)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("BeginClaimMany = %v, want %v", got, want)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := inboxCount(t, ctx, db, ""); n != 1 {
		t.Fatalf("inbox has %d rows after a rolled-back BeginClaimMany, want 1", n)
	}

	tx, got, err = in.BeginClaimMany(ctx, db.Pool, "g", entries)
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("BeginClaimMany after the rollback = %v, %v; want %v", got, err, want)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := inboxCount(t, ctx, db, ""); n != 3 {
		t.Fatalf("inbox has %d rows, want 3 (old, a, b)", n)
	}

	// No entries: a transaction with nothing claimed.
	tx, got, err = in.BeginClaimMany(ctx, db.Pool, "g", nil)
	if err != nil || len(got) != 0 {
		t.Fatalf("BeginClaimMany(nil) = %v, %v", got, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// Invalid entries: an error, and no transaction.
	if tx, _, err := in.BeginClaimMany(ctx, db.Pool, "g", []dedup.Entry{{}}); err == nil || tx != nil {
		t.Fatalf("BeginClaimMany of an entry without id = %v, %v; want an error", tx, err)
	}
	if n := db.Pool.Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections still acquired", n)
	}
}

// wire records the SQL of every query and batch a pool's connections send,
// one entry per round trip.
type wire struct {
	mu    sync.Mutex
	trips []string
}

func (w *wire) add(sql string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.trips = append(w.trips, sql)
}

func (w *wire) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	t := w.trips
	w.trips = nil
	return t
}

func (w *wire) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	w.add(d.SQL)
	return ctx
}
func (w *wire) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (w *wire) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	var sqls []string
	for _, q := range d.Batch.QueuedQueries {
		sqls = append(sqls, strings.Join(strings.Fields(q.SQL), " "))
	}
	w.add("batch: " + strings.Join(sqls, "; "))
	return ctx
}
func (w *wire) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (w *wire) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// tracedPool is a pool on db's schema whose round trips w records.
func tracedPool(t *testing.T, ctx context.Context, db *pgtest.DB, w *wire) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = db.Schema
	cfg.ConnConfig.Tracer = w
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestBeginClaimIsOneRoundTrip checks that BEGIN and the claim reach
// Postgres together, and that the connection goes back to the pool when
// the transaction ends.
func TestBeginClaimIsOneRoundTrip(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	w := &wire{}
	pool := tracedPool(t, ctx, db, w)
	tx, claimed, err := in.BeginClaim(ctx, pool, dedup.Entry{Group: "g", MessageID: "m"})
	if err != nil || !claimed {
		t.Fatalf("BeginClaim = %v, %v", claimed, err)
	}
	trips := w.take()
	if len(trips) != 1 || !strings.HasPrefix(trips[0], "batch: begin; INSERT INTO ") || !strings.Contains(trips[0], "ON CONFLICT") {
		t.Fatalf("BeginClaim's round trips = %q, want one batch of BEGIN and the claim", trips)
	}
	if s := tx.Conn().PgConn().TxStatus(); s != 'T' {
		t.Fatalf("transaction status %q after BeginClaim, want T", s)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections acquired after Commit", n)
	}
}

// TestBeginClaimFailureLeavesNothing checks that a claim that fails inside
// BeginClaim's round trip rolls back, frees its connection, and leaves it
// usable; and that a cancelled context claims nothing.
func TestBeginClaimFailureLeavesNothing(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	pool := tracedPool(t, ctx, db, &wire{})
	// An inbox in a schema that has no inbox table: BEGIN succeeds, the claim fails.
	missing, err := dedup.New(dedup.Config{Schema: "no_such_schema"})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 * pool.Config().MaxConns {
		tx, _, err := missing.BeginClaim(ctx, pool, dedup.Entry{Group: "g", MessageID: "m"})
		var pgErr *pgconn.PgError
		if tx != nil || !errors.As(err, &pgErr) || pgErr.Code != "42P01" {
			t.Fatalf("BeginClaim without an inbox table = %v, %v; want no transaction and undefined_table", tx, err)
		}
		if _, _, err := missing.BeginClaimMany(ctx, pool, "g", []dedup.Entry{{MessageID: "m"}}); !errors.As(err, &pgErr) {
			t.Fatalf("BeginClaimMany without an inbox table = %v, want undefined_table", err)
		}
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections acquired after failed claims", n)
	}
	// The connections came back outside any transaction: claims on them work.
	for i := range 2 * pool.Config().MaxConns {
		tx, claimed, err := in.BeginClaim(ctx, pool, dedup.Entry{Group: "g", MessageID: fmt.Sprint("m-", i)})
		if err != nil || !claimed {
			t.Fatalf("BeginClaim after failures = %v, %v", claimed, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("commit on a reused connection: %v", err)
		}
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if tx, _, err := in.BeginClaim(cctx, pool, dedup.Entry{Group: "g", MessageID: "cancelled"}); tx != nil || !errors.Is(err, context.Canceled) {
		t.Fatalf("BeginClaim with a cancelled context = %v, %v", tx, err)
	}
	if n := inboxCount(t, ctx, db, ""); n != int(2*pool.Config().MaxConns) {
		t.Fatalf("inbox has %d rows, want %d", n, 2*pool.Config().MaxConns)
	}
}

// TestClaimExactlyOnceRace fires 25 deliveries of one message at once, each
// in its own transaction that writes an effect only if its claim succeeded:
// exactly one effect may exist. Several rounds make real contention likely.
func TestClaimExactlyOnceRace(t *testing.T) {
	t.Parallel()
	for name, claim := range claimWays {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testClaimExactlyOnceRace(t, claim)
		})
	}
}

// claimWays are the two ways to claim in a transaction: Claim after
// pool.Begin, and BeginClaim. Each writes an effect when the claim is new,
// and commits.
var claimWays = map[string]func(ctx context.Context, pool *pgxpool.Pool, in *dedup.Inbox, e dedup.Entry, effect string) (bool, error){
	"Claim": func(ctx context.Context, pool *pgxpool.Pool, in *dedup.Inbox, e dedup.Entry, effect string) (claimed bool, err error) {
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			claimed, err = in.Claim(ctx, tx, e)
			if err != nil || !claimed {
				return err
			}
			_, err = tx.Exec(ctx, effect, e.MessageID, e.Offset)
			return err
		})
		return claimed, err
	},
	"BeginClaim": func(ctx context.Context, pool *pgxpool.Pool, in *dedup.Inbox, e dedup.Entry, effect string) (bool, error) {
		tx, claimed, err := in.BeginClaim(ctx, pool, e)
		if err != nil {
			return false, err
		}
		defer tx.Rollback(context.WithoutCancel(ctx))
		if claimed {
			if _, err := tx.Exec(ctx, effect, e.MessageID, e.Offset); err != nil {
				return false, err
			}
		}
		return claimed, tx.Commit(ctx)
	},
}

func testClaimExactlyOnceRace(t *testing.T, claim func(context.Context, *pgxpool.Pool, *dedup.Inbox, dedup.Entry, string) (bool, error)) {
	db, in, ctx := setup(t)
	const deliveries, rounds = 25, 4
	pool, err := pgtest.NewPool(ctx, db.URL, db.Schema, deliveries)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (message_id text NOT NULL, delivery int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	// Open every connection first so the deliveries start together instead
	// of queueing behind connection set-up.
	conns := make([]*pgxpool.Conn, deliveries)
	for i := range conns {
		if conns[i], err = pool.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range conns {
		c.Release()
	}

	for round := range rounds {
		id := fmt.Sprintf("order-%d", round)
		start := make(chan struct{})
		claimed := make([]bool, deliveries)
		errs := make([]error, deliveries)
		var wg sync.WaitGroup
		for d := range deliveries {
			wg.Go(func() {
				<-start
				claimed[d], errs[d] = claim(ctx, pool, in, dedup.Entry{Group: "g", MessageID: id, Offset: int64(d)},
					`INSERT INTO effects (message_id, delivery) VALUES ($1, $2)`)
			})
		}
		close(start)
		wg.Wait()
		for d, err := range errs {
			if err != nil {
				t.Errorf("round %d delivery %d: %v", round, d, err)
			}
		}
		winners := 0
		for _, c := range claimed {
			if c {
				winners++
			}
		}
		var effects int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE message_id = $1`, id).Scan(&effects); err != nil {
			t.Fatal(err)
		}
		if winners != 1 || effects != 1 {
			t.Errorf("round %d: %d deliveries claimed and %d effects, want exactly 1 of each", round, winners, effects)
		}
	}
	if n := inboxCount(t, ctx, db, ""); n != rounds {
		t.Errorf("inbox has %d rows, want %d", n, rounds)
	}
}

// TestClaimWaitsForOpenClaim checks the serialization described in the
// package doc: a second claim of an id held by an open transaction waits for
// it, and then succeeds if the first rolled back or reports a duplicate if it
// committed.
func TestClaimWaitsForOpenClaim(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		firstCommit bool
		wantSecond  bool
	}{
		{"first rolls back", false, true},
		{"first commits", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db, in, ctx := setup(t)
			e := dedup.Entry{Group: "g", MessageID: "m"}

			tx1, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx1.Rollback(context.Background())
			if ok, err := in.Claim(ctx, tx1, e); err != nil || !ok {
				t.Fatalf("tx1 Claim = %v, %v; want true", ok, err)
			}

			tx2, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx2.Rollback(context.Background())
			var pid2 uint32
			if err := tx2.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid2); err != nil {
				t.Fatal(err)
			}
			type result struct {
				ok  bool
				err error
			}
			second := make(chan result, 1)
			go func() {
				ok, err := in.Claim(ctx, tx2, e)
				second <- result{ok, err}
			}()

			pgtest.WaitFor(t, ctx, "tx2's claim to wait on a lock", func() bool {
				var waiting bool
				err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
					WHERE pid = $1 AND wait_event_type = 'Lock')`, pid2).Scan(&waiting)
				if err != nil {
					t.Fatalf("read pg_stat_activity: %v", err)
				}
				return waiting
			})
			select {
			case r := <-second:
				t.Fatalf("tx2 Claim returned while tx1 was open: %v, %v", r.ok, r.err)
			default:
			}

			if tc.firstCommit {
				err = tx1.Commit(ctx)
			} else {
				err = tx1.Rollback(ctx)
			}
			if err != nil {
				t.Fatal(err)
			}
			r := <-second
			if r.err != nil {
				t.Fatalf("tx2 Claim: %v", r.err)
			}
			if r.ok != tc.wantSecond {
				t.Errorf("tx2 Claim = %v, want %v", r.ok, tc.wantSecond)
			}
			if err := tx2.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if n := inboxCount(t, ctx, db, ""); n != 1 {
				t.Errorf("inbox has %d rows, want 1", n)
			}
		})
	}
}

func TestSetOutcomeAndLookup(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)

	if _, err := in.Lookup(ctx, db.Pool, "g", "m"); !errors.Is(err, dedup.ErrNotClaimed) {
		t.Errorf("Lookup of an unknown id: %v, want ErrNotClaimed", err)
	}
	if err := in.SetOutcome(ctx, db.Pool, "g", "m", dedup.DeadLettered); !errors.Is(err, dedup.ErrNotClaimed) {
		t.Errorf("SetOutcome of an unknown id: %v, want ErrNotClaimed", err)
	}
	if n := inboxCount(t, ctx, db, ""); n != 0 {
		t.Errorf("SetOutcome of an unknown id created %d rows", n)
	}

	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if ok, err := in.Claim(ctx, tx, dedup.Entry{Group: "g", MessageID: "m"}); err != nil || !ok {
			return fmt.Errorf("claim = %v: %w", ok, err)
		}
		if o, err := in.Lookup(ctx, tx, "g", "m"); err != nil || o != dedup.Processed {
			return fmt.Errorf("lookup in tx = %q, want processed (the default): %w", o, err)
		}
		return in.SetOutcome(ctx, tx, "g", "m", dedup.DeadLettered)
	})
	if err != nil {
		t.Fatal(err)
	}
	if o, err := in.Lookup(ctx, db.Pool, "g", "m"); err != nil || o != dedup.DeadLettered {
		t.Errorf("Lookup = %q, %v; want dead_lettered", o, err)
	}
	if _, err := in.Lookup(ctx, db.Pool, "other", "m"); !errors.Is(err, dedup.ErrNotClaimed) {
		t.Errorf("Lookup in another group: %v, want ErrNotClaimed", err)
	}
	if err := in.SetOutcome(ctx, db.Pool, "g", "m", dedup.Processed); err != nil {
		t.Fatal(err)
	}
	if o, err := in.Lookup(ctx, db.Pool, "g", "m"); err != nil || o != dedup.Processed {
		t.Errorf("Lookup after SetOutcome(processed) = %q, %v", o, err)
	}

	// An id claimed directly as dead-lettered.
	if !claimTx(t, ctx, db.Pool, in, dedup.Entry{Group: "g", MessageID: "poison", Outcome: dedup.DeadLettered}) {
		t.Fatal("claim poison failed")
	}
	if o, err := in.Lookup(ctx, db.Pool, "g", "poison"); err != nil || o != dedup.DeadLettered {
		t.Errorf("Lookup(poison) = %q, %v; want dead_lettered", o, err)
	}
}

// TestProcessedAtIsDatabaseTime checks that processed_at comes from the
// database clock, within the claiming transaction.
func TestProcessedAtIsDatabaseTime(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	var txNow, after, processedAt time.Time
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, "SELECT now()").Scan(&txNow); err != nil {
			return err
		}
		if _, err := in.Claim(ctx, tx, dedup.Entry{Group: "g", MessageID: "m"}); err != nil {
			return err
		}
		return tx.QueryRow(ctx, "SELECT processed_at, clock_timestamp() FROM "+sqlident.Table(db.Schema, "inbox")+
			" WHERE consumer_group = 'g' AND message_id = 'm'").Scan(&processedAt, &after)
	})
	if err != nil {
		t.Fatal(err)
	}
	if processedAt.Before(txNow) || processedAt.After(after) {
		t.Errorf("processed_at %s outside the database times of its transaction [%s, %s]", processedAt, txNow, after)
	}
	var dbNow time.Time
	if err := db.Pool.QueryRow(ctx, "SELECT now()").Scan(&dbNow); err != nil {
		t.Fatal(err)
	}
	if d := dbNow.Sub(processedAt); d < 0 || d > 5*time.Second {
		t.Errorf("processed_at %s is %s before database now %s, want within 5s", processedAt, d, dbNow)
	}
}

// A redrive claim takes over a dead-lettered id only with a grant, which it
// consumes in its transaction: once per grant, rolled back with it, and a
// dead-lettered outcome uses the grant up too.
func TestRedriveNeedsAGrant(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	dead := dedup.Entry{Group: "g", MessageID: "m", Outcome: dedup.DeadLettered}
	redrive := dedup.Entry{Group: "g", MessageID: "m", Redrive: true, RedriveRef: "t.dlq/0/3"}
	granted := func() bool {
		t.Helper()
		ok, err := in.RedriveGranted(ctx, db.Pool, "g", "m", "t.dlq/0/3")
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	claimTx(t, ctx, db.Pool, in, dead)
	if claimTx(t, ctx, db.Pool, in, redrive) {
		t.Fatal("a redrive claim without a grant took over the dead-lettered id")
	}
	if err := in.GrantRedrive(ctx, db.Pool, "g", "m", "t.dlq/0/3"); err != nil {
		t.Fatal(err)
	}
	// A claim that rolls back leaves the grant.
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		ok, err := in.Claim(ctx, tx, redrive)
		if err == nil && !ok {
			t.Error("a redrive claim with a grant was not new")
		}
		return errors.Join(err, errRollback)
	})
	if !errors.Is(err, errRollback) || !granted() {
		t.Fatalf("rolled-back redrive claim: %v, grant left %v; want the grant kept", err, granted())
	}
	if !claimTx(t, ctx, db.Pool, in, redrive) || granted() {
		t.Fatal("a redrive claim with a grant was not new, or left its grant")
	}
	if o, err := in.Lookup(ctx, db.Pool, "g", "m"); err != nil || o != dedup.Processed {
		t.Fatalf("outcome %q, %v after the redrive; want processed", o, err)
	}
	if claimTx(t, ctx, db.Pool, in, redrive) {
		t.Fatal("a second redrive claim of a processed id was new")
	}

	// A redriven record that fails again is dead-lettered again: its
	// dead-letter claim uses its grant up.
	other := dedup.Entry{Group: "g", MessageID: "n", Outcome: dedup.DeadLettered}
	claimTx(t, ctx, db.Pool, in, other)
	if err := in.GrantRedrive(ctx, db.Pool, "g", "n", "t.dlq/0/4"); err != nil {
		t.Fatal(err)
	}
	other.Redrive, other.RedriveRef = true, "t.dlq/0/4"
	claimTx(t, ctx, db.Pool, in, other)
	if ok, err := in.RedriveGranted(ctx, db.Pool, "g", "n", "t.dlq/0/4"); err != nil || ok {
		t.Fatalf("grant of n after its dead-letter claim: %v, %v; want used up", ok, err)
	}
	// Revoking a grant that is gone is no error.
	if err := in.RevokeRedrive(ctx, db.Pool, "g", "n"); err != nil {
		t.Fatal(err)
	}
}

// A grant is taken only by a claim redriven from the dead-letter record it
// was made for: another record with the id and a redrive header of another
// ref (anybody can write both) is an ordinary claim, and leaves the grant.
func TestRedriveGrantTakenOnlyByItsRef(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	if err := in.GrantRedrive(ctx, db.Pool, "g", "m", ""); err == nil {
		t.Fatal("a grant without a ref was recorded")
	}
	claimTx(t, ctx, db.Pool, in, dedup.Entry{Group: "g", MessageID: "m", Outcome: dedup.DeadLettered})
	if err := in.GrantRedrive(ctx, db.Pool, "g", "m", "t.dlq/0/3"); err != nil {
		t.Fatal(err)
	}
	for _, forged := range []dedup.Entry{
		{Group: "g", MessageID: "m", Redrive: true, RedriveRef: "t.dlq/0/9"},
		{Group: "g", MessageID: "m", Redrive: true},
		{Group: "g", MessageID: "m", Redrive: true, RedriveRef: "t.dlq/0/9", Outcome: dedup.DeadLettered},
	} {
		if claimTx(t, ctx, db.Pool, in, forged) {
			t.Fatalf("a redrive claim from %q took the grant made for t.dlq/0/3", forged.RedriveRef)
		}
	}
	if ok, err := in.RedriveGranted(ctx, db.Pool, "g", "m", "t.dlq/0/9"); err != nil || ok {
		t.Fatalf("grant for another ref: %v, %v; want none", ok, err)
	}
	if ok, err := in.RedriveGranted(ctx, db.Pool, "g", "m", "t.dlq/0/3"); err != nil || !ok {
		t.Fatalf("grant for its ref after the other claims: %v, %v; want kept", ok, err)
	}
	if !claimTx(t, ctx, db.Pool, in, dedup.Entry{Group: "g", MessageID: "m", Redrive: true, RedriveRef: "t.dlq/0/3"}) {
		t.Fatal("the redrive claim from the granted ref was not new")
	}
}

var errRollback = errors.New("roll back")
