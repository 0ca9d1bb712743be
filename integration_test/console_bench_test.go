package integration_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/internal/topicread"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook/outbound"
)

// consoleBenchScale is ONCELY_CONSOLE_BENCH_SCALE, the factor of the
// console benchmarks' volumes (default 1).
func consoleBenchScale(b *testing.B) float64 {
	b.Helper()
	scale := 1.0
	if v := os.Getenv("ONCELY_CONSOLE_BENCH_SCALE"); v != "" {
		var err error
		if scale, err = strconv.ParseFloat(v, 64); err != nil || scale <= 0 {
			b.Fatalf("ONCELY_CONSOLE_BENCH_SCALE: %q is not a positive number", v)
		}
	}
	return scale
}

// timedPage renders the page at path and returns how long it took; it
// fails the benchmark unless the page is a 200 without an error on it.
func timedPage(b *testing.B, h http.Handler, path string) time.Duration {
	b.Helper()
	d, _ := timedPageBody(b, h, path)
	return d
}

// timedPageBody is timedPage that returns the page too.
func timedPageBody(b *testing.B, h http.Handler, path string) (time.Duration, string) {
	b.Helper()
	rec := httptest.NewRecorder()
	t0 := time.Now()
	h.ServeHTTP(rec, httptest.NewRequestWithContext(context.Background(), http.MethodGet, path, nil))
	d := time.Since(t0)
	if rec.Code != http.StatusOK || strings.Contains(rec.Body.String(), `class="err"`) {
		b.Fatalf("%s: %d %s", path, rec.Code, rec.Body.String())
	}
	return d, rec.Body.String()
}

// readSoFarRE finds, in a page's note, how many records of a dead-letter
// topic were indexed when it was rendered.
var readSoFarRE = regexp.MustCompile(`the (\d+) records read so far`)

