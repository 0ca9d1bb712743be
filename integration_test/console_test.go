package integration_test

import (
	"cmp"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook/outbound"
)

// Secrets the seeded data holds; no page may show any of them.
const (
	consoleURLPassword = "pa55-in-url"
	consoleURLToken    = "query-token-value"
	consoleHeaderToken = "header-bearer-value"
)

// consoleEnv is a schema and a Kafka cluster seeded with what an operator
// looks at: dead letters of every kind a consumer writes, a parked outbox
// row, a pending one, and a webhook subscription whose endpoint fails.
type consoleEnv struct {
	k                *testenv.Kafka
	db               *testenv.DB
	topic, dlqTopic  string
	group            string
	ob               *outbox.Outbox
	parkedID         int64
	store            *outbound.Store
	sub              outbound.Subscription
	deadWebhookID    string
	logs             *lockedBuffer
	runConsumer      func(h consumer.Handler) (*consumer.Consumer, func())
	effects          func() []string
	srv              *httptest.Server // the console mounted under /ops/, actions enabled
	base             string           // srv.URL + "/ops/"
	producer         *kgo.Client
	consoleKafkaOpts []kgo.Opt
}

// seedConsole dead-letters five records through a real consumer: a, c and
// e permanently (the handler rejects them), b and d after max attempts;
// a's value is JSON, c's is binary, e has the key "k-e".
func seedConsole(t *testing.T) *consoleEnv {
	t.Helper()
	ctx := context.Background()
	env := &consoleEnv{k: testenv.NewKafka(t), db: testenv.Migrated(t), logs: &lockedBuffer{}}
	env.topic = env.k.CreateTopic(t, "orders", 1)
	env.dlqTopic = dlq.DefaultTopic(env.topic)
	env.k.CreateTopicNamed(t, env.dlqTopic, 1)
	env.group = testenv.UniqueName("g")
	env.producer = env.k.Client(t)
	if _, err := env.db.Pool.Exec(ctx, `CREATE TABLE effects (id text)`); err != nil {
		t.Fatal(err)
	}
	for _, r := range []struct {
		id, key string
		value   []byte
	}{{"a", "", []byte(`{"order":"a","amount":10}`)}, {"b", "", []byte("boom")}, {"c", "", []byte{0, 1, 2, 0xff}},
		{"d", "", []byte("boom")}, {"e", "k-e", []byte("bad")}} {
		rec := &kgo.Record{Topic: env.topic, Key: []byte(r.key), Value: r.value, Headers: []kgo.RecordHeader{
			{Key: "message-id", Value: []byte(r.id)}}}
		if err := env.producer.ProduceSync(ctx, rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	env.runConsumer = func(h consumer.Handler) (*consumer.Consumer, func()) {
		return startTwoAttemptConsumer(t, env.k, env.db, env.topic, env.group, h)
	}
	c1, stop1 := env.runConsumer(func(_ context.Context, _ pgx.Tx, m *consumer.Message) error {
		if string(m.Value) == "boom" {
			return errors.New("flaky downstream")
		}
		return dlq.Permanent(errors.New("rejected: schema v1"))
	})
	testenv.Eventually(t, time.Minute, "five records dead-lettered", func() bool { return c1.Stats().DeadLettered == 5 })
	stop1()
	env.effects = func() []string {
		rows, err := env.db.Pool.Query(ctx, `SELECT id FROM effects ORDER BY id`)
		if err != nil {
			t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}

	// A dead-letter record carrying a credential header, written as a
	// producer could: the console must not show its value.
	info := &dlq.Info{Topic: env.topic, Partition: 0, Offset: 99, Group: env.group, MessageID: "z", Attempts: 1,
		FirstFailure: time.Now(), LastFailure: time.Now(), Class: dlq.ClassUndecodable, Error: "not JSON"}
	rec := &kgo.Record{Topic: env.dlqTopic, Value: []byte("zz"), Headers: append(info.Headers(),
		kgo.RecordHeader{Key: "X-Api-Token", Value: []byte(consoleHeaderToken)})}
	if err := env.producer.ProduceSync(ctx, rec).FirstErr(); err != nil {
		t.Fatal(err)
	}

	// The outbox: one row parked by the relay's rule, one pending.
	var err error
	if env.ob, err = outbox.New(outbox.Config{Schema: env.db.Schema}); err != nil {
		t.Fatal(err)
	}
	tx, err := env.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	enq, err := env.ob.Enqueue(ctx, tx, outbox.Message{Topic: "payments", Key: []byte("p-1"), Value: []byte("too big")},
		outbox.Message{Topic: "payments", Key: []byte("p-2"), Value: []byte("fine")})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := env.db.Pool.QueryRow(ctx, `UPDATE outbox SET parked_at = now(), error = 'MESSAGE_TOO_LARGE: the broker refused 7 bytes'
		WHERE message_id = $1 RETURNING id`, enq[0].MessageID).Scan(&env.parkedID); err != nil {
		t.Fatal(err)
	}

	// A webhook subscription with credentials in its URL, and a delivery
	// that died after its endpoint answered 500 five times.
	if env.store, err = outbound.NewStore(outbound.Config{Schema: env.db.Schema}); err != nil {
		t.Fatal(err)
	}
	env.sub, err = env.store.CreateSubscription(ctx, env.db.Pool, outbound.Subscription{
		URL: "https://hookuser:" + consoleURLPassword + "@hooks.example.com/in?token=" + consoleURLToken})
	if err != nil {
		t.Fatal(err)
	}
	tx, err = env.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	hooks, err := env.store.Enqueue(ctx, tx, outbound.Event{ID: "evt-1", Type: "invoice.paid", Payload: []byte(`{"id":"evt-1"}`)})
	if err != nil || len(hooks) != 1 {
		t.Fatalf("enqueue webhook: %v %v", hooks, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	env.deadWebhookID = hooks[0].WebhookID
	if _, err := env.db.Pool.Exec(ctx, `UPDATE webhook_deliveries SET status = 'dead', dead_at = now(), attempts = 5,
		last_status = 500, last_error = 'HTTP 500 from the endpoint' WHERE webhook_id = $1`, env.deadWebhookID); err != nil {
		t.Fatal(err)
	}

	env.consoleKafkaOpts = append([]kgo.Opt{kgo.SeedBrokers(env.k.Brokers...)}, env.k.ClientOpts...)
	env.srv = env.serve(t, true)
	env.base = env.srv.URL + "/ops/"
	return env
}

// startTwoAttemptConsumer runs a consumer of topic that dead-letters a
// record after two attempts, and returns it with its stop function.
func startTwoAttemptConsumer(t *testing.T, k *testenv.Kafka, db *testenv.DB, topic, group string, h consumer.Handler) (*consumer.Consumer, func()) {
	t.Helper()
	c, err := consumer.New(consumer.Config{Brokers: k.Brokers, Topics: []string{topic}, Group: group, Pool: db.Pool,
		Schema: db.Schema, Handler: h, MaxAttempts: 2, RetryBaseDelay: time.Millisecond, RetryMaxDelay: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(cctx) }()
	return c, func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}
}

// runFixed runs a consumer that accepts every record until the effects
// table holds want, and checks that it holds each of them once.
func (env *consoleEnv) runFixed(t *testing.T, want ...string) {
	t.Helper()
	_, stop := env.runConsumer(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID)
		return err
	})
	testenv.Eventually(t, time.Minute, "the redriven records processed", func() bool { return len(env.effects()) >= len(want) })
	stop()
	if got := env.effects(); !slices.Equal(got, want) {
		t.Fatalf("effects %v, want %v once each", got, want)
	}
}

// serve mounts the console under /ops/ with an Auth hook that names the
// operator from the X-User header.
func (env *consoleEnv) serve(t *testing.T, actions bool) *httptest.Server {
	t.Helper()
	return mountConsole(t, console.Config{Pool: env.db.Pool, Schema: env.db.Schema, KafkaOpts: env.consoleKafkaOpts,
		DeadLetterTopics: []string{env.dlqTopic}, Actions: actions,
		Logger: slog.New(slog.NewTextHandler(env.logs, nil))})
}

// testViewWait is the console's Config.ViewWait in the tests but those of
// the wait itself: the pages show each place read whole, as a test expects
// whatever the machine's load.
const testViewWait = time.Minute

// mountConsole serves the console of cfg under /ops/, with an Auth hook
// that names the operator from the X-User header (and ViewWait
// testViewWait unless cfg has one).
func mountConsole(t *testing.T, cfg console.Config) *httptest.Server {
	t.Helper()
	cfg.ViewWait = cmp.Or(cfg.ViewWait, testViewWait)
	cfg.Auth = func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			who := r.Header.Get("X-User")
			if who == "" {
				http.Error(w, "who are you?", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, console.WithIdentity(r, who))
		})
	}
	h, err := console.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/", http.StripPrefix("/ops", h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// operator is a browser-like client: a cookie jar and a name.
type operator struct {
	t   *testing.T
	c   *http.Client
	who string
}

func newOperator(t *testing.T, who string) *operator {
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &operator{t: t, who: who, c: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}}
}

func (o *operator) do(req *http.Request) (int, string, http.Header) {
	o.t.Helper()
	req.Header.Set("X-User", o.who)
	resp, err := o.c.Do(req)
	if err != nil {
		o.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		o.t.Fatal(err)
	}
	return resp.StatusCode, string(b), resp.Header
}

// get fetches a page and fails the test unless it is 200.
func (o *operator) get(u string) string {
	o.t.Helper()
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, u, nil)
	code, body, _ := o.do(req)
	if code != http.StatusOK {
		o.t.Fatalf("GET %s: %d %s", u, code, body)
	}
	return body
}

