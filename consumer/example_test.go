package consumer_test

import (
	"context"
	"encoding/json"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/migrations"
)

// amount reads the order's amount; a real handler would dead-letter a
// value that does not decode (see consumer.DecodeJSON).
func amount(msg *consumer.Message) int64 {
	var order struct{ Cents int64 }
	_ = json.Unmarshal(msg.Value, &order)
	return order.Cents
}

// run is the README's Usage section: migrate, then consume until ctx is
// cancelled, each record's effect committed with its message id.
func run(ctx context.Context) error {
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	mig, _ := migrations.New(pool, migrations.Config{}) // schema "oncely"
	if _, err := mig.Up(ctx); err != nil {              // locked: replicas may start together
		return err
	}
	c, err := consumer.New(consumer.Config{
		Brokers: []string{"localhost:9092"},
		Topics:  []string{"orders"},
		Group:   "orderworker",
		Pool:    pool,
		// Runs once per message id, inside the transaction that claimed the id.
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			_, err := tx.Exec(ctx, `UPDATE balances SET cents = cents + $2 WHERE id = $1`, msg.Key, amount(msg))
			return err // an error rolls back and retries with backoff
		},
		InstanceID: os.Getenv("HOSTNAME"), // static membership: restarts do not rebalance the group
	})
	if err != nil {
		return err // config errors name the field
	}
	return c.Run(ctx) // returns after a bounded, graceful drain when ctx is cancelled
}

// A consumer whose handler's writes happen once per message id. Compiled,
// not run: it needs a Kafka broker (see oncelytest for a test kit).
func Example() {
	if err := run(context.Background()); err != nil {
		os.Exit(1)
	}
}
