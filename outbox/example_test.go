package outbox_test

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/outbox"
)

// accept is the README's outbox section: the order row and its event commit
// together, or neither does.
func accept(ctx context.Context, pool *pgxpool.Pool, ob *outbox.Outbox, orderID string, event []byte) error {
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id) VALUES ($1)`, orderID); err != nil {
			return err
		}
		_, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: "order-events", Key: []byte(orderID), Value: event})
		return err // rolled back: nothing is published
	})
	return err
}

// An event enqueued in the transaction of the write it announces; a Relay
// publishes it after the commit. Compiled, not run: it needs a database.
func Example() {
	_ = accept
}
