package consumer

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// savepoint is taken before each record's handler in a batch transaction.
const savepoint = "oncely_record"

// recordTx is the transaction a batch hands to each record's Handler. The
// record's savepoint is not sent on its own: it travels in front of the
// handler's first statement, in the same round trip, so a savepoint costs
// no round trip of its own (a handler that runs no statement takes none).
// A batch of records that each run two statements thus takes two round
// trips a record, not three.
//
// Statements that cannot be sent in a pgx.Batch (an explicit QueryExecMode
// or result format, CopyFrom, Prepare, a nested Begin, large objects, the
// raw Conn) send the savepoint first, in a round trip of its own.
type recordTx struct {
	pgx.Tx
	pending []string // owed before the handler's next statement: RELEASE of the last savepoint, SAVEPOINT
	open    bool     // a savepoint named savepoint exists (this record's or an earlier one's)
	taken   bool     // this record's savepoint exists: its statements can be rolled back to it
	err     error    // a savepoint statement failed: the transaction is unusable
	// ctxDone: err came from the handler's own context, done while the
	// savepoint waited in front of the handler's statement.
	ctxDone bool
}

// next prepares the savepoint of the next record.
func (t *recordTx) next() {
	t.pending, t.taken = t.pending[:0], false
	if t.open {
		t.pending = append(t.pending, "RELEASE SAVEPOINT "+savepoint)
	}
	t.pending = append(t.pending, "SAVEPOINT "+savepoint)
}

// done forgets a savepoint the record never needed.
func (t *recordTx) done() { t.pending = t.pending[:0] }

// sent records the outcome of the owed statements, sent in ctx.
func (t *recordTx) sent(ctx context.Context, err error) error {
	t.pending = t.pending[:0]
	if err != nil {
		t.err, t.ctxDone = fmt.Errorf("consumer: savepoint: %w", err), ctx.Err() != nil
		return t.err
	}
	t.open, t.taken = true, true
	return nil
}

// flush sends the owed statements on their own.
func (t *recordTx) flush(ctx context.Context) error {
	if len(t.pending) == 0 {
		return t.err
	}
	for _, s := range t.pending {
		if _, err := t.Tx.Exec(ctx, s); err != nil {
			return t.sent(ctx, err)
		}
	}
	return t.sent(ctx, nil)
}

// batchable reports whether a statement with args can follow the owed ones
// in a pgx.Batch, which does not take per-statement exec modes or formats.
func batchable(args []any) bool {
	if len(args) == 0 {
		return true
	}
	switch args[0].(type) {
	case pgx.QueryExecMode, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
		return false
	}
	return true
}

// send starts a batch of the owed statements followed by the caller's, and
// reads the owed statements' results.
func (t *recordTx) send(ctx context.Context, queued []*pgx.QueuedQuery) (pgx.BatchResults, error) {
	b := &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, len(t.pending)+len(queued))}
	for _, s := range t.pending {
		b.Queue(s)
	}
	n := len(b.QueuedQueries)
	b.QueuedQueries = append(b.QueuedQueries, queued...)
	br := t.Tx.SendBatch(ctx, b)
	for range n {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return nil, t.sent(ctx, err)
		}
	}
	return br, t.sent(ctx, nil)
}

func (t *recordTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if len(t.pending) == 0 || !batchable(args) {
		if err := t.flush(ctx); err != nil {
			return pgconn.CommandTag{}, err
		}
		return t.Tx.Exec(ctx, sql, args...)
	}
	br, err := t.send(ctx, []*pgx.QueuedQuery{{SQL: sql, Arguments: args}})
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := br.Exec()
	return tag, errors.Join(err, br.Close())
}

func (t *recordTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if len(t.pending) == 0 || !batchable(args) {
		if err := t.flush(ctx); err != nil {
			return nil, err
		}
		return t.Tx.Query(ctx, sql, args...)
	}
	br, err := t.send(ctx, []*pgx.QueuedQuery{{SQL: sql, Arguments: args}})
	if err != nil {
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		return nil, errors.Join(err, br.Close())
	}
	return &batchRows{Rows: rows, br: br}, nil
}

func (t *recordTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := t.Query(ctx, sql, args...)
	return &firstRow{rows: rows, err: err}
}

func (t *recordTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if len(t.pending) == 0 || len(b.QueuedQueries) == 0 {
		if err := t.flush(ctx); err != nil {
			return errBatch{err}
		}
		return t.Tx.SendBatch(ctx, b)
	}
	for _, q := range b.QueuedQueries {
		if !batchable(q.Arguments) {
			return t.Tx.SendBatch(ctx, b) // fails as pgx fails such a batch
		}
	}
	br, err := t.send(ctx, b.QueuedQueries)
	if err != nil {
		return errBatch{err}
	}
	return br
}

func (t *recordTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.flush(ctx); err != nil {
		return 0, err
	}
	return t.Tx.CopyFrom(ctx, table, cols, src)
}

func (t *recordTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	return t.Tx.Prepare(ctx, name, sql)
}

func (t *recordTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	return t.Tx.Begin(ctx)
}

func (t *recordTx) LargeObjects() pgx.LargeObjects {
	_ = t.flush(context.Background()) // a failure shows in t.err, and in the next statement
	return t.Tx.LargeObjects()
}

func (t *recordTx) Conn() *pgx.Conn {
	_ = t.flush(context.Background())
	return t.Tx.Conn()
}

// batchRows are the rows of a statement sent in a batch: the batch ends
// with them, when they are closed or read to the end.
type batchRows struct {
	pgx.Rows
	br     pgx.BatchResults
	closed bool
	err    error
}

func (r *batchRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.Close()
	return false
}

func (r *batchRows) Close() {
	if r.closed {
		return
	}
	r.closed = true
	r.Rows.Close()
	r.err = r.br.Close()
}

func (r *batchRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.err
}

// firstRow is QueryRow's result on top of Query, as pgx builds its own.
type firstRow struct {
	rows pgx.Rows
	err  error
}

func (r *firstRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	rows := r.rows
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := rows.Scan(dest...); err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// errBatch is a batch that failed before it was sent.
type errBatch struct{ err error }

func (b errBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b errBatch) Query() (pgx.Rows, error)         { return nil, b.err }
func (b errBatch) QueryRow() pgx.Row                { return &firstRow{err: b.err} }
func (b errBatch) Close() error                     { return b.err }
func (b errBatch) Tx() pgx.Tx                       { return nil }
