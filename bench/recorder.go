package main

import (
	"context"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// recorder observes when records' transactions commit. Every mode's pool has
// it as its pgx tracer; the effect insert notes its record on the
// transaction's connection, and the connection's next successful "commit"
// counts those records as done and samples their end-to-end latency (commit
// end minus the produce time carried in the record). A "rollback" forgets
// them. The same tracer, with the same cost, runs in every mode.
type recorder struct {
	mu      sync.Mutex
	pending map[*pgx.Conn][]time.Time
	samples []time.Duration
	// sampling: the commits keep their records' latencies (a latency
	// phase); a throughput phase keeps none.
	sampling bool
	target   int64
	reached  chan struct{}

	// ends: the last commit of each member's pool since arm (unix
	// nanoseconds), by memberTracer's member number; 0 is the pool that
	// traces with the recorder itself.
	ends map[int]int64

	done     atomic.Int64 // records whose transaction committed
	txs      atomic.Int64 // committed transactions that carried records
	armed    atomic.Bool  // the consumer under test has started
	firstTx  atomic.Int64 // unix nanoseconds of the first statement once armed
	lastDone atomic.Int64 // unix nanoseconds of the last commit
}

func newRecorder() *recorder {
	return &recorder{pending: make(map[*pgx.Conn][]time.Time), ends: make(map[int]int64)}
}

type txEndKey struct{}

// arm makes the next statement on the pool the start of the measured work
// (the schema is created on the same pool before), and the members' ends
// (memberEnds) those of the work from then on.
func (r *recorder) arm() {
	r.mu.Lock()
	clear(r.ends)
	r.mu.Unlock()
	r.armed.Store(true)
}

// TraceQueryStart notes the first statement once armed, and marks the
// statements that end a transaction.
func (r *recorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	r.noteStart()
	switch data.SQL {
	case "commit", "rollback":
		return context.WithValue(ctx, txEndKey{}, data.SQL)
	}
	return ctx
}

// noteStart notes the first statement once armed.
func (r *recorder) noteStart() {
	if r.armed.Load() && r.firstTx.Load() == 0 {
		r.firstTx.CompareAndSwap(0, time.Now().UnixNano())
	}
}

// TraceBatchStart notes the first statement once armed, for a transaction
// that begins in a batch (the consumer sends BEGIN and its inbox claim as
// one).
func (r *recorder) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.noteStart()
	return ctx
}

func (r *recorder) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (r *recorder) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// TraceQueryEnd settles the connection's noted records when its transaction
// ends. A commit that Postgres turned into a rollback (the transaction had
// failed) reports the command tag ROLLBACK and counts nothing.
func (r *recorder) TraceQueryEnd(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryEndData) {
	r.settle(ctx, conn, data, 0)
}

// memberTracer traces one member's pool with a shared recorder, so that the
// recorder tells the members' commits apart (memberEnds).
type memberTracer struct {
	*recorder
	member int
}

func (t memberTracer) TraceQueryEnd(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryEndData) {
	t.settle(ctx, conn, data, t.member)
}

// settle is TraceQueryEnd for a statement of member's pool.
func (r *recorder) settle(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryEndData, member int) {
	end, _ := ctx.Value(txEndKey{}).(string)
	if end == "" {
		return
	}
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	sent := r.pending[conn]
	delete(r.pending, conn)
	if end != "commit" || data.Err != nil || data.CommandTag.String() != "COMMIT" || len(sent) == 0 {
		return
	}
	if r.sampling {
		for _, t := range sent {
			r.samples = append(r.samples, now.Sub(t))
		}
	}
	r.lastDone.Store(now.UnixNano())
	r.ends[member] = now.UnixNano()
	r.txs.Add(1)
	if n := r.done.Add(int64(len(sent))); r.reached != nil && n >= r.target {
		close(r.reached)
		r.reached = nil
	}
}

// note records that the transaction on conn carries a record produced at sent.
func (r *recorder) note(conn *pgx.Conn, sent time.Time) {
	r.mu.Lock()
	r.pending[conn] = append(r.pending[conn], sent)
	r.mu.Unlock()
}

// expect returns a channel closed once n records in all have committed. It
// keeps no latencies: a throughput phase holds no state per record, so that
// the process's memory while it drains a backlog is the consumer's own (the
// RSS mode drains a million records; their samples would add 8 MB or more,
// growing as it runs).
func (r *recorder) expect(n int64) <-chan struct{} {
	return r.expectSampling(n, false)
}

// expectLatencies is expect for a latency phase: the latencies of the
// records that commit from now on are kept, for latencies.
func (r *recorder) expectLatencies(n int64) <-chan struct{} {
	return r.expectSampling(n, true)
}

func (r *recorder) expectSampling(n int64, sampling bool) <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	ch := make(chan struct{})
	r.samples, r.sampling = r.samples[:0], sampling
	if r.done.Load() >= n {
		close(ch)
		return ch
	}
	r.target, r.reached = n, ch
	return ch
}

// memberEnds returns, for members 0 to n-1, the time from the first
// statement (once armed) to the member's last commit: read once the backlog
// has committed, when each was through with its share of it. A member that
// committed nothing counts 0.
func (r *recorder) memberEnds(n int) []time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	first := r.firstTx.Load()
	out := make([]time.Duration, n)
	for i := range out {
		if end, ok := r.ends[i]; ok {
			out[i] = time.Duration(end - first)
		}
	}
	return out
}

// latencies returns the samples taken since expectLatencies.
func (r *recorder) latencies() []time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.samples)
}

// percentiles returns the nearest-rank p50 and p99 of s.
func percentiles(s []time.Duration) (p50, p99 time.Duration) {
	if len(s) == 0 {
		return 0, 0
	}
	slices.Sort(s)
	rank := func(p float64) time.Duration {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return s[min(max(i, 0), len(s)-1)]
	}
	return rank(0.50), rank(0.99)
}
