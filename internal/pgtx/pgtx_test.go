package pgtx_test

import (
	"context"
	"errors"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/internal/pgtx"
	"github.com/oncely/oncely/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

// wire records what each connection sent: one entry per simple query and
// one per batch, in order.
type wire struct {
	mu    sync.Mutex
	trips []string
}

func (w *wire) add(s string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.trips = append(w.trips, s)
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
		sqls = append(sqls, q.SQL)
	}
	w.add("batch[" + strings.Join(sqls, "; ") + "]")
	return ctx
}
func (w *wire) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (w *wire) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// setup gives the test a table t(v int) in its own schema and a pool whose
// round trips are recorded.
func setup(t *testing.T) (context.Context, *pgxpool.Pool, *wire) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	db := testenv.Postgres(t)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE t (v int PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	w := &wire{}
	cfg.ConnConfig.RuntimeParams["search_path"] = db.Schema
	cfg.ConnConfig.Tracer = w
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return ctx, pool, w
}

func values(t *testing.T, ctx context.Context, pool *pgxpool.Pool) []int {
	t.Helper()
	rows, _ := pool.Query(ctx, `SELECT v FROM t ORDER BY v`)
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		t.Fatal(err)
	}
	return vs
}

func insert(v int) func(*pgx.Batch) {
	return func(b *pgx.Batch) { b.Queue(`INSERT INTO t VALUES ($1)`, v) }
}

func TestBeginSendsBeginAndFirstStatementsInOneRoundTrip(t *testing.T) {
	ctx, pool, w := setup(t)
	var tag pgconn.CommandTag
	tx, err := pgtx.Begin(ctx, pool, func(b *pgx.Batch) {
		b.Queue(`INSERT INTO t VALUES ($1)`, 1).Exec(func(ct pgconn.CommandTag) error { tag = ct; return nil })
	})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := w.take(), []string{"batch[begin; INSERT INTO t VALUES ($1)]"}; !slices.Equal(got, want) {
		t.Fatalf("round trips of Begin = %q, want %q", got, want)
	}
	if tag.RowsAffected() != 1 {
		t.Fatalf("first statement's callback saw %q", tag)
	}
	var status byte = tx.Conn().PgConn().TxStatus()
	if status != 'T' {
		t.Fatalf("connection's transaction status %q after Begin, want T", status)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO t VALUES (2)`); err != nil {
		t.Fatal(err)
	}
	// Uncommitted work is invisible to another connection.
	if vs := values(t, ctx, pool); len(vs) != 0 {
		t.Fatalf("another connection sees %v before commit", vs)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if vs := values(t, ctx, pool); !slices.Equal(vs, []int{1, 2}) {
		t.Fatalf("after commit t = %v, want [1 2]", vs)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections still acquired after Commit", n)
	}
	if err := tx.Rollback(ctx); !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatalf("Rollback after Commit = %v, want ErrTxClosed", err)
	}
	if _, err := tx.Exec(ctx, `SELECT 1`); !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatalf("Exec after Commit = %v, want ErrTxClosed", err)
	}
	if err := tx.QueryRow(ctx, `SELECT 1`).Scan(new(int)); !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatalf("QueryRow after Commit = %v, want ErrTxClosed", err)
	}
}

func TestRollbackUndoesFirstStatements(t *testing.T) {
	ctx, pool, _ := setup(t)
	tx, err := pgtx.Begin(ctx, pool, insert(1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO t VALUES (2)`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if vs := values(t, ctx, pool); len(vs) != 0 {
		t.Fatalf("after rollback t = %v", vs)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections still acquired after Rollback", n)
	}
}

func TestFailingFirstStatementRollsBackAndFreesConnection(t *testing.T) {
	ctx, pool, _ := setup(t)
	if _, err := pool.Exec(ctx, `INSERT INTO t VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	_, err := pgtx.Begin(ctx, pool, func(b *pgx.Batch) {
		b.Queue(`INSERT INTO t VALUES (2)`)
		b.Queue(`INSERT INTO t VALUES (1)`) // duplicate key
	})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" {
		t.Fatalf("Begin = %v, want the unique violation", err)
	}
	if vs := values(t, ctx, pool); !slices.Equal(vs, []int{1}) {
		t.Fatalf("after a failed Begin t = %v, want [1]", vs)
	}
	st := pool.Stat()
	if st.AcquiredConns() != 0 {
		t.Fatalf("%d connections still acquired after a failed Begin", st.AcquiredConns())
	}
	// The connection went back idle, not in an aborted transaction: every
	// pooled connection begins and commits again.
	for range 2 * pool.Config().MaxConns {
		tx, err := pgtx.Begin(ctx, pool, func(*pgx.Batch) {})
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("commit on a reused connection: %v", err)
		}
	}
}

func TestBeginHonoursCancelledContext(t *testing.T) {
	ctx, pool, _ := setup(t)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := pgtx.Begin(cctx, pool, insert(1)); !errors.Is(err, context.Canceled) {
		t.Fatalf("Begin with a cancelled context = %v", err)
	}
	if vs := values(t, ctx, pool); len(vs) != 0 {
		t.Fatalf("t = %v after a cancelled Begin", vs)
	}
}

func TestCommitOfFailedTransactionReportsRollback(t *testing.T) {
	ctx, pool, _ := setup(t)
	tx, err := pgtx.Begin(ctx, pool, insert(1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO t VALUES (1)`); err == nil {
		t.Fatal("duplicate insert succeeded")
	}
	if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Fatalf("Commit of an aborted transaction = %v, want ErrTxCommitRollback", err)
	}
	if vs := values(t, ctx, pool); len(vs) != 0 {
		t.Fatalf("t = %v after an aborted transaction", vs)
	}
}

