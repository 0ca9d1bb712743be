package integration_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/outbox"
)

// fillOutbox enqueues n messages over 200 keys in transactions of 500.
func fillOutbox(b *testing.B, db *testenv.DB, o *outbox.Outbox, topic string, n int) {
	b.Helper()
	ctx := context.Background()
	for i := 0; i < n; i += 500 {
		var msgs []outbox.Message
		for j := i; j < min(i+500, n); j++ {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("key-", j%200)), Value: make([]byte, 100)})
		}
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { _, err := o.Enqueue(ctx, tx, msgs...); return err }); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkOutbox compares the relay (rows to an in-process Kafka broker,
// acks=all, marked sent) with a raw-SQL ceiling: the same batches of the same
// rows selected per shard in id order and marked sent, without Kafka. Both
// report events/s; the ratio is what Kafka and the relay's bookkeeping cost.
//
//	go test -run '^$' -bench BenchmarkOutbox -benchtime 20000x ./integration_test/
func BenchmarkOutbox(b *testing.B) {
	b.Run("raw-sql", func(b *testing.B) {
		db := testenv.Migrated(b)
		o, _ := outbox.New(outbox.Config{Schema: db.Schema})
		fillOutbox(b, db, o, "bench", b.N)
		ctx := context.Background()
		sel := `SELECT id, message_id, topic, key, value, header_keys, header_values FROM outbox
			WHERE shard = $1 AND sent_at IS NULL ORDER BY id LIMIT 500`
		b.ResetTimer()
		start := time.Now()
		for done := 0; done < b.N; {
			for shard := range outbox.DefaultShards {
				err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					var ok bool
					if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(hashtext('bench'), $1)`, shard).Scan(&ok); err != nil {
						return err
					}
					rows, err := tx.Query(ctx, sel, shard)
					if err != nil {
						return err
					}
					var ids []int64
					for rows.Next() {
						vals, err := rows.Values()
						if err != nil {
							return err
						}
						ids = append(ids, vals[0].(int64))
					}
					if err := rows.Err(); err != nil {
						return err
					}
					done += len(ids)
					_, err = tx.Exec(ctx, `UPDATE outbox SET sent_at = now() WHERE id = ANY($1)`, ids)
					return err
				})
				if err != nil {
					b.Fatal(err)
				}
			}
		}
		b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "events/s")
	})
	b.Run("relay", func(b *testing.B) {
		db := testenv.Migrated(b)
		k := testenv.NewKafka(b)
		topic := k.CreateTopic(b, "bench", 8)
		o, _ := outbox.New(outbox.Config{Schema: db.Schema})
		fillOutbox(b, db, o, topic, b.N)
		relay, err := outbox.NewRelay(outbox.RelayConfig{Outbox: outbox.Config{Schema: db.Schema}, Pool: db.Pool,
			Brokers: k.Brokers, PollInterval: 10 * time.Millisecond})
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		b.ResetTimer()
		start := time.Now()
		go func() { done <- relay.Run(ctx) }()
		for relay.Stats().Published < int64(b.N) {
			time.Sleep(time.Millisecond) // polling a counter, not synchronising work
		}
		elapsed := time.Since(start)
		b.StopTimer()
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(b.N)/elapsed.Seconds(), "events/s")
	})
}
