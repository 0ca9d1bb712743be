package integration_test

import (
	"context"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/internal/testenv"
)

var totalRE = regexp.MustCompile(`<td class="n">(\d+)</td></tr>`)

// section returns the part of page from the element with id to the end of
// its table.
func section(t *testing.T, page, id string) string {
	t.Helper()
	i := strings.Index(page, `id="`+id+`"`)
	if i < 0 {
		t.Fatalf("no %s in:\n%s", id, page)
	}
	j := strings.Index(page[i:], "</table>")
	if j < 0 {
		j = len(page) - i
	}
	return page[i : i+j]
}

// The overview says what is not ready and why: the runner's reasons
// (Config.Ready, each reason of its NotReadyError), a consumer group behind
// with no member, the parked outbox row, inbox rows past the cleaner's
// retention; and shows the dead letters over time, the outbox per topic, the
// inbox's horizon and the lag per group and topic. Console.Run samples until
// its context ends.
func TestConsoleOverviewSaysWhatIsNotReady(t *testing.T) {
	t.Parallel()
	env := seedConsole(t)
	ctx := context.Background()
	// One more record for the group, which has no member now.
	if err := env.producer.ProduceSync(ctx, &kgo.Record{Topic: env.topic, Value: []byte("late")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if _, err := env.db.Pool.Exec(ctx, `UPDATE inbox SET processed_at = now() - interval '3 hours' WHERE message_id = 'a'`); err != nil {
		t.Fatal(err)
	}
	runner := &oncely.NotReadyError{Reasons: []oncely.Reason{{Component: "outbox relay", Reason: "publish failed: broker down"},
		{Component: "database", Reason: "unreachable: timeout"}}}
	c, err := console.New(console.Config{Pool: env.db.Pool, Schema: env.db.Schema, ViewWait: testViewWait, KafkaOpts: env.consoleKafkaOpts,
		DeadLetterTopics: []string{env.dlqTopic}, InboxRetention: time.Hour, SampleInterval: 10 * time.Millisecond,
		Ready: func() error { return runner }})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c)
	t.Cleanup(srv.Close)
	page := getPage(t, srv.URL+"/")

	notReady := section(t, page, "not-ready")
	mustContain(t, "not ready", notReady, "outbox relay: publish failed: broker down", "database: unreachable: timeout",
		`consumer group &#34;`+env.group+`&#34;`, "1 records behind on "+env.topic+" and no member consumes (state Empty)",
		"1 parked rows hold their keys&#39; later rows back", "past the retention of 1h0m0s")

	// Dead letters over time: the six of the seed, in the last hours and days.
	for _, id := range []string{"dlq-hours", "dlq-days"} {
		sum := 0
		for _, m := range totalRE.FindAllStringSubmatch(section(t, page, id), -1) {
			n, _ := strconv.Atoi(m[1])
			sum += n
		}
		if sum != 6 {
			t.Errorf("%s counts %d dead letters, want 6:\n%s", id, sum, section(t, page, id))
		}
	}
	mustContain(t, "outbox per topic", section(t, page, "outbox-topics"), `<td>payments</td><td class="n">1</td>`)
	mustContain(t, "inbox horizon", page, "Oldest row:", "The cleaner deletes rows older than 1h0m0s")
	mustContain(t, "lag", section(t, page, "lag"), `<tr class="total"><td>`+env.group, "<th>trend</th>")

	// Run samples every interval until its context ends, then returns nil.
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	mustContain(t, "overview while running", getPage(t, srv.URL+"/"), "no member consumes")
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
}

// The overview shows a RabbitMQ queue's backlog (messages ready and
// consumers, by default of each dead-letter queue's source queue) and
// finds a queue with messages ready and no consumer not ready; once a
// consumer takes them, the queue shows its consumer and none ready.
func TestConsoleOverviewRabbitQueues(t *testing.T) {
	env := &rabbitConsoleEnv{rabbitEnv: newRabbitEnv(t), redriveRuns: newRedriveRuns()}
	env.publish(env.queue, "one", "m1", nil)
	env.publish(env.queue, "two", "m2", nil)
	env.settledIn(env.queue, 2)
	srv := mountConsole(t, console.Config{Pool: env.db.Pool, Schema: env.db.Schema, AMQPURL: rabbitURL,
		DeadLetterQueues: []string{env.dlq, env.dlq + "-missing.dlq"}})
	op := newOperator(t, "frank")
	over := op.get(srv.URL + "/ops/")
	mustContain(t, "overview, no consumer", over, `<section id="rabbitmq-lag">`,
		`<tr><td>`+env.queue+`</td><td class="n warn">0</td><td class="n warn">2</td><td class="n trend">-</td></tr>`,
		`<td>RabbitMQ queue &#34;`+env.queue+`&#34;</td><td class="warn">2 messages ready and no consumer</td>`,
		`<tr><td>`+env.dlq+`-missing</td><td colspan="3" class="err">no such queue</td></tr>`)

	env.start(t.Context(), env.config(env.handler()))
	testenv.Eventually(t, 30*time.Second, "the queue consumed, its consumer shown", func() bool {
		return strings.Contains(op.get(srv.URL+"/ops/"), `<tr><td>`+env.queue+`</td><td class="n">1</td><td class="n">0</td>`)
	})
	if over := op.get(srv.URL + "/ops/"); strings.Contains(over, "RabbitMQ queue &#34;"+env.queue+"&#34;") {
		t.Errorf("a consumed queue is not ready:\n%s", over)
	}
}

// The overview shows a JetStream durable consumer's messages pending, ack
// pending and redelivered, and finds a consumer with messages pending to
// which nothing was ever delivered not ready; the dead-letter stream has
// no row.
func TestConsoleOverviewJetStreamConsumers(t *testing.T) {
	e := newNATSEnv(t)
	ctx := t.Context()
	if _, err := e.js.CreateOrUpdateConsumer(ctx, e.stream, jetstream.ConsumerConfig{Durable: "idle-workers", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		e.publish(e.subject, "order "+strconv.Itoa(i), nil)
	}
	_, js := e.ownJetStream()
	srv := mountConsole(t, console.Config{Pool: e.db.Pool, Schema: e.db.Schema, JetStream: js, DeadLetterStreams: []string{e.dlq}})
	op := newOperator(t, "grace")
	over := op.get(srv.URL + "/ops/")
	mustContain(t, "overview", over, `<section id="jetstream-lag">`,
		`<tr><td>idle-workers</td><td>`+e.stream+`</td><td class="n warn">3</td><td class="n">0</td><td class="n">0</td><td class="n">0</td><td>-</td>`,
		`<td>JetStream consumer &#34;idle-workers&#34; of stream &#34;`+e.stream+`&#34;</td><td class="warn">3 messages pending and nothing delivered ever`)
	if strings.Contains(over, "<td>"+e.dlq+"</td><td class=\"n") {
		t.Errorf("the dead-letter stream has a consumer row:\n%s", over)
	}
}
