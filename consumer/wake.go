package consumer

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/internal/pending"
	"github.com/oncely/oncely/internal/ratelog"
)

// waker sends the outbox wake-ups (NOTIFY) that this member's committed
// transactions owe, after their commits and outside them: a NOTIFY inside a
// transaction takes a database-wide lock at its commit, held until the
// commit is flushed, so every transaction that enqueued would commit in
// turn. One goroutine sends them, one statement at a time; the wake-ups
// owed while one is on its way go together in the next. A relay therefore
// wakes at most one statement's time after the commit, and polls anyway
// (outbox.RelayConfig.PollInterval) should a wake-up be lost. Each
// statement takes a pool connection for its own short transaction, which a
// record may then wait for, as it would for any other. The payload,
// "consumer", which relays ignore, tells the wake-up apart from those sent
// inside transactions (empty).
type waker struct {
	pool   *pgxpool.Pool
	outage *ratelog.Limiter

	mu     sync.Mutex
	owed   pending.Wakes
	signal chan struct{} // capacity 1: something is owed
	done   chan struct{} // closed when run returns
}

func newWaker(pool *pgxpool.Pool, outage *ratelog.Limiter) *waker {
	return &waker{pool: pool, outage: outage, signal: make(chan struct{}, 1), done: make(chan struct{})}
}

// owe records the wake-ups of a committed transaction.
func (w *waker) owe(wakes *pending.Wakes) {
	chs := wakes.Channels()
	if len(chs) == 0 {
		return
	}
	w.mu.Lock()
	for _, ch := range chs {
		w.owed.Add(ch)
	}
	w.mu.Unlock()
	select {
	case w.signal <- struct{}{}:
	default:
	}
}

// run sends what is owed until ctx is done, then what is still owed.
func (w *waker) run(ctx context.Context) {
	defer close(w.done)
	for {
		select {
		case <-w.signal:
		case <-ctx.Done():
		}
		w.send(context.WithoutCancel(ctx)) // a stop waits for the last one
		if ctx.Err() != nil {
			return
		}
	}
}

func (w *waker) send(ctx context.Context) {
	w.mu.Lock()
	chs := w.owed.Channels()
	w.owed = pending.Wakes{}
	w.mu.Unlock()
	if len(chs) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := w.pool.Exec(ctx, `SELECT pg_notify(c, 'consumer') FROM unnest($1::text[]) AS c`, chs); err != nil {
		w.outage.Warn(ctx, "oncely consumer: waking the outbox relays failed; they find the rows at their next poll", "err", err)
	}
}

// wakes returns ctx carrying a fresh pending.Wakes when a waker runs (the
// outbox then owes its wake-ups to it rather than notifying inside the
// transaction), and the function that hands them to the waker once the
// transaction committed.
func (c *Consumer) wakes(ctx context.Context) (context.Context, func()) {
	w := c.waker.Load()
	if w == nil {
		return ctx, func() {}
	}
	wakes := new(pending.Wakes)
	return pending.WithWakes(ctx, wakes), func() { w.owe(wakes) }
}
