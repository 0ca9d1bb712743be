package integration_test

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/natsconsumer"
)

// natsConsoleEnv is a JetStream stream whose consumer dead-lettered six
// messages, and the console on its dead-letter stream (JetStream only, no
// Kafka; actions enabled).
type natsConsoleEnv struct {
	*natsEnv
	*redriveRuns
	payments string            // a second subject of the stream
	refs     map[string]string // message id -> its dead letter's partition/offset (0/sequence)
}

// redriveRuns is what the console's dead-letter tests of a broker share:
// a handler that dead-letters every message until fixed, then counts its
// runs per message id; the console's log, and its address.
type redriveRuns struct {
	fixed atomic.Bool // the handler accepts every message from now on
	mu    sync.Mutex
	runs  map[string]int // handler runs per message id once fixed
	logs  *lockedBuffer
	base  string // the console, under /ops/
}

func newRedriveRuns() *redriveRuns {
	return &redriveRuns{runs: map[string]int{}, logs: &lockedBuffer{}}
}

// handler rejects "boom" with a transient error and every other message
// permanently ("rejected: schema v1") until fixed; then it counts each
// run and writes the message's effect.
func (r *redriveRuns) handler() consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if !r.fixed.Load() {
			if string(msg.Value) == "boom" {
				return errors.New("flaky downstream")
			}
			return dlq.Permanent(errors.New("rejected: schema v1"))
		}
		r.mu.Lock()
		r.runs[msg.ID]++
		r.mu.Unlock()
		return sourceEffect("w")(ctx, tx, msg)
	}
}

// ranOnce fails the test unless, since the handler was fixed, it ran once
// for each of ids and for nothing else, and each has one effect in db;
// settled waits for the consumer to have nothing left in flight.
func (r *redriveRuns) ranOnce(db sourceDB, settled func(), ids ...string) {
	db.t.Helper()
	testenv.Eventually(db.t, 30*time.Second, "the redriven messages' effects", func() bool {
		return db.count(`SELECT count(DISTINCT message_id) FROM effects`) >= int64(len(ids))
	})
	settled()
	db.effects(int64(len(ids)))
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, id := range ids {
		if r.runs[id] != 1 || db.count(`SELECT count(*) FROM effects WHERE message_id = $1`, id) != 1 {
			db.t.Errorf("message %s: %d handler runs, want exactly 1 with one effect", id, r.runs[id])
		}
	}
	if len(r.runs) != len(ids) {
		db.t.Errorf("the handler ran for %v, want only %v", r.runs, ids)
	}
}

// seedNATSConsole dead-letters, through a real natsconsumer that gives a
// message two attempts: a (JSON), c (binary) and e (key k-e) of the orders
// subject permanently ("rejected: schema v1"), b and d after max attempts
// ("flaky downstream"), and p of the payments subject permanently with the
// same error.
func seedNATSConsole(t *testing.T) *natsConsoleEnv {
	t.Helper()
	env := &natsConsoleEnv{natsEnv: newNATSEnv(t), redriveRuns: newRedriveRuns()}
	env.payments = env.stream + ".payments"
	for _, m := range []struct {
		id, subject, key string
		data             []byte
	}{{"a", env.subject, "", []byte(`{"order":"a","amount":10}`)}, {"b", env.subject, "", []byte("boom")},
		{"c", env.subject, "", []byte{0, 1, 2, 0xff}}, {"d", env.subject, "", []byte("boom")},
		{"e", env.subject, "k-e", []byte("bad")}, {"p", env.payments, "", []byte("bad")}} {
		h := map[string]string{nats.MsgIdHdr: m.id}
		if m.key != "" {
			h[natsconsumer.HeaderKey] = m.key
		}
		env.publish(m.subject, string(m.data), h)
	}
	cfg := env.config(env.js, env.handler())
	cfg.MaxAttempts = 2
	_, _ = env.start(t.Context(), cfg)
	env.deadLetters(6)
	env.settled()

	all, err := natsconsumer.DeadLetters(t.Context(), env.js, env.dlq, dlq.Filter{})
	if err != nil || len(all) != 6 {
		t.Fatalf("dead letters: %d, %v; want 6", len(all), err)
	}
	env.refs = map[string]string{}
	for _, e := range all {
		env.refs[e.Info.MessageID] = strings.TrimPrefix(e.Ref(), e.Record.Topic+"/")
	}

	// The console on a connection of its own, as `oncely console --nats`.
	_, js := env.ownJetStream()
	srv := mountConsole(t, console.Config{Pool: env.db.Pool, Schema: env.db.Schema, JetStream: js,
		Streams: []string{env.stream}, DeadLetterStreams: []string{env.dlq}, Actions: true, Logger: slog.New(slog.NewTextHandler(env.logs, nil))})
	env.base = srv.URL + "/ops/"
	return env
}

