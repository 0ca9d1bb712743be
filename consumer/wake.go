package consumer

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/internal/pending"
	"github.com/oncely/oncely/internal/ratelog"
)

// wakeTimeout bounds one wake-up statement.
const wakeTimeout = 2 * time.Second

// wakeWait bounds waker.wait: the statement on its way, the one with the
// wake-ups owed meanwhile, and a margin for their cancellation.
const wakeWait = 2*(wakeTimeout+wakeLinger) + time.Second

// wakeLinger is the least time between the starts of two wake-up
// statements; the wake-ups owed meanwhile go together in the next. Under
// load, transactions commit faster than statements return, and without it
// the sender would send one statement per round trip, each a transaction
// of its own on the database. The first wake-up after a quiet spell goes at
// once.
const wakeLinger = 5 * time.Millisecond

// waker sends the outbox wake-ups (NOTIFY) that the record path's committed
// transactions owe, after their commits and outside them: a NOTIFY inside a
// transaction takes a database-wide lock at its commit, held until the
// commit is flushed, so every transaction that enqueued would commit in
// turn. It serves every broker alike: Run's Kafka member, and the adapters
// that drive the record path through Deliver and DeliverBatch.
//
// One sender goroutine sends them, one statement at a time and at most one
// per wakeLinger; the wake-ups owed meanwhile go together in the next. The sender starts
// when a wake-up is owed and none runs, and it exits once nothing is owed,
// so no goroutine outlives the work: an idle Consumer has none, and no
// start or stop is needed. A relay therefore wakes at most wakeLinger and one
// statement's time (wakeTimeout at worst) after the commit, and polls anyway
// (outbox.RelayConfig.PollInterval) should a wake-up be lost: a failed
// statement is only logged, at most once per Config.LogInterval. Each
// statement takes a pool connection for its own short transaction, which a
// record may then wait for, as it would for any other. The payload,
// "consumer", which relays ignore, tells the wake-up apart from those sent
// inside transactions (empty).
//
// A stopping owner waits for the sender (wait, WaitWakeUps) after its last
// transaction ended, so that the last wake-ups owed go out before it
// returns, and no statement uses the pool after that.
type waker struct {
	// notify sends one statement's wake-ups (pg_notify on the pool).
	notify func(ctx context.Context, channels []string) error
	outage *ratelog.Limiter
	// started, when set (by tests), learns when each statement starts, by
	// the time the pause is kept by.
	started func(at time.Time)

	mu      sync.Mutex
	owed    pending.Wakes
	sending bool          // a sender goroutine runs
	idle    chan struct{} // closed when the sender that runs (or ran last) exits
}

func newWaker(pool *pgxpool.Pool, outage *ratelog.Limiter) *waker {
	return &waker{outage: outage, notify: func(ctx context.Context, channels []string) error {
		_, err := pool.Exec(ctx, `SELECT pg_notify(c, 'consumer') FROM unnest($1::text[]) AS c`, channels)
		return err
	}}
}

// owe records the wake-ups of a committed transaction, and starts a sender
// unless one runs: that one sends them with its next statement.
func (w *waker) owe(wakes *pending.Wakes) {
	chs := wakes.Channels()
	if len(chs) == 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, ch := range chs {
		w.owed.Add(ch)
	}
	if w.sending {
		return
	}
	w.sending, w.idle = true, make(chan struct{})
	go w.send(w.idle)
}

// send sends what is owed, one statement at a time and at most one per
// wakeLinger, until nothing is; then it closes idle and exits.
func (w *waker) send(idle chan struct{}) {
	var last time.Time
	for {
		if wait := wakeLinger - time.Since(last); !last.IsZero() && wait > 0 {
			time.Sleep(wait)
		}
		w.mu.Lock()
		chs := w.owed.Channels()
		w.owed = pending.Wakes{}
		if len(chs) == 0 {
			w.sending = false
			close(idle)
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
		last = time.Now()
		if w.started != nil {
			w.started(last)
		}
		ctx, cancel := context.WithTimeout(context.Background(), wakeTimeout)
		if err := w.notify(ctx, chs); err != nil {
			w.outage.Warn(ctx, "oncely consumer: waking the outbox relays failed; they find the rows at their next poll", "err", err)
		}
		cancel()
	}
}

// wait returns once no sender runs: every wake-up owed before the call was
// sent (or its statement failed). It returns earlier when ctx is done, or
// after wakeWait, which is enough unless wake-ups go on being owed.
func (w *waker) wait(ctx context.Context) {
	w.mu.Lock()
	sending, idle := w.sending, w.idle
	w.mu.Unlock()
	if !sending {
		return
	}
	t := time.NewTimer(wakeWait)
	defer t.Stop()
	select {
	case <-idle:
	case <-ctx.Done():
	case <-t.C:
	}
}

// wakes returns ctx carrying a fresh pending.Wakes (the outbox then owes
// its wake-ups to it rather than notifying inside the transaction), and the
// function that hands them to the waker once the transaction committed.
func (c *Consumer) wakes(ctx context.Context) (context.Context, func()) {
	wakes := new(pending.Wakes)
	return pending.WithWakes(ctx, wakes), func() { c.waker.owe(wakes) }
}

// WaitWakeUps returns once the outbox wake-ups owed by the transactions
// that committed so far have been sent, or their statement failed (relays
// find the rows at their next poll then); or earlier, when ctx is done or
// about five seconds passed (each statement is bounded by two). Run calls
// it on its way out. A broker adapter of the record path (NewRecordPath)
// calls it when it stops, after its last Deliver returned, so that the last
// wake-ups go out before it returns and none uses the pool afterwards.
func (c *Consumer) WaitWakeUps(ctx context.Context) { c.waker.wait(ctx) }
