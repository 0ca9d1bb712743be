package integration_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
)

// BenchmarkConsolePages renders each console page on real volumes:
// 1,000,000 inbox rows in 4 groups, 100,000 outbox rows (half pending over
// 64 shards, 1,000 parked, the rest sent) and 100,000 dead letters, and
// reports beside each page the time of its own queries run raw
// (raw-ms/op; ns/op counts both). ONCELY_CONSOLE_BENCH_SCALE scales the volumes (default 1).
//
//	make bench-console
func BenchmarkConsolePages(b *testing.B) {
	scale := 1.0
	if v := os.Getenv("ONCELY_CONSOLE_BENCH_SCALE"); v != "" {
		var err error
		if scale, err = strconv.ParseFloat(v, 64); err != nil || scale <= 0 {
			b.Fatalf("ONCELY_CONSOLE_BENCH_SCALE: %q is not a positive number", v)
		}
	}
	nInbox, nOutbox, nDead := int(1_000_000*scale), int(100_000*scale), int(100_000*scale)
	ctx := context.Background()
	k := testenv.NewKafka(b)
	db := testenv.Migrated(b)
	dlqTopic := dlq.DefaultTopic(k.CreateTopic(b, "orders", 1))
	k.CreateTopicNamed(b, dlqTopic, 1)

	start := time.Now()
	for _, q := range []string{
		`INSERT INTO inbox (consumer_group, message_id, topic, partition, "offset", outcome, processed_at)
			SELECT 'group-' || (i % 4), 'msg-' || i, 'orders', i % 6, i, CASE WHEN i % 100 = 0 THEN 'dead_lettered' ELSE 'processed' END,
				now() - make_interval(secs => i % 86400)
			FROM generate_series(1, ` + strconv.Itoa(nInbox) + `) i`,
		`INSERT INTO outbox (message_id, topic, key, value, shard, created_at, sent_at, parked_at, error)
			SELECT 'ob-' || i, 'events-' || (i % 5), ('k' || i)::bytea, 'payload'::bytea, i % 64, now() - make_interval(secs => i % 3600),
				CASE WHEN i % 2 = 0 THEN now() END,
				CASE WHEN i % 2 = 1 AND i % 100 = 1 THEN now() END,
				CASE WHEN i % 2 = 1 AND i % 100 = 1 THEN 'MESSAGE_TOO_LARGE' END
			FROM generate_series(1, ` + strconv.Itoa(nOutbox) + `) i`,
		`ANALYZE inbox`, `ANALYZE outbox`,
	} {
		if _, err := db.Pool.Exec(ctx, q); err != nil {
			b.Fatal(err)
		}
	}
	producer := k.Client(b, kgo.ProducerLinger(5*time.Millisecond), kgo.MaxBufferedRecords(50_000))
	now := time.Now()
	for i := range nDead {
		info := &dlq.Info{Topic: "orders", Partition: int32(i % 6), Offset: int64(i), Group: "group-" + strconv.Itoa(i%4),
			MessageID: "msg-" + strconv.Itoa(i*100), Attempts: 3, FirstFailure: now, LastFailure: now,
			Class: []dlq.Class{dlq.ClassPermanent, dlq.ClassMaxAttempts, dlq.ClassUndecodable}[i%3], Error: "failure " + strconv.Itoa(i%50)}
		producer.Produce(ctx, &kgo.Record{Topic: dlqTopic, Value: []byte(`{"order":` + strconv.Itoa(i) + `}`), Headers: info.Headers()}, func(_ *kgo.Record, err error) {
			if err != nil {
				b.Error(err)
			}
		})
	}
	if err := producer.Flush(ctx); err != nil {
		b.Fatal(err)
	}
	b.Logf("seeded %d inbox rows, %d outbox rows, %d dead letters in %s", nInbox, nOutbox, nDead, time.Since(start).Round(time.Millisecond))

	h, err := console.New(console.Config{Pool: db.Pool, Schema: db.Schema, DeadLetterTopics: []string{dlqTopic}, Timeout: 5 * time.Minute,
		KafkaOpts: append([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, k.ClientOpts...)})
	if err != nil {
		b.Fatal(err)
	}
	// raw runs the page's own queries, as the library runs them, without
	// rendering.
	raw := map[string]func() error{
		"inbox": func() error {
			return db.Pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT consumer_group, count(*) FILTER (WHERE outcome = 'processed'),
				count(*) FILTER (WHERE outcome = 'dead_lettered'), count(*) FROM inbox GROUP BY consumer_group) s`).Scan(new(int))
		},
		"outbox": func() error {
			if _, err := db.Pool.Exec(ctx, `SELECT count(*) FILTER (WHERE sent_at IS NULL AND parked_at IS NULL),
				now() - min(created_at) FILTER (WHERE sent_at IS NULL AND parked_at IS NULL),
				count(*) FILTER (WHERE sent_at IS NOT NULL), count(*) FILTER (WHERE parked_at IS NOT NULL AND sent_at IS NULL) FROM outbox`); err != nil {
				return err
			}
			_, err := db.Pool.Exec(ctx, `SELECT topic, shard, count(*), now() - min(created_at) FROM outbox
				WHERE sent_at IS NULL AND parked_at IS NULL GROUP BY topic, shard ORDER BY topic, shard LIMIT 1000`)
			return err
		},
		"dlq": func() error {
			_, err := dlq.List(ctx, append([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, k.ClientOpts...), dlqTopic, dlq.Filter{})
			return err
		},
	}
	pages := []struct{ name, path, rawKey string }{
		{"overview", "/", ""},
		{"dlq", "/dlq?topic=" + dlqTopic, "dlq"},
		{"dlq-filtered", "/dlq?topic=" + dlqTopic + "&class=permanent&text=failure+7", "dlq"},
		{"record", "/record?topic=" + dlqTopic + "&ref=0/" + strconv.Itoa(nDead/2), "dlq"},
		{"outbox", "/outbox", "outbox"},
		{"inbox-lookup", "/inbox?message_id=msg-" + strconv.Itoa(nInbox/2), "inbox"},
		{"webhooks", "/webhooks", ""},
	}
	for _, p := range pages {
		b.Run(p.name, func(b *testing.B) {
			var rawTotal, pageTotal time.Duration
			for b.Loop() {
				rec := httptest.NewRecorder()
				t0 := time.Now()
				h.ServeHTTP(rec, httptest.NewRequestWithContext(context.Background(), http.MethodGet, p.path, nil))
				pageTotal += time.Since(t0)
				if rec.Code != http.StatusOK || strings.Contains(rec.Body.String(), `class="err"`) {
					b.Fatalf("%s: %d %s", p.path, rec.Code, rec.Body.String())
				}
				if f := raw[p.rawKey]; f != nil {
					t0 := time.Now()
					if err := f(); err != nil {
						b.Fatal(err)
					}
					rawTotal += time.Since(t0)
				}
			}
			b.ReportMetric(float64(rawTotal.Microseconds())/1000/float64(b.N), "raw-ms/op")
			b.ReportMetric(float64(pageTotal.Microseconds())/1000/float64(b.N), "page-ms/op")
		})
	}
	fmt.Fprintln(os.Stderr, "console bench: pages rendered against", nInbox, "inbox rows,", nOutbox, "outbox rows,", nDead, "dead letters")
}
