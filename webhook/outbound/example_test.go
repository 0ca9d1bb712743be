package outbound_test

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/webhook/outbound"
)

// Enqueue a webhook in the same transaction as the business write, and run a
// dispatcher that delivers it.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/app") // the schema comes from package migrations
	if err != nil {
		log.Fatal(err)
	}
	store, err := outbound.NewStore(outbound.Config{})
	if err != nil {
		log.Fatal(err)
	}
	sub, err := store.CreateSubscription(ctx, pool, outbound.Subscription{
		URL:        "https://customer.example/webhooks",
		EventTypes: []string{"order.*"},
	})
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("give the customer their signing secret: %s", sub.Secrets[0])

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE orders SET state = 'paid' WHERE id = $1`, 42); err != nil {
			return err
		}
		_, err := store.Enqueue(ctx, tx, outbound.Event{
			ID: "order-42-paid", Type: "order.paid", Payload: []byte(`{"order":42,"state":"paid"}`),
		})
		return err
	})
	if err != nil {
		log.Fatal(err)
	}

	d, err := outbound.NewDispatcher(outbound.DispatcherConfig{Pool: pool})
	if err != nil {
		log.Fatal(err)
	}
	if err := d.Run(ctx); err != nil { // until ctx is done
		log.Fatal(err)
	}
}