func (o *operator) post(u string, form url.Values, origin string) (int, string, http.Header) {
	o.t.Helper()
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, u, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if origin != "" {
		req.Header.Set("Origin", origin)
	}
	return o.do(req)
}

// csrfCookie returns the double-submit cookie the console set.
func (o *operator) csrfCookie(base string) string {
	o.t.Helper()
	u, _ := url.Parse(base)
	for _, c := range o.c.Jar.Cookies(u) {
		if c.Name == "oncely_console_csrf" {
			return c.Value
		}
	}
	o.t.Fatal("no CSRF cookie")
	return ""
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([0-9a-f]{64})"`)

func csrfOf(t *testing.T, page string) string {
	t.Helper()
	m := csrfRE.FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no CSRF token in the page:\n%s", page)
	}
	return m[1]
}

func mustContain(t *testing.T, what, body string, subs ...string) {
	t.Helper()
	for _, s := range subs {
		if !strings.Contains(body, s) {
			t.Errorf("%s: missing %q in:\n%s", what, s, body)
		}
	}
}

// Every page renders what the library knows, under a mount prefix, and
// no page shows a secret: not the webhook secret, not the credentials in
// the endpoint URL, not a credential header of a dead letter.
func TestConsolePagesShowStateAndNoSecret(t *testing.T) {
	t.Parallel()
	env := seedConsole(t)
	op := newOperator(t, "alice")
	pages := map[string]string{}
	pages["overview"] = op.get(env.base)
	mustContain(t, "overview", pages["overview"], env.group, env.topic, env.dlqTopic, ">permanent<", "alice", "actions enabled",
		`<th>breaker closed</th><th>open</th><th>half open</th><th>paused</th></tr>
<tr><td class="n">1</td>`)
	pages["dlq"] = op.get(env.base + "dlq")
	mustContain(t, "dlq", pages["dlq"], "6 dead letters match", "rejected: schema v1", "flaky downstream", "max_attempts", "k-e")
	pages["dlq permanent"] = op.get(env.base + "dlq?" + url.Values{"topic": {env.dlqTopic}, "class": {"permanent"}}.Encode())
	mustContain(t, "dlq permanent", pages["dlq permanent"], "3 dead letters match")
	pages["dlq text"] = op.get(env.base + "dlq?" + url.Values{"topic": {env.dlqTopic}, "text": {"FLAKY"}}.Encode())
	mustContain(t, "dlq text", pages["dlq text"], "2 dead letters match")
	pages["dlq key"] = op.get(env.base + "dlq?" + url.Values{"topic": {env.dlqTopic}, "key": {"k-e"}}.Encode())
	mustContain(t, "dlq key", pages["dlq key"], "1 dead letters match", ">e<")
	pages["dlq id"] = op.get(env.base + "dlq?" + url.Values{"topic": {env.dlqTopic}, "message_id": {"b"}}.Encode())
	mustContain(t, "dlq id", pages["dlq id"], "1 dead letters match")
	pages["dlq time"] = op.get(env.base + "dlq?" + url.Values{"topic": {env.dlqTopic}, "until": {"2000-01-01"}}.Encode())
	mustContain(t, "dlq time", pages["dlq time"], "0 dead letters match")

	// One record of each value format, with its provenance.
	for ref, want := range map[string][]string{
		"0/0": {"(json,", "&#34;amount&#34;: 10", "rejected: schema v1", env.topic + " partition 0 offset 0", "message-id"},
		"0/2": {"(hex,", "00 01 02 ff"},
		"0/1": {"(text,", "boom", "max_attempts"},
		"0/5": {"X-Api-Token", "[redacted]"},
	} {
		body := op.get(env.base + "record?" + url.Values{"topic": {env.dlqTopic}, "ref": {ref}}.Encode())
		mustContain(t, "record "+ref, body, want...)
		pages["record "+ref] = body
	}
	pages["outbox"] = op.get(env.base + "outbox")
	mustContain(t, "outbox", pages["outbox"], "MESSAGE_TOO_LARGE", "payments", `id="retry-`)
	pages["inbox"] = op.get(env.base + "inbox?message_id=a")
	mustContain(t, "inbox", pages["inbox"], "dead_lettered", env.group, env.topic+" partition 0 offset 0")
	pages["inbox miss"] = op.get(env.base + "inbox?message_id=nope")
	mustContain(t, "inbox miss", pages["inbox miss"], "Not in the inbox")
	pages["webhooks"] = op.get(env.base + "webhooks")
	mustContain(t, "webhooks", pages["webhooks"], env.sub.ID.String(), "hooks.example.com", "HTTP 500 from the endpoint", env.deadWebhookID)
	pages["confirm"] = op.get(env.base + "dlq-confirm?" + url.Values{"topic": {env.dlqTopic}, "all": {"1"}}.Encode())

	secrets := append([]string{consoleURLPassword, consoleURLToken, consoleHeaderToken}, env.sub.Secrets...)
	for name, body := range pages {
		if !strings.HasSuffix(strings.TrimSpace(body), "</html>") {
			t.Errorf("page %s is cut short:\n%s", name, body)
		}
		for _, s := range secrets {
			if strings.Contains(body, s) {
				t.Errorf("page %s shows the secret %q", name, s)
			}
		}
		if strings.Contains(body, `src="http`) || strings.Contains(body, `href="http`) || strings.Contains(body, `href="/`) {
			t.Errorf("page %s links to another origin or to an absolute path (breaks under a prefix)", name)
		}
	}
	// The embedded assets are served under the prefix.
	mustContain(t, "css", op.get(env.base+"static/console.css"), "prefers-color-scheme")
	// The Auth hook guards every page.
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, env.base, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("a page without the Auth hook's identity: %d, want 401", resp.StatusCode)
	}
}