// redriven returns the dedup ids of the redriven messages in the source
// stream (those carrying dlq.HeaderRedrive), in stream order.
func (env *natsConsoleEnv) redriven() []string {
	env.t.Helper()
	recs, err := natsconsumer.ReadStream(env.t.Context(), env.js, env.stream)
	if err != nil {
		env.t.Fatal(err)
	}
	var ids []string
	for _, r := range recs {
		id, redriven := "", false
		for _, h := range r.Headers {
			redriven = redriven || h.Key == dlq.HeaderRedrive
			if h.Key == dlq.HeaderMessageIDDefault {
				id = string(h.Value)
			}
		}
		if redriven {
			ids = append(ids, id)
		}
	}
	return ids
}

// ranOnce is redriveRuns.ranOnce on the stream's consumer.
func (env *natsConsoleEnv) ranOnce(ids ...string) {
	env.t.Helper()
	env.redriveRuns.ranOnce(env.sourceDB, env.settled, ids...)
}

var overviewRowRE = `<a href="dlq\?stream=%s">[^<]+</a></td>((?:<td class="n">\d+</td>)+)`

// The console on a JetStream dead-letter stream, as on a Kafka topic: the
// overview counts its dead letters by class; the list filters them by
// class, error text, source subject, key and message id; the record page
// shows the value (pretty JSON, hex) and the natsconsumer provenance
// headers; a redrive by filter dry-runs, then redrives exactly what the
// filter showed (not b, d or p outside it, not a dead letter written after
// the dry run), each redriven message running exactly once more; a second
// confirmation redrives nothing; one record is redriven from its page and a
// selection through its confirmation; every action is logged with the
// operator's name.
func TestConsoleJetStreamDeadLetters(t *testing.T) {
	env := seedNATSConsole(t)
	op := newOperator(t, "alice")
	stream := url.Values{"stream": {env.dlq}}
	q := func(kv ...string) url.Values {
		v := url.Values{"stream": {env.dlq}}
		for i := 0; i+1 < len(kv); i += 2 {
			v.Set(kv[i], kv[i+1])
		}
		return v
	}

	// The overview: the stream's dead letters by class, and no Kafka
	// configured is not a reason to be not ready.
	over := op.get(env.base)
	mustContain(t, "overview", over, `id="dlq-streams"`, "No Kafka configured.", "Nothing found not ready.")
	row := regexp.MustCompile(strings.Replace(overviewRowRE, "%s", regexp.QuoteMeta(env.dlq), 1)).FindStringSubmatch(over)
	if row == nil {
		t.Fatalf("overview: no row of %s:\n%s", env.dlq, over)
	}
	// undecodable, permanent, max_attempts, panic, oversized, crash_loop, total
	if got := regexp.MustCompile(`\d+`).FindAllString(row[1], -1); !slices.Equal(got, []string{"0", "4", "2", "0", "0", "0", "6"}) {
		t.Errorf("overview counts of %s: %v, want 4 permanent, 2 max_attempts, 6 in all", env.dlq, got)
	}

	// The list and its filters.
	for what, c := range map[string]struct {
		q    url.Values
		want string
	}{
		"all":       {stream, "6 dead letters match"},
		"permanent": {q("class", "permanent"), "4 dead letters match"},
		"text":      {q("text", "FLAKY"), "2 dead letters match"},
		"subject":   {q("source", env.payments), "1 dead letters match"},
		"key":       {q("key", "k-e"), "1 dead letters match"},
		"id":        {q("message_id", "c"), "1 dead letters match"},
		"until":     {q("until", "2000-01-01"), "0 dead letters match"},
	} {
		mustContain(t, "dlq "+what, op.get(env.base+"dlq?"+c.q.Encode()), c.want)
	}
	list := op.get(env.base + "dlq?" + stream.Encode())
	mustContain(t, "dlq list", list, `<select name="stream"><option selected>`+env.dlq+`</option>`, "source subject",
		`<a href="record?stream=`+env.dlq+`&amp;ref=`+env.refs["a"]+`">`)

	// The record page: pretty JSON, hex, the provenance.
	rec := op.get(env.base + "record?" + q("ref", env.refs["a"]).Encode())
	mustContain(t, "record a", rec, `&#34;amount&#34;: 10`, "subject "+env.subject+", stream "+env.stream+" sequence 1",
		"JetStream consumer", "workers, delivery 1", natsconsumer.HeaderStream, natsconsumer.HeaderConsumer,
		natsconsumer.HeaderDeliveryCount, "rejected: schema v1", `<a href="dlq?stream=`+env.dlq+`">`)
	mustContain(t, "record c", op.get(env.base+"record?"+q("ref", env.refs["c"]).Encode()), "(hex, 4 bytes)", "00 01 02 ff")
	mustContain(t, "record e", op.get(env.base+"record?"+q("ref", env.refs["e"]).Encode()), "<pre>k-e</pre>")

	// Redrive by filter: the dry run, then one more matching dead letter,
	// then the confirmation.
	filter := q("class", "permanent", "text", "schema v1", "source", env.subject)
	confirmQ := withoutCSRF(filter)
	confirmQ.Set("all", "1")
	confirm := op.get(env.base + "dlq-confirm?" + confirmQ.Encode())
	last := max(seqOf(t, env.refs["a"]), seqOf(t, env.refs["c"]), seqOf(t, env.refs["e"]))
	mustContain(t, "confirm", confirm, "<strong>3</strong> would be redriven", "up to offsets 0:"+last,
		"<th>stream</th><td>"+env.dlq+"</td>")
	late := &dlq.Info{Topic: env.subject, Offset: 50, Group: "workers", MessageID: "late", Attempts: 1,
		FirstFailure: time.Now(), LastFailure: time.Now(), Class: dlq.ClassPermanent, Error: "rejected: schema v1"}
	m := nats.NewMsg(natsconsumer.DefaultDeadLetterSubject(env.subject))
	for _, h := range late.Headers() {
		m.Header.Add(h.Key, string(h.Value))
	}
	if _, err := env.js.PublishMsg(t.Context(), m); err != nil {
		t.Fatal(err)
	}
	if n := streamMsgs(t, env.js, env.stream); n != 6 {
		t.Fatalf("the dry run published: the stream holds %d messages, want 6", n)
	}

	env.fixed.Store(true)
	form := confirmForm(t, confirm)
	code, body, hdr := op.post(env.base+"dlq-redrive", form, "")
	if code != http.StatusSeeOther || !strings.HasPrefix(hdr.Get("Location"), "dlq?") {
		t.Fatalf("confirm: %d %s %v", code, body, hdr)
	}
	mustContain(t, "after redrive", op.get(env.base+hdr.Get("Location")), "redrove 3 of 3 selected dead letters")
	if got := env.redriven(); !slices.Equal(slices.Sorted(slices.Values(got)), []string{"a", "c", "e"}) {
		t.Fatalf("redriven to the stream: %v, want [a c e]: b, d (max_attempts), p (payments) and late are outside", got)
	}
	env.ranOnce("a", "c", "e")

	// The same confirmation again: all three are processed now.
	code, _, hdr = op.post(env.base+"dlq-redrive", form, "")
	if code != http.StatusSeeOther {
		t.Fatalf("second confirm: %d", code)
	}
	mustContain(t, "second redrive", op.get(env.base+hdr.Get("Location")), "redrove 0 of 3")
	if got := env.redriven(); len(got) != 3 {
		t.Errorf("a second confirmation published again: %v", got)
	}

	// One from its page, and a selection through its confirmation.
	csrf := csrfOf(t, op.get(env.base+"record?"+q("ref", env.refs["b"]).Encode()))
	code, _, hdr = op.post(env.base+"dlq-redrive", url.Values{"csrf": {csrf}, "stream": {env.dlq}, "ref": {env.refs["b"]}}, "")
	if code != http.StatusSeeOther {
		t.Fatalf("redrive b: %d", code)
	}
	mustContain(t, "redrive one", op.get(env.base+hdr.Get("Location")), "redrove 1 of 1")
	sel := op.get(env.base + "dlq-confirm?" + url.Values{"stream": {env.dlq}, "ref": {env.refs["d"], env.refs["p"]}}.Encode())
	mustContain(t, "confirm selection", sel, "<strong>2</strong> would be redriven", "selected</th><td>2 records")
	code, _, hdr = op.post(env.base+"dlq-redrive", confirmForm(t, sel), "")
	if code != http.StatusSeeOther {
		t.Fatalf("redrive selection: %d", code)
	}
	mustContain(t, "redrive selection", op.get(env.base+hdr.Get("Location")), "redrove 2 of 2")
	// The selection is redriven in stream order, which depends on when d
	// and p were dead-lettered.
	if got := env.redriven(); len(got) != 6 || got[3] != "b" || !slices.Equal(slices.Sorted(slices.Values(got[4:])), []string{"d", "p"}) {
		t.Errorf("redriven: %v, want a c e, then b, then d and p", got)
	}
	env.ranOnce("a", "b", "c", "d", "e", "p")
	if logs := env.logs.String(); strings.Count(logs, "who=alice") != 4 || !strings.Contains(logs, "stream="+env.dlq) {
		t.Errorf("want 4 redrives logged with the operator and the stream:\n%s", logs)
	}
}

