package integration_test

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/rabbitconsumer"
)

// BenchmarkConsoleRabbitPages renders the dead-letter pages of a RabbitMQ
// dead-letter queue (a quorum queue) of 10,000 dead letters and reports
// beside each the time of one listing of the queue by
// rabbitconsumer.OpenDeadLetters, Entries and Close (list-ms/op), measured
// in the same round. The pages are served from the console's snapshot of
// the queue (its last listing), which a dry run made first: a view costs
// a passive declaration of the queue (its count) and the rendering.
// dlq-cold is the first view in a console just started: it starts the
// listing in the background and shows, after Config.ViewWait, a note that
// it goes on. A confirmed redrive, not measured here, lists the queue
// twice. ONCELY_CONSOLE_BENCH_SCALE scales the volume.
//
//	go test -run '^$' -bench BenchmarkConsoleRabbitPages -benchtime 3x ./integration_test/
//
// publishDeadLetters publishes n dead letters of queue source to queue
// queue, the i-th with the oncely-dlq headers of info and the body that
// deadLetter(i) gives, persistent, in confirm mode on ch, and waits for
// every confirmation.
func publishDeadLetters(tb testing.TB, ch *amqp.Channel, queue, source string, n int, deadLetter func(i int) (info *dlq.Info, body []byte)) {
	tb.Helper()
	if err := ch.Confirm(false); err != nil {
		tb.Fatal(err)
	}
	confirms := make([]*amqp.DeferredConfirmation, 0, n)
	for i := range n {
		info, body := deadLetter(i)
		h := amqp.Table{rabbitconsumer.HeaderQueue: source}
		for _, x := range info.Headers() {
			h[x.Key] = string(x.Value)
		}
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", queue, true, false, amqp.Publishing{
			MessageId: info.MessageID, Headers: h, DeliveryMode: amqp.Persistent, Body: body})
		if err != nil {
			tb.Fatal(err)
		}
		confirms = append(confirms, dc)
	}
	for _, dc := range confirms {
		if ok, err := dc.WaitContext(context.Background()); !ok || err != nil {
			tb.Fatalf("publish not confirmed: %v", err)
		}
	}
}

func BenchmarkConsoleRabbitPages(b *testing.B) {
	nDead := int(10_000 * consoleBenchScale(b))
	ctx := context.Background()
	db := testenv.Migrated(b)
	conn, err := amqp.Dial(rabbitURL)
	if err != nil {
		b.Fatalf("connect to RabbitMQ at %s: %v", rabbitAddr, err)
	}
	b.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	source := testenv.UniqueName("bench-rabbit")
	queue := rabbitconsumer.DefaultDeadLetterRoutingKey(source)
	// The source queue too: the overview shows its backlog.
	for _, q := range []string{source, queue} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _, _ = ch.QueueDelete(q, false, false, false) })
	}
	start := time.Now()
	now := time.Now()
	publishDeadLetters(b, ch, queue, source, nDead, func(i int) (*dlq.Info, []byte) {
		return &dlq.Info{Topic: source, Offset: int64(i + 1), Group: "workers-" + strconv.Itoa(i%4),
				MessageID: "msg-" + strconv.Itoa(i), Attempts: 3, FirstFailure: now, LastFailure: now, Timestamp: now,
				Class: []dlq.Class{dlq.ClassPermanent, dlq.ClassMaxAttempts, dlq.ClassUndecodable}[i%3], Error: "failure " + strconv.Itoa(i%50)},
			[]byte(`{"order":` + strconv.Itoa(i) + `,"lines":["` + strings.Repeat("x", 200) + `"]}`)
	})
	b.Logf("seeded %d dead letters in %s", nDead, time.Since(start).Round(time.Millisecond))
	ready := func() {
		testenv.Eventually(b, time.Minute, "the dead letters back in the queue", func() bool {
			st, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
			return err == nil && st.Messages == nDead
		})
	}
	ready()

	h, err := console.New(console.Config{Pool: db.Pool, Schema: db.Schema, AMQPURL: rabbitURL,
		DeadLetterQueues: []string{queue}, Timeout: 5 * time.Minute})
	if err != nil {
		b.Fatal(err)
	}
	list := func() time.Duration {
		t0 := time.Now()
		q, err := rabbitconsumer.OpenDeadLetters(ctx, rabbitURL, queue)
		if err != nil {
			b.Fatal(err)
		}
		entries, err := q.Entries(ctx, dlq.Filter{})
		_ = q.Close()
		if err != nil || len(entries) != nDead {
			b.Fatalf("Entries: %d entries, %v; want %d", len(entries), err, nDead)
		}
		return time.Since(t0)
	}
	// The snapshot: a dry run waits for the listing (and lists the queue
	// again when the snapshot is a minute old: before each page, so that no
	// view starts a listing that the baseline's would compete with).
	snapshot := func(h http.Handler) { timedPage(b, h, "/dlq-confirm?all=1&queue="+queue) }
	var cold http.Handler // the console of the last cold view, whose listing goes on after it
	// Each listing, the console's or the baseline's, is followed by the
	// wait for its messages to be back in the queue, not timed.
	benchDeadLetterPages(b, "rabbitmq", "listing", nDead, []benchPage{
		{"dlq-cold", "/dlq?queue=" + queue, true},
		{"overview", "/", false},
		{"dlq", "/dlq?queue=" + queue, false},
		{"dlq-filtered", "/dlq?queue=" + queue + "&class=permanent&text=failure+7", false},
		{"record", "/record?queue=" + queue + "&ref=0/" + strconv.Itoa(nDead/2), false},
		{"dlq-confirm", "/dlq-confirm?all=1&class=permanent&queue=" + queue, false},
	}, func(isCold bool) http.Handler {
		ready()
		if !isCold {
			snapshot(h)
			ready()
			return h
		}
		c, err := console.New(console.Config{Pool: db.Pool, Schema: db.Schema, AMQPURL: rabbitURL,
			DeadLetterQueues: []string{queue}, Timeout: 5 * time.Minute})
		if err != nil {
			b.Fatal(err)
		}
		cold = c
		return c
	}, func() time.Duration {
		if cold != nil { // its listing, which the baseline's would compete with, waited for
			snapshot(cold)
			cold = nil
		}
		ready()
		l := list()
		ready()
		return l
	})
}
