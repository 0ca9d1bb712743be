// Package pending gathers writes that the handlers of one consumer batch ask
// for, so that they are sent together, in one statement per writer, just
// before the batch commits: the consumer puts a Queue in each handler's
// context; a writer that finds one (the outbox's Enqueue) adds its items to
// it instead of writing them at once. It also carries the wake-ups a
// consumer's transaction owes (Wakes), sent after its commit.
package pending

import (
	"context"
	"slices"

	"github.com/jackc/pgx/v5"
)

// Writer writes the items added for it, in the order they were added.
type Writer interface {
	WritePending(ctx context.Context, tx pgx.Tx, items []any) error
}

type entry struct {
	w    Writer
	item any
}

// Queue is one batch transaction's pending writes. It is used by one
// goroutine at a time (a batch runs its handlers one after another).
type Queue struct{ entries []entry }

// Add queues item for w.
func (q *Queue) Add(w Writer, item any) { q.entries = append(q.entries, entry{w, item}) }

// Len is the number of items queued: a mark for Truncate.
func (q *Queue) Len() int { return len(q.entries) }

// Truncate drops the items queued after mark, those of a handler whose
// writes were rolled back to its savepoint.
func (q *Queue) Truncate(mark int) {
	clear(q.entries[mark:])
	q.entries = q.entries[:mark]
}

// Write hands each writer its items, in the order they were queued (writers
// in the order of their first item), and empties the queue.
func (q *Queue) Write(ctx context.Context, tx pgx.Tx) error {
	var order []Writer
	items := map[Writer][]any{}
	for _, e := range q.entries {
		if _, ok := items[e.w]; !ok {
			order = append(order, e.w)
		}
		items[e.w] = append(items[e.w], e.item)
	}
	q.Truncate(0)
	for _, w := range order {
		if err := w.WritePending(ctx, tx, items[w]); err != nil {
			return err
		}
	}
	return nil
}

type ctxKey struct{}

// With returns ctx carrying q.
func With(ctx context.Context, q *Queue) context.Context { return context.WithValue(ctx, ctxKey{}, q) }

// From returns the queue ctx carries, or nil.
func From(ctx context.Context) *Queue {
	q, _ := ctx.Value(ctxKey{}).(*Queue)
	return q
}

// Wakes collects the wake-ups a transaction owes: the NOTIFY channels of
// the outboxes it wrote to, which the code that commits it sends after the
// commit, outside the transaction. A NOTIFY inside a transaction takes a
// database-wide lock at its commit and holds it until the commit is
// flushed, so that every notifying transaction commits in turn; sent after
// the commit, and merged, the wake-ups cost the transactions nothing.
type Wakes struct{ channels []string }

// Add owes a wake-up on channel.
func (w *Wakes) Add(channel string) {
	if !slices.Contains(w.channels, channel) {
		w.channels = append(w.channels, channel)
	}
}

// Channels returns the channels owed.
func (w *Wakes) Channels() []string { return w.channels }

type wakesKey struct{}

// WithWakes returns ctx carrying w: writers that see it owe their wake-ups
// to w instead of sending them inside the transaction.
func WithWakes(ctx context.Context, w *Wakes) context.Context {
	return context.WithValue(ctx, wakesKey{}, w)
}

// WakesFrom returns the Wakes of ctx, or nil.
func WakesFrom(ctx context.Context) *Wakes {
	w, _ := ctx.Value(wakesKey{}).(*Wakes)
	return w
}