// A POST without the form's CSRF token, with a wrong one, or from another
// origin is refused, and so is every POST to a read-only console; none of
// them changes anything.
func TestConsoleRefusesForgedAndReadOnlyActions(t *testing.T) {
	t.Parallel()
	env := seedConsole(t)
	op := newOperator(t, "mallory")
	page := op.get(env.base + "outbox")
	token := csrfOf(t, page)
	id := url.Values{"id": {strconv.FormatInt(env.parkedID, 10)}}
	for name, c := range map[string]struct {
		form   url.Values
		origin string
	}{
		"no token":     {id, ""},
		"wrong token":  {withCSRF(id, strings.Repeat("0", 64)), ""},
		"cross origin": {withCSRF(id, token), "http://evil.example"},
	} {
		code, body, _ := op.post(env.base+"outbox-retry", c.form, c.origin)
		if code != http.StatusForbidden {
			t.Errorf("%s: %d %s, want 403", name, code, body)
		}
	}
	// Read-only: the same, correct request is refused, and no form shows.
	ro := env.serve(t, false)
	rop := newOperator(t, "bob")
	roPage := rop.get(ro.URL + "/ops/outbox")
	if strings.Contains(roPage, `action="outbox-retry"`) || !strings.Contains(roPage, "read-only") {
		t.Errorf("read-only outbox page shows an action form, or does not say it is read-only")
	}
	code, _, _ := rop.post(ro.URL+"/ops/outbox-retry", withCSRF(id, csrfOf(t, op.get(env.base+"outbox"))), "")
	if code != http.StatusForbidden {
		t.Errorf("read-only console accepted an action: %d", code)
	}
	parked, err := env.ob.Parked(context.Background(), env.db.Pool, 0)
	if err != nil || len(parked) != 1 || parked[0].ID != env.parkedID {
		t.Errorf("the parked row changed after refused actions: %+v %v", parked, err)
	}
	if strings.Contains(env.logs.String(), "console: action ") {
		t.Errorf("a refused action was logged as done:\n%s", env.logs.String())
	}
}

