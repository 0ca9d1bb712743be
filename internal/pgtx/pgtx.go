// Package pgtx begins a Postgres transaction together with its first
// statements, in one round trip.
//
// pgx's Begin sends BEGIN and waits for its answer before the first statement
// can go out. A consumer whose every transaction starts with the same small
// statement (the inbox claim) pays that round trip once per record: on a
// loaded two-core machine about a sixth of a per-record transaction's cost.
// Begin here queues BEGIN and the first statements in one pipelined batch and
// hands back a pgx.Tx on the same connection, which behaves like pgx's own.
package pgtx

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// cleanupTimeout bounds the ROLLBACK sent after a failed Begin, which must
// run even when the caller's context is what failed.
const cleanupTimeout = 5 * time.Second

// Begin acquires a connection from pool and begins a transaction whose first
// statements are the ones queue adds to the batch it is given, sending BEGIN
// and them in one round trip. Their results go to the callbacks set on their
// QueuedQuery (Exec, Query, QueryRow), which run before Begin returns.
//
// If BEGIN or any queued statement fails, Begin rolls the transaction back,
// returns the connection to the pool and returns the first error. Otherwise
// the returned Tx holds the connection until Commit or Rollback.
func Begin(ctx context.Context, pool *pgxpool.Pool, queue func(*pgx.Batch)) (pgx.Tx, error) {
	pc, err := pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	b := &pgx.Batch{}
	b.Queue("begin")
	queue(b)
	if err := pc.SendBatch(ctx, b).Close(); err != nil {
		conn := pc.Conn()
		if !conn.IsClosed() && conn.PgConn().TxStatus() != 'I' {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
			if _, rerr := conn.Exec(rctx, "rollback"); rerr != nil {
				_ = conn.Close(rctx) // the pool drops a closed connection
			}
			cancel()
		}
		pc.Release()
		return nil, err
	}
	tx := &Tx{pc: pc, conn: pc.Conn()}
	tx.root = tx
	return tx, nil
}

// Tx is a transaction begun by Begin, or a savepoint in one (a pseudo
// nested transaction, from Begin on a Tx). Like pgx's, it is not safe for
// concurrent use; Rollback after Commit returns pgx.ErrTxClosed and does
// nothing, so a deferred Rollback is safe.
type Tx struct {
	conn   *pgx.Conn
	closed bool
	root   *Tx    // the transaction; itself unless this is a savepoint
	name   string // the savepoint's name; "" for the transaction

	// The transaction's own state, kept on root.
	pc         *pgxpool.Conn // nil once the connection went back to the pool
	savepoints int64
	lo         pgx.Tx // pgx's view of this transaction, made for LargeObjects
}

var _ pgx.Tx = (*Tx)(nil)

// done reports whether tx can no longer be used: it, or the transaction it
// is a savepoint of, has ended.
func (tx *Tx) done() bool { return tx.closed || tx.root.closed }

// Begin starts a pseudo nested transaction, a savepoint.
func (tx *Tx) Begin(ctx context.Context) (pgx.Tx, error) {
	if tx.done() {
		return nil, pgx.ErrTxClosed
	}
	tx.root.savepoints++
	name := "sp_" + strconv.FormatInt(tx.root.savepoints, 10)
	if _, err := tx.conn.Exec(ctx, "savepoint "+name); err != nil {
		return nil, err
	}
	return &Tx{conn: tx.conn, root: tx.root, name: name}, nil
}

// Commit commits the transaction and returns the connection to the pool. It
// returns pgx.ErrTxCommitRollback when Postgres rolled back instead, because
// a statement had failed. On a savepoint, Commit releases it.
func (tx *Tx) Commit(ctx context.Context) error {
	if tx.done() {
		return pgx.ErrTxClosed
	}
	tx.closed = true
	if tx.name != "" {
		_, err := tx.conn.Exec(ctx, "release savepoint "+tx.name)
		return err
	}
	defer tx.release()
	tag, err := tx.conn.Exec(ctx, "commit")
	if err != nil {
		if tx.conn.PgConn().TxStatus() != 'I' {
			_ = tx.conn.Close(ctx) // the commit's error is the one to report
		}
		return err
	}
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

// Rollback rolls the transaction back and returns the connection to the
// pool. On a savepoint, Rollback rolls back to it.
func (tx *Tx) Rollback(ctx context.Context) error {
	if tx.done() {
		return pgx.ErrTxClosed
	}
	tx.closed = true
	if tx.name != "" {
		_, err := tx.conn.Exec(ctx, "rollback to savepoint "+tx.name)
		return err
	}
	defer tx.release()
	if _, err := tx.conn.Exec(ctx, "rollback"); err != nil {
		_ = tx.conn.Close(ctx) // a connection in an unknown state is not reused
		return fmt.Errorf("rollback failed: %w", err)
	}
	return nil
}

func (tx *Tx) release() {
	if tx.pc != nil {
		tx.pc.Release()
		tx.pc = nil
	}
}

// Exec runs sql in the transaction.
func (tx *Tx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if tx.done() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return tx.conn.Exec(ctx, sql, args...)
}

// Query runs sql in the transaction.
func (tx *Tx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if tx.done() {
		return errRows{pgx.ErrTxClosed}, pgx.ErrTxClosed
	}
	return tx.conn.Query(ctx, sql, args...)
}

// QueryRow runs sql in the transaction.
func (tx *Tx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if tx.done() {
		return errRows{pgx.ErrTxClosed}
	}
	return tx.conn.QueryRow(ctx, sql, args...)
}

// Prepare prepares sql on the transaction's connection.
func (tx *Tx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if tx.done() {
		return nil, pgx.ErrTxClosed
	}
	return tx.conn.Prepare(ctx, name, sql)
}

// CopyFrom copies rows into a table in the transaction.
func (tx *Tx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if tx.done() {
		return 0, pgx.ErrTxClosed
	}
	return tx.conn.CopyFrom(ctx, table, columns, src)
}

// SendBatch sends b in the transaction.
func (tx *Tx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if tx.done() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return tx.conn.SendBatch(ctx, b)
}

// LargeObjects returns the large objects of the transaction. pgx builds
// them only on a transaction of its own, so the first call makes one on this
// connection, inside this transaction, with a round trip that sends only an
// empty statement. If that round trip fails, the connection is closed, the
// transaction is lost, and the returned zero LargeObjects panics on use.
func (tx *Tx) LargeObjects() pgx.LargeObjects {
	r := tx.root
	if r.lo == nil {
		lo, err := r.conn.BeginTx(context.Background(), pgx.TxOptions{BeginQuery: "-- large objects of an open transaction"})
		if err != nil {
			_ = r.conn.Close(context.Background())
			return pgx.LargeObjects{}
		}
		r.lo = lo
	}
	return r.lo.LargeObjects()
}

// Conn returns the transaction's connection.
func (tx *Tx) Conn() *pgx.Conn { return tx.conn }

// errRows is the result of a query on a closed transaction.
type errRows struct{ err error }

func (r errRows) Close()                                       {}
func (r errRows) Err() error                                   { return r.err }
func (r errRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (r errRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (r errRows) Next() bool                                   { return false }
func (r errRows) Scan(...any) error                            { return r.err }
func (r errRows) Values() ([]any, error)                       { return nil, r.err }
func (r errRows) RawValues() [][]byte                          { return nil }
func (r errRows) Conn() *pgx.Conn                              { return nil }
func (r errRows) TypeMap() *pgtype.Map                         { return pgtype.NewMap() }
