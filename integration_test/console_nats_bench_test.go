package integration_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/natsconsumer"
)

// BenchmarkConsoleJetStreamPages renders the dead-letter pages of a
// JetStream dead-letter stream of 10,000 dead letters (on the local
// nats-server) and reports beside each the time of reading the stream
// whole with natsconsumer.DeadLetters (list-ms/op), which a console
// without an index would do on every view, measured in the same round.
// dlq-cold is the first view in a console just started (the whole stream
// read, headers only); the others are views after it (only what the stream
// gained, here nothing). ONCELY_CONSOLE_BENCH_SCALE scales the volume.
//
//	go test -run '^$' -bench BenchmarkConsoleJetStreamPages -benchtime 5x ./integration_test/
func BenchmarkConsoleJetStreamPages(b *testing.B) {
	nDead := int(10_000 * consoleBenchScale(b))
	ctx := context.Background()
	db := testenv.Migrated(b)
	nc, err := nats.Connect(natsURL, nats.MaxReconnects(0))
	if err != nil {
		b.Fatalf("connect to NATS at %s: %v", natsURL, err)
	}
	b.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		b.Fatal(err)
	}
	name := strings.ToUpper(strings.NewReplacer("-", "_", ".", "_").Replace(testenv.UniqueName("bench")))
	stream := name + "_DLQ"
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{"dlq." + name + ".>"}}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })

	start := time.Now()
	now := time.Now()
	for i := range nDead {
		info := &dlq.Info{Topic: name + ".orders", Offset: int64(i + 1), Group: "workers-" + strconv.Itoa(i%4),
			MessageID: "msg-" + strconv.Itoa(i), Attempts: 3, FirstFailure: now, LastFailure: now,
			Class: []dlq.Class{dlq.ClassPermanent, dlq.ClassMaxAttempts, dlq.ClassUndecodable}[i%3], Error: "failure " + strconv.Itoa(i%50)}
		m := nats.NewMsg("dlq." + name + ".orders")
		m.Data = []byte(`{"order":` + strconv.Itoa(i) + `,"lines":["` + strings.Repeat("x", 200) + `"]}`)
		for _, h := range info.Headers() {
			m.Header.Add(h.Key, string(h.Value))
		}
		if _, err := js.PublishMsgAsync(m); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		b.Fatal("the dead letters were not all acknowledged in a minute")
	}
	b.Logf("seeded %d dead letters in %s", nDead, time.Since(start).Round(time.Millisecond))

	cfg := console.Config{Pool: db.Pool, Schema: db.Schema, JetStream: js, DeadLetterStreams: []string{stream}, Timeout: 5 * time.Minute}
	h, err := console.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	list := func() time.Duration {
		t0 := time.Now()
		entries, err := natsconsumer.DeadLetters(ctx, js, stream, dlq.Filter{})
		if err != nil || len(entries) != nDead {
			b.Fatalf("DeadLetters: %d entries, %v; want %d", len(entries), err, nDead)
		}
		return time.Since(t0)
	}
	timedPage(b, h, "/dlq?stream="+stream) // the index read once: the pages below are views after it

	pages := []struct {
		name, path string
		cold       bool // a console just started
	}{
		{"dlq-cold", "/dlq?stream=" + stream, true},
		{"overview", "/", false},
		{"dlq", "/dlq?stream=" + stream, false},
		{"dlq-filtered", "/dlq?stream=" + stream + "&class=permanent&text=failure+7", false},
		{"record", "/record?stream=" + stream + "&ref=0/" + strconv.Itoa(nDead/2), false},
		{"dlq-confirm", "/dlq-confirm?all=1&class=permanent&stream=" + stream, false},
	}
	for _, p := range pages {
		b.Run(p.name, func(b *testing.B) {
			var pageTotal, listTotal time.Duration
			round := 0
			for b.Loop() {
				round++
				ch := h
				if p.cold {
					if ch, err = console.New(cfg); err != nil {
						b.Fatal(err)
					}
				}
				page := timedPage(b, ch, p.path)
				l := list()
				pageTotal, listTotal = pageTotal+page, listTotal+l
				fmt.Fprintf(os.Stderr, "console jetstream bench: %-12s round %d: page %7.1f ms, DeadLetters %7.1f ms (%d dead letters)\n",
					p.name, round, ms(page), ms(l), nDead)
			}
			b.ReportMetric(ms(pageTotal)/float64(b.N), "page-ms/op")
			b.ReportMetric(ms(listTotal)/float64(b.N), "list-ms/op")
		})
	}
}