func withCSRF(v url.Values, token string) url.Values {
	out := url.Values{"csrf": {token}}
	for k, vs := range v {
		out[k] = vs
	}
	return out
}

// redrivenIDs reads the source topic and returns the message ids of the
// records that carry the redrive header.
func redrivenIDs(t *testing.T, env *consoleEnv) []string {
	t.Helper()
	cl := env.k.Client(t, kgo.ConsumeTopics(env.topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var ids []string
	var seen int
	for seen < 5+len(ids) {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			break
		}
		fs.EachRecord(func(r *kgo.Record) {
			seen++
			var id string
			redriven := false
			for _, h := range r.Headers {
				redriven = redriven || h.Key == dlq.HeaderRedrive
				if h.Key == "message-id" {
					id = string(h.Value)
				}
			}
			if redriven {
				ids = append(ids, id)
			}
		})
		// The topic's end: everything produced so far has been read.
		hw := highWater(t, env)
		if int64(seen) >= hw {
			break
		}
	}
	slices.Sort(ids)
	return ids
}

func highWater(t *testing.T, env *consoleEnv) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ends, err := kadm.NewClient(env.k.Client(t)).ListEndOffsets(ctx, env.topic)
	if err != nil {
		t.Fatal(err)
	}
	var end int64
	ends.Each(func(o kadm.ListedOffset) { end += o.Offset })
	return end
}

