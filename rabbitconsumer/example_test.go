package rabbitconsumer_test

import (
	"context"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/rabbitconsumer"
)

// A worker of the orders quorum queue: each order's effect happens once,
// however often RabbitMQ delivers it. Dead letters go to the queue
// orders.dlq, through the default exchange.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	c, err := rabbitconsumer.New(rabbitconsumer.Config{
		URL: "amqp://guest:guest@localhost:5672/", Queues: []string{"orders"}, Group: "order-worker", Pool: pool,
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO orders (id, body) VALUES ($1, $2)`, m.ID, m.Value)
			return err
		},
		MaxAttempts: 5, Concurrency: 8,
	})
	if err != nil {
		panic(err)
	}
	if err := c.Run(ctx); err != nil {
		panic(err)
	}
}