func TestSavepoints(t *testing.T) {
	ctx, pool, _ := setup(t)
	tx, err := pgtx.Begin(ctx, pool, insert(1))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// A failing nested transaction rolls back alone, and the outer one goes on.
	err = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		if _, err := sp.Exec(ctx, `INSERT INTO t VALUES (2)`); err != nil {
			return err
		}
		_, err := sp.Exec(ctx, `INSERT INTO t VALUES (1)`)
		return err
	})
	if err == nil {
		t.Fatal("nested duplicate insert succeeded")
	}
	err = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		if _, err := sp.Exec(ctx, `INSERT INTO t VALUES (3)`); err != nil {
			return err
		}
		// Two levels deep, rolled back.
		inner, err := sp.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := inner.Exec(ctx, `INSERT INTO t VALUES (4)`); err != nil {
			return err
		}
		return inner.Rollback(ctx)
	})
	if err != nil {
		t.Fatal(err)
	}
	// A savepoint ends with its Commit, and with its transaction.
	sp, err := tx.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := sp.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := sp.Exec(ctx, `INSERT INTO t VALUES (5)`); !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatalf("Exec on a released savepoint = %v, want ErrTxClosed", err)
	}
	open, err := tx.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := open.Exec(ctx, `INSERT INTO t VALUES (6)`); !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatalf("Exec on a savepoint of a committed transaction = %v, want ErrTxClosed", err)
	}
	if err := open.Rollback(ctx); !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatalf("Rollback of a savepoint of a committed transaction = %v, want ErrTxClosed", err)
	}
	if vs := values(t, ctx, pool); !slices.Equal(vs, []int{1, 3}) {
		t.Fatalf("t = %v, want [1 3]", vs)
	}
}

func TestBatchCopyAndLargeObjects(t *testing.T) {
	ctx, pool, w := setup(t)
	tx, err := pgtx.Begin(ctx, pool, insert(1))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO t VALUES (2)`)
	b.Queue(`INSERT INTO t VALUES (3)`)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		t.Fatal(err)
	}
	n, err := tx.CopyFrom(ctx, pgx.Identifier{"t"}, []string{"v"}, pgx.CopyFromRows([][]any{{4}, {5}}))
	if err != nil || n != 2 {
		t.Fatalf("CopyFrom = %d, %v", n, err)
	}
	w.take()
	los := tx.LargeObjects()
	oid, err := los.Create(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	lo, err := los.Open(ctx, oid, pgx.LargeObjectModeWrite|pgx.LargeObjectModeRead)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lo.Write([]byte("oncely")); err != nil {
		t.Fatal(err)
	}
	if _, err := lo.Seek(0, 0); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 6)
	if _, err := lo.Read(buf); err != nil || string(buf) != "oncely" {
		t.Fatalf("large object read %q, %v", buf, err)
	}
	if err := lo.Close(); err != nil {
		t.Fatal(err)
	}
	if trips := w.take(); len(trips) == 0 || !strings.HasPrefix(trips[0], "--") {
		t.Fatalf("first round trip of LargeObjects = %q, want the empty statement", trips)
	}
	tx.LargeObjects() // made once per transaction
	if trips := w.take(); len(trips) != 0 {
		t.Fatalf("second LargeObjects sent %q", trips)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if vs := values(t, ctx, pool); !slices.Equal(vs, []int{1, 2, 3, 4, 5}) {
		t.Fatalf("t = %v, want [1 2 3 4 5]", vs)
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_largeobject_metadata WHERE oid = $1)`, oid).Scan(&exists); err != nil || !exists {
		t.Fatalf("large object %d after commit: exists=%v, %v", oid, exists, err)
	}
	if _, err := pool.Exec(ctx, `SELECT lo_unlink($1)`, oid); err != nil {
		t.Fatal(err)
	}
}

// A second Begin of the same first statement waits for the first
// transaction's row lock, as any transaction would, and sees its outcome.
func TestConcurrentBeginsOfTheSameRowSerialise(t *testing.T) {
	ctx, pool, _ := setup(t)
	claim := func(claimed *bool) func(*pgx.Batch) {
		return func(b *pgx.Batch) {
			b.Queue(`INSERT INTO t VALUES (1) ON CONFLICT DO NOTHING`).Exec(func(ct pgconn.CommandTag) error {
				*claimed = ct.RowsAffected() == 1
				return nil
			})
		}
	}
	var first bool
	tx, err := pgtx.Begin(ctx, pool, claim(&first))
	if err != nil || !first {
		t.Fatalf("first Begin: claimed=%v, %v", first, err)
	}
	var second bool
	done := make(chan error, 1)
	go func() {
		tx2, err := pgtx.Begin(ctx, pool, claim(&second))
		if err == nil {
			err = tx2.Commit(ctx)
		}
		done <- err
	}()
	// The second Begin is blocked on the first's row: Postgres shows it waiting.
	testenv.WaitFor(t, ctx, "second Begin waiting on the row lock", func() bool {
		var waiting int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO t%'`).Scan(&waiting)
		return waiting == 1
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if second {
		t.Fatal("second Begin claimed a row the first had committed")
	}
}