// Redrive by filter: the dry run counts what the filter selects, the
// confirmation redrives exactly those records once more, records outside
// the filter are not touched, a record dead-lettered after the dry run is
// not redriven by its confirmation, and a second confirmation redrives
// nothing (the inbox holds them as processed). The action is logged with
// the operator's name.
func TestConsoleRedriveByFilter(t *testing.T) {
	t.Parallel()
	env := seedConsole(t)
	op := newOperator(t, "alice")
	filter := url.Values{"topic": {env.dlqTopic}, "class": {"permanent"}, "text": {"schema v1"}}
	confirmQ := withoutCSRF(filter)
	confirmQ.Set("all", "1")
	confirm := op.get(env.base + "dlq-confirm?" + confirmQ.Encode())
	mustContain(t, "confirm", confirm, "<strong>3</strong> would be redriven", "up to offsets 0:4")

	// After the dry run, one more record matching the filter is dead-lettered.
	late := &dlq.Info{Topic: env.topic, Partition: 0, Offset: 50, Group: env.group, MessageID: "late", Attempts: 1,
		FirstFailure: time.Now(), LastFailure: time.Now(), Class: dlq.ClassPermanent, Error: "rejected: schema v1"}
	if err := env.producer.ProduceSync(context.Background(), &kgo.Record{Topic: env.dlqTopic, Value: []byte("late"),
		Headers: late.Headers()}).FirstErr(); err != nil {
		t.Fatal(err)
	}

	form := confirmForm(t, confirm)
	code, body, hdr := op.post(env.base+"dlq-redrive", form, "")
	if code != http.StatusSeeOther || !strings.HasPrefix(hdr.Get("Location"), "dlq?") {
		t.Fatalf("confirm: %d %s %v", code, body, hdr)
	}
	done := op.get(env.base + hdr.Get("Location"))
	mustContain(t, "after redrive", done, "redrove 3 of 3 selected dead letters")
	if got := redrivenIDs(t, env); !slices.Equal(got, []string{"a", "c", "e"}) {
		t.Fatalf("redriven to the source topic: %v, want [a c e]: b and d (max_attempts) and the late record are outside", got)
	}
	if logs := env.logs.String(); !strings.Contains(logs, "who=alice") || !strings.Contains(logs, "action=dlq-redrive") {
		t.Errorf("the redrive is not logged with its operator:\n%s", logs)
	}

	// A fixed consumer runs each redriven record exactly once more.
	env.runFixed(t, "a", "c", "e")

	// The same confirmation again: all three are processed now.
	code, _, hdr = op.post(env.base+"dlq-redrive", form, "")
	if code != http.StatusSeeOther {
		t.Fatalf("second confirm: %d", code)
	}
	mustContain(t, "second redrive", op.get(env.base+hdr.Get("Location")), "redrove 0 of 3")
	if got := redrivenIDs(t, env); len(got) != 3 {
		t.Errorf("a second confirmation produced again: %v", got)
	}
}