// seqOf is the sequence of a 0/sequence ref.
func seqOf(t *testing.T, ref string) string {
	t.Helper()
	seq, ok := strings.CutPrefix(ref, "0/")
	if !ok {
		t.Fatalf("ref %q is not 0/sequence", ref)
	}
	return seq
}

// Without DeadLetterStreams the console shows the streams whose subjects
// all start with "dlq." (the test's dead-letter stream, not its source
// stream), read-only unless actions are enabled; a stream named in the
// query that does not exist is an error on the page, not a crash.
func TestConsoleJetStreamDiscoversDeadLetterStreams(t *testing.T) {
	e := newNATSEnv(t)
	e.publish("dlq."+e.subject, "not a dead letter", nil)
	_, js := e.ownJetStream()
	srv := mountConsole(t, console.Config{Pool: e.db.Pool, Schema: e.db.Schema, JetStream: js})
	op := newOperator(t, "bob")
	page := op.get(srv.URL + "/ops/dlq?" + url.Values{"stream": {e.dlq}}.Encode())
	mustContain(t, "discovered", page, `<option selected>`+e.dlq+`</option>`, "1 dead letters match", "not a dead-letter record")
	if strings.Contains(page, "<option>"+e.stream+"</option>") || strings.Contains(page, "Redrive") {
		t.Errorf("the source stream listed as a dead-letter stream, or actions on a read-only console:\n%s", page)
	}
	missing := op.get(srv.URL + "/ops/dlq?stream=NO_SUCH_STREAM_" + e.stream)
	mustContain(t, "missing stream", missing, `class="err"`, "stream not found")
	if code, _, _ := op.post(srv.URL+"/ops/dlq-redrive", url.Values{"stream": {e.dlq}, "all": {"1"}}, ""); code != http.StatusForbidden {
		t.Errorf("a redrive on a read-only console: %d, want 403", code)
	}
}

