package natsconsumer_test

import (
	"context"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/natsconsumer"
)

// A worker of the ORDERS stream: each order's effect happens once, however
// often JetStream delivers it. Dead letters go to dlq.<subject>, which a
// stream (here ORDERS_DLQ, subjects dlq.orders.>) must capture.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		panic(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		panic(err)
	}
	c, err := natsconsumer.New(natsconsumer.Config{
		JetStream: js, Stream: "ORDERS", Durable: "order-worker", Pool: pool,
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