var hiddenRE = regexp.MustCompile(`<input type="hidden" name="([a-z_]+)" value="([^"]*)">`)

// confirmForm returns the fields of the page's redrive form.
func confirmForm(t *testing.T, page string) url.Values {
	t.Helper()
	i := strings.Index(page, `action="dlq-redrive"`)
	if i < 0 {
		t.Fatalf("no redrive form in:\n%s", page)
	}
	form := url.Values{}
	for _, m := range hiddenRE.FindAllStringSubmatch(page[i:], -1) {
		v, err := url.QueryUnescape(strings.ReplaceAll(m[2], "&#43;", "+"))
		if err != nil {
			v = m[2]
		}
		form.Add(m[1], htmlUnescape(v))
	}
	return form
}

func htmlUnescape(s string) string {
	return strings.NewReplacer("&#34;", `"`, "&#39;", "'", "&amp;", "&", "&lt;", "<", "&gt;", ">").Replace(s)
}

func withoutCSRF(v url.Values) url.Values {
	out := url.Values{}
	for k, vs := range v {
		if k != "csrf" {
			out[k] = vs
		}
	}
	return out
}

// One record redriven from its page, a selection from the list, the outbox
// row retried, the webhook endpoint paused and resumed and its dead
// delivery redriven: each changes Postgres as the library's call does, and
// is logged with the operator's name.
func TestConsoleActions(t *testing.T) {
	t.Parallel()
	env := seedConsole(t)
	ctx := context.Background()
	op := newOperator(t, "carol")
	post := func(page, action string, form url.Values) string {
		t.Helper()
		code, body, hdr := op.post(env.base+action, withCSRF(form, csrfOf(t, op.get(env.base+page))), "")
		if code != http.StatusSeeOther {
			t.Fatalf("%s: %d %s", action, code, body)
		}
		return op.get(env.base + hdr.Get("Location"))
	}

	// One record, from its page.
	rec := op.get(env.base + "record?" + url.Values{"topic": {env.dlqTopic}, "ref": {"0/1"}}.Encode())
	mustContain(t, "record page", rec, `action="dlq-redrive"`)
	mustContain(t, "redrive one", post("record?topic="+env.dlqTopic+"&ref=0/1", "dlq-redrive",
		url.Values{"topic": {env.dlqTopic}, "ref": {"0/1"}}), "redrove 1 of 1")
	// A selection, through its confirmation.
	confirm := op.get(env.base + "dlq-confirm?" + url.Values{"topic": {env.dlqTopic}, "ref": {"0/3", "0/4"}}.Encode())
	mustContain(t, "confirm selection", confirm, "<strong>2</strong> would be redriven", "selected</th><td>2 records")
	code, _, hdr := op.post(env.base+"dlq-redrive", confirmForm(t, confirm), "")
	if code != http.StatusSeeOther {
		t.Fatalf("redrive selection: %d", code)
	}
	mustContain(t, "redrive selection", op.get(env.base+hdr.Get("Location")), "redrove 2 of 2")
	if got := redrivenIDs(t, env); !slices.Equal(got, []string{"b", "d", "e"}) {
		t.Errorf("redriven %v, want [b d e]", got)
	}

	// The parked outbox row, retried.
	mustContain(t, "retry", post("outbox", "outbox-retry", url.Values{"id": {strconv.FormatInt(env.parkedID, 10)}}), "un-parked")
	var parkedAt *time.Time
	if err := env.db.Pool.QueryRow(ctx, `SELECT parked_at FROM outbox WHERE id = $1`, env.parkedID).Scan(&parkedAt); err != nil || parkedAt != nil {
		t.Errorf("row %d after retry: parked_at %v, %v", env.parkedID, parkedAt, err)
	}
	code, _, _ = op.post(env.base+"outbox-discard", withCSRF(url.Values{"id": {strconv.FormatInt(env.parkedID, 10)}}, op.csrfCookie(env.base)), "")
	if code != http.StatusInternalServerError && code != http.StatusBadRequest {
		t.Errorf("discard of a row no longer parked: %d, want an error", code)
	}

	// The webhook endpoint: pause, resume, and its dead delivery redriven.
	id := url.Values{"subscription": {env.sub.ID.String()}}
	mustContain(t, "pause", post("webhooks", "webhooks-pause", id), "paused", "paused in the console by carol")
	if s, err := env.store.GetSubscription(ctx, env.db.Pool, env.sub.ID); err != nil || !s.Paused() {
		t.Errorf("after pause: %+v %v", s.Paused(), err)
	}
	mustContain(t, "resume", post("webhooks", "webhooks-resume", id), "resumed")
	if s, err := env.store.GetSubscription(ctx, env.db.Pool, env.sub.ID); err != nil || s.Paused() {
		t.Errorf("after resume: %+v %v", s.Paused(), err)
	}
	mustContain(t, "webhook redrive", post("webhooks", "webhooks-redrive", id), "1 dead deliveries of")
	d, err := env.store.GetDelivery(ctx, env.db.Pool, env.deadWebhookID)
	if err != nil || d.Status != outbound.StatusPending || d.Attempts != 0 {
		t.Errorf("dead delivery after redrive: %s attempts %d, %v", d.Status, d.Attempts, err)
	}
	code, body, _ := op.post(env.base+"webhooks-pause", withCSRF(url.Values{"subscription": {uuid.NewString()}}, csrfOf(t, op.get(env.base+"webhooks"))), "")
	if code == http.StatusSeeOther {
		t.Errorf("pause of an unknown subscription succeeded: %s", body)
	}

	logs := env.logs.String()
	for _, a := range []string{"action=dlq-redrive", "action=outbox-retry", "action=webhooks-pause", "action=webhooks-resume", "action=webhooks-redrive"} {
		if !strings.Contains(logs, a) {
			t.Errorf("no log line for %s", a)
		}
	}
	if strings.Count(logs, "who=carol") < 6 {
		t.Errorf("actions not logged with their operator:\n%s", logs)
	}
}