// The console's pages of a JetStream dead-letter stream read it whole once
// and then only what it gained, yet list what natsconsumer.DeadLetters
// lists on the whole stream: copies of one dead-lettering once, messages that are not dead
// letters, nothing deleted inside the stream, nothing purged from its
// start, nothing of the stream it was before it was deleted and made again.
// The console's connection receives about nothing for a view after which
// the stream gained nothing, and a few messages for three more; after
// Console.Run, the first view receives about nothing.
func TestConsoleJetStreamIndexFollowsTheStream(t *testing.T) {
	e := newNATSEnv(t)
	ctx := t.Context()
	subject := natsconsumer.DefaultDeadLetterSubject(e.subject)
	classes := []dlq.Class{dlq.ClassPermanent, dlq.ClassMaxAttempts, dlq.ClassUndecodable}
	publish := func(i int, copyOf int) {
		t.Helper()
		n := cmp.Or(copyOf, i)
		info := &dlq.Info{Topic: e.subject, Offset: int64(n), Group: "g" + strconv.Itoa(n%2), MessageID: "m-" + strconv.Itoa(n),
			Attempts: 2, FirstFailure: time.Now(), LastFailure: time.Now(), Class: classes[n%3], Error: "failure " + strconv.Itoa(n%7)}
		m := nats.NewMsg(subject)
		m.Data = []byte("v")
		for _, h := range info.Headers() {
			m.Header.Add(h.Key, string(h.Value))
		}
		m.Header.Set(natsconsumer.HeaderKey, "k-"+strconv.Itoa(n%5))
		if _, err := e.js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	for i := 1; i <= 240; i++ {
		publish(i, 0)
	}
	publish(0, 4) // a copy of 4
	e.publish(subject, "stray", map[string]string{"message-id": "stray"})

	nc, js := e.ownJetStream()
	h, err := console.New(console.Config{Pool: e.db.Pool, Schema: e.db.Schema, ViewWait: testViewWait, JetStream: js, DeadLetterStreams: []string{e.dlq}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	list := func(f dlq.Filter) ([]dlq.Entry, error) { return natsconsumer.DeadLetters(ctx, e.js, e.dlq, f) }
	check := func(step string) {
		t.Helper()
		pagesListAsWhole(t, step, srv.URL+"/dlq", url.Values{"stream": {e.dlq}}, list)
	}
	received := func() uint64 { return nc.Stats().InMsgs }
	view := func(want int) {
		t.Helper()
		page := getPage(t, srv.URL+"/dlq?stream="+e.dlq)
		if m := matchRE.FindStringSubmatch(page); m == nil || m[1] != strconv.Itoa(want) {
			t.Fatalf("page says %v dead letters match, want %d", m, want)
		}
	}

	before := received()
	view(241)
	if got := received() - before; got < 242 {
		t.Fatalf("the first view received %d messages, want the stream's 242 at least", got)
	}
	check("first read")
	before = received()
	view(241)
	if got := received() - before; got > 5 {
		t.Errorf("a view with nothing new received %d messages: the stream read again?", got)
	}
	for i := 241; i <= 243; i++ {
		publish(i, 0)
	}
	before = received()
	view(244)
	if got := received() - before; got > 3+5 {
		t.Errorf("a view after 3 more received %d messages: want the 3 and a few answers", got)
	}

	for i := 244; i <= 260; i++ {
		publish(i, 0)
	}
	publish(0, 7) // a copy of 7
	check("appended")

	s, err := e.js.Stream(ctx, e.dlq)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteMsg(ctx, 50); err != nil { // m-50, inside what was read
		t.Fatal(err)
	}
	check("after a delete inside the stream")
	if err := s.Purge(ctx, jetstream.WithPurgeSequence(31)); err != nil { // m-1 to m-30
		t.Fatal(err)
	}
	check("after a purge of the stream's start")

	// The stream deleted and made again, with more messages than before:
	// their sequences name other dead letters now.
	if err := e.js.DeleteStream(ctx, e.dlq); err != nil {
		t.Fatal(err)
	}
	if s, err = e.js.CreateStream(ctx, jetstream.StreamConfig{Name: e.dlq, Subjects: []string{"dlq." + e.stream + ".>"}}); err != nil {
		t.Fatal(err)
	}
	for i := 1001; i <= 1300; i++ {
		publish(i, 0)
	}
	before = received()
	view(300)
	if got := received() - before; got > 300+5 {
		t.Errorf("the view after the stream was made again received %d messages: want its 300 read once", got)
	}
	check("after the stream was made again")

	// Console.Run reads the stream before any view: the first view of a
	// console that ran receives about nothing. Run is stopped while it
	// reads, once half the stream's messages have arrived: it returns
	// after that read, leaving none running behind it.
	nc2, js2 := e.ownJetStream()
	c, err := console.New(console.Config{Pool: e.db.Pool, Schema: e.db.Schema, ViewWait: testViewWait, JetStream: js2,
		DeadLetterStreams: []string{e.dlq}, SampleInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- c.Run(rctx) }()
	msgs := s.CachedInfo().State.Msgs
	if info, err := s.Info(ctx); err == nil {
		msgs = info.State.Msgs
	}
	testenv.Eventually(t, 30*time.Second, "Run reading the stream", func() bool { return nc2.Stats().InMsgs >= msgs/2 })
	stop()
	if err := <-ran; err != nil {
		t.Fatalf("Run: %v", err)
	}
	srv2 := httptest.NewServer(c)
	t.Cleanup(srv2.Close)
	before = nc2.Stats().InMsgs
	if m := matchRE.FindStringSubmatch(getPage(t, srv2.URL+"/dlq?stream="+e.dlq)); m == nil || m[1] == "0" {
		t.Fatalf("after Run, the page says %v dead letters match", m)
	}
	if got := nc2.Stats().InMsgs - before; got > 5 {
		t.Errorf("the first view after Run received %d messages: Run did not read the stream", got)
	}
}