// BenchmarkConsolePages renders each console page on real volumes:
// 1,000,000 inbox rows in 4 groups, 100,000 outbox rows (half pending over
// 64 shards, 1,000 parked, the rest sent) and 100,000 dead letters, and
// reports beside each page the time of its own queries (SQL and Kafka
// requests) run raw one after the other (raw-ms/op), and for the
// dead-letter pages and the overview the time of reading the dead-letter
// topic whole with dlq.List (list-ms/op), which those pages did on every
// view before the console indexed the topic. Every round is printed.
// ns/op counts page, raw and list together. ONCELY_CONSOLE_BENCH_SCALE
// scales the volumes (default 1).
//
//	make bench-console
func BenchmarkConsolePages(b *testing.B) {
	scale := consoleBenchScale(b)
	nInbox, nOutbox, nDead := int(1_000_000*scale), int(100_000*scale), int(100_000*scale)
	ctx := context.Background()
	k := testenv.NewKafka(b)
	db := testenv.Migrated(b)
	orders := k.CreateTopic(b, "orders", 6)
	dlqTopic := dlq.DefaultTopic(orders)
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
	producer := k.Client(b, kgo.ProducerLinger(5*time.Millisecond), kgo.MaxBufferedRecords(50_000), kgo.RecordPartitioner(kgo.ManualPartitioner()))
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
	// Consumer lag: 4 groups committed half of the 6,000 records of the
	// source topic.
	for i := range 6000 {
		producer.Produce(ctx, &kgo.Record{Topic: orders, Partition: int32(i % 6), Value: []byte("o")}, nil)
	}
	if err := producer.Flush(ctx); err != nil {
		b.Fatal(err)
	}
	var commits kadm.Offsets
	for p := range int32(6) {
		commits.AddOffset(orders, p, 500, -1)
	}
	for g := range 4 {
		if _, err := kadm.NewClient(producer).CommitOffsets(ctx, "group-"+strconv.Itoa(g), commits); err != nil {
			b.Fatal(err)
		}
	}
	b.Logf("seeded %d inbox rows, %d outbox rows, %d dead letters in %s", nInbox, nOutbox, nDead, time.Since(start).Round(time.Millisecond))

	cfg := console.Config{Pool: db.Pool, Schema: db.Schema, DeadLetterTopics: []string{dlqTopic}, Timeout: 5 * time.Minute,
		KafkaOpts: append([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, k.ClientOpts...), InboxRetention: 7 * 24 * time.Hour}
	h, err := console.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	get := func(h http.Handler, path string) time.Duration { return timedPage(b, h, path) }
	// The first view of a dead-letter topic reads it whole (dlq-cold
	// measures it); Console.Run does that at start-up. The pages below are
	// measured after it.
	get(h, "/dlq?topic="+dlqTopic)

	ob, err := outbox.New(outbox.Config{Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	in, err := dedup.New(dedup.Config{Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	hooks, err := outbound.NewStore(outbound.Config{Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	adm := kadm.NewClient(k.Client(b))
	queries := func(qs ...string) error {
		for _, q := range qs {
			if _, err := db.Pool.Exec(ctx, q); err != nil {
				return fmt.Errorf("%s: %w", q, err)
			}
		}
		return nil
	}
	// raw runs a page's own queries (SQL and Kafka requests), one after
	// the other, as the console runs them, without rendering; dlq.List, the
	// whole topic read that the dead-letter pages did on every view before
	// the index, is measured beside them as list-ms.
	raw := map[string]func() error{}
	raw["inbox"] = func() error {
		if _, err := in.EstimateRows(ctx, db.Pool); err != nil {
			return err
		}
		return queries(`SELECT min(processed_at) FROM inbox`, `WITH RECURSIVE groups AS (
			SELECT min(consumer_group) AS g FROM inbox
			UNION ALL
			SELECT (SELECT min(consumer_group) FROM inbox WHERE consumer_group > groups.g) FROM groups WHERE g IS NOT NULL),
		sample AS (SELECT consumer_group, count(*) FILTER (WHERE outcome = 'processed') AS processed,
			count(*) FILTER (WHERE outcome = 'dead_lettered') AS dead, count(*) AS total FROM inbox TABLESAMPLE SYSTEM (`+fmt.Sprint(min(100, 100*20_000/float64(nInbox)))+`) GROUP BY consumer_group)
		SELECT groups.g, coalesce(sample.processed, 0), coalesce(sample.dead, 0), coalesce(sample.total, 0)
		FROM groups LEFT JOIN sample ON sample.consumer_group = groups.g WHERE groups.g IS NOT NULL ORDER BY groups.g`)
	}
	raw["inbox-lookup"] = func() error {
		if err := raw["inbox"](); err != nil {
			return err
		}
		return queries(`WITH RECURSIVE groups AS (
			SELECT min(consumer_group) AS g FROM inbox
			UNION ALL
			SELECT (SELECT min(consumer_group) FROM inbox WHERE consumer_group > groups.g) FROM groups WHERE g IS NOT NULL)
		SELECT i.consumer_group, i.message_id, i.outcome, i.processed_at, i.topic, i.partition, i."offset"
		FROM groups JOIN inbox i ON i.consumer_group = groups.g AND i.message_id = 'msg-` + strconv.Itoa(nInbox/2) + `'
		ORDER BY i.consumer_group`)
	}
	// Exact counts, on request: every row read.
	raw["inbox-exact"] = func() error {
		return queries(`SELECT min(processed_at) FROM inbox`, `SELECT consumer_group, count(*) FILTER (WHERE outcome = 'processed') AS processed,
			count(*) FILTER (WHERE outcome = 'dead_lettered') AS dead, count(*) AS total FROM inbox GROUP BY consumer_group ORDER BY consumer_group`)
	}
	raw["outbox"] = func() error {
		if _, err := ob.Status(ctx, db.Pool); err != nil {
			return err
		}
		if err := queries(`SELECT topic, shard, count(*), now() - min(created_at) FROM outbox
			WHERE sent_at IS NULL AND parked_at IS NULL GROUP BY topic, shard ORDER BY topic, shard LIMIT 1000`); err != nil {
			return err
		}
		_, err := ob.ParkedAfter(ctx, db.Pool, 0, 101)
		return err
	}
	raw["webhooks"] = func() error {
		if _, err := hooks.Overviews(ctx, db.Pool); err != nil {
			return err
		}
		const cols = `subscription_id, webhook_id, event_type, status, attempts, last_status, coalesce(last_error, ''), updated_at`
		return queries(`SELECT `+cols+` FROM webhook_deliveries
			WHERE status <> 'delivered' AND last_error IS NOT NULL AND last_error <> '' ORDER BY updated_at DESC LIMIT 50`,
			`SELECT `+cols+` FROM webhook_deliveries WHERE status = 'dead' ORDER BY dead_at DESC LIMIT 500`)
	}
	offsets := func() error {
		_, err := adm.ListStartOffsets(ctx, dlqTopic)
		if err == nil {
			_, err = adm.ListEndOffsets(ctx, dlqTopic)
		}
		return err
	}
	raw["dlq"] = offsets
	raw["record"] = func() error {
		if err := offsets(); err != nil {
			return err
		}
		// As the page fetches one record: the batch that holds it.
		return topicread.Range(ctx, append(slices.Clone(cfg.KafkaOpts), kgo.FetchMaxPartitionBytes(1)), dlqTopic, map[int32]int64{0: int64(nDead / 2)}, map[int32]int64{0: int64(nDead/2 + 1)},
			func(*kgo.Record) error { return nil })
	}
	// The dry run of "redrive all permanent" (a third of the dead
	// letters): their inbox outcomes, in a query per group and 10,000 ids.
	permanent := map[string][]string{}
	for i := 0; i < nDead; i += 3 {
		g := "group-" + strconv.Itoa(i%4)
		permanent[g] = append(permanent[g], "msg-"+strconv.Itoa(i*100))
	}
	raw["dlq-confirm"] = func() error {
		if err := offsets(); err != nil {
			return err
		}
		for g, ids := range permanent {
			for batch := range slices.Chunk(ids, 10_000) {
				if _, err := in.LookupMany(ctx, db.Pool, g, batch); err != nil {
					return err
				}
			}
		}
		return nil
	}
	raw["overview"] = func() error {
		groups, err := adm.ListGroups(ctx)
		if err != nil {
			return err
		}
		if _, err := adm.Lag(ctx, groups.Groups()...); err != nil {
			return err
		}
		if err := offsets(); err != nil {
			return err
		}
		if err := raw["inbox"](); err != nil {
			return err
		}
		if _, err := ob.Status(ctx, db.Pool); err != nil {
			return err
		}
		if err := queries(`SELECT topic, count(*) FILTER (WHERE parked_at IS NULL),
			coalesce(now() - min(created_at) FILTER (WHERE parked_at IS NULL), '0'),
			count(*) FILTER (WHERE parked_at IS NOT NULL), min(parked_at)
			FROM outbox WHERE sent_at IS NULL GROUP BY topic ORDER BY topic LIMIT 500`); err != nil {
			return err
		}
		if _, err := hooks.Overviews(ctx, db.Pool); err != nil {
			return err
		}
		return db.Pool.Ping(ctx)
	}
	list := func() error {
		_, err := dlq.List(ctx, cfg.KafkaOpts, dlqTopic, dlq.Filter{})
		return err
	}
	pages := []struct {
		name, path, rawKey string
		list               bool // measure dlq.List beside
	}{
		{"overview", "/", "overview", true},
		{"dlq", "/dlq?topic=" + dlqTopic, "dlq", true},
		{"dlq-page-500", "/dlq?topic=" + dlqTopic + "&after=0/" + strconv.Itoa(nDead/2), "dlq", false},
		{"dlq-filtered", "/dlq?topic=" + dlqTopic + "&class=permanent&text=failure+7", "dlq", true},
		{"record", "/record?topic=" + dlqTopic + "&ref=0/" + strconv.Itoa(nDead/2), "record", true},
		{"dlq-confirm", "/dlq-confirm?all=1&class=permanent&topic=" + dlqTopic, "dlq-confirm", true},
		{"outbox", "/outbox", "outbox", false},
		{"inbox", "/inbox", "inbox", false},
		{"inbox-lookup", "/inbox?message_id=msg-" + strconv.Itoa(nInbox/2), "inbox-lookup", false},
		{"inbox-exact", "/inbox?exact=1", "inbox-exact", false},
		{"webhooks", "/webhooks", "webhooks", false},
	}
	for _, p := range pages {
		b.Run(p.name, func(b *testing.B) {
			var rawTotal, pageTotal, listTotal time.Duration
			round := 0
			for b.Loop() {
				round++
				page := get(h, p.path)
				pageTotal += page
				t0 := time.Now()
				if err := raw[p.rawKey](); err != nil {
					b.Fatal(err)
				}
				r := time.Since(t0)
				rawTotal += r
				line := fmt.Sprintf("console bench: %-13s round %d: page %7.1f ms, raw %7.1f ms", p.name, round, ms(page), ms(r))
				if p.list {
					t0 := time.Now()
					if err := list(); err != nil {
						b.Fatal(err)
					}
					l := time.Since(t0)
					listTotal += l
					line += fmt.Sprintf(", dlq.List %7.1f ms", ms(l))
				}
				fmt.Fprintln(os.Stderr, line)
			}
			b.ReportMetric(ms(rawTotal)/float64(b.N), "raw-ms/op")
			b.ReportMetric(ms(pageTotal)/float64(b.N), "page-ms/op")
			if p.list {
				b.ReportMetric(ms(listTotal)/float64(b.N), "list-ms/op")
			}
		})
	}
	// The first view of the overview and of the dead-letter list in a
	// console just started, without Console.Run: each reads the dead-letter
	// topic whole once.
	for _, p := range []struct{ name, path string }{{"overview-cold", "/"}, {"dlq-cold", "/dlq?topic=" + dlqTopic}} {
		b.Run(p.name, func(b *testing.B) {
			var pageTotal, listTotal time.Duration
			round := 0
			for b.Loop() {
				round++
				fresh, err := console.New(cfg)
				if err != nil {
					b.Fatal(err)
				}
				page, body := timedPageBody(b, fresh, p.path)
				pageTotal += page
				shown := "all"
				if m := readSoFarRE.FindStringSubmatch(body); m != nil {
					shown = m[1]
				}
				t0 := time.Now()
				if err := list(); err != nil {
					b.Fatal(err)
				}
				l := time.Since(t0)
				listTotal += l
				fmt.Fprintf(os.Stderr, "console bench: %-13s round %d: page %7.1f ms, dlq.List %7.1f ms (records indexed when shown: %s of %d)\n",
					p.name, round, ms(page), ms(l), shown, nDead)
			}
			b.ReportMetric(ms(pageTotal)/float64(b.N), "page-ms/op")
			b.ReportMetric(ms(listTotal)/float64(b.N), "list-ms/op")
		})
	}
	fmt.Fprintln(os.Stderr, "console bench: pages rendered against", nInbox, "inbox rows,", nOutbox, "outbox rows,", nDead, "dead letters")
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
