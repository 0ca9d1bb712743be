package integration_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook/outbound"
)

// runnerPool is a pool on the env's schema large enough for a runner with a
// relay and a consumer in every mode (perkey's eight lanes).
func (e *env) runnerPool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := testenv.NewPool(context.Background(), url, e.db.Schema, 16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// runRunner runs r until the test cancels it; the channel gets Run's error.
func runRunner(t *testing.T, r *oncely.Runner) (cancel context.CancelFunc, done chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done = make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("Run did not return within 30s of its context's end")
		}
	})
	return cancel, done
}

func waitRun(t *testing.T, done chan error, d time.Duration) error {
	t.Helper()
	select {
	case err := <-done:
		done <- err // for the cleanup
		return err
	case <-time.After(d):
		t.Fatalf("Run did not return within %s", d)
		return nil
	}
}

// TestRunnerOrderedShutdown: on shutdown the HTTP server stops taking
// connections while the consumer still drains and the relay still runs;
// the relay then publishes both what the consumer's last transaction and
// what the last HTTP request enqueued, after each of them finished.
func TestRunnerOrderedShutdown(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	events := e.kafka.CreateTopic(t, "events", 1)
	pool := e.runnerPool(t, e.db.URL)

	r, err := oncely.New(oncely.Config{Pool: pool, Schema: e.db.Schema, Brokers: e.kafka.Brokers, Relay: &outbox.RelayConfig{}})
	if err != nil {
		t.Fatal(err)
	}
	inHandler, releaseHandler := make(chan struct{}), newGate()
	cfg := e.config("runner", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		close(inHandler)
		releaseHandler.wait()
		_, err := r.Outbox().Enqueue(ctx, tx, outbox.Message{Topic: events, Value: []byte("from-consumer")})
		return err
	})
	cfg.Brokers, cfg.Pool, cfg.Schema = nil, nil, "" // the runner's
	if _, err := r.AddConsumer(cfg); err != nil {
		t.Fatal(err)
	}
	inRequest, releaseRequest := make(chan struct{}), newGate()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /order", func(w http.ResponseWriter, req *http.Request) {
		close(inRequest)
		releaseRequest.wait()
		err := pgx.BeginFunc(req.Context(), pool, func(tx pgx.Tx) error {
			_, err := r.Outbox().Enqueue(req.Context(), tx, outbox.Message{Topic: events, Value: []byte("from-http")})
			return err
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusAccepted)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := r.AddServer(&http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}, ln); err != nil {
		t.Fatal(err)
	}
	cancel, done := runRunner(t, r)
	eventually(t, 30*time.Second, "the runner ready", func() bool { return r.Ready() == nil })

	status := make(chan int, 1)
	go func() {
		resp, err := http.Post("http://"+addr+"/order", "text/plain", nil)
		if err != nil {
			status <- -1
			return
		}
		_ = resp.Body.Close()
		status <- resp.StatusCode
	}()
	<-inRequest
	e.produce(t, []msg{{id: "m-1"}})
	<-inHandler

	cancel()
	// Intake stops first: new connections are refused while the consumer's
	// record and the request are still in flight, and the relay runs.
	eventually(t, 10*time.Second, "the listener closed", func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			_ = c.Close()
		}
		return err != nil
	})
	if !r.Relay().Ready() {
		t.Error("the relay stopped before the consumer drained")
	}
	releaseHandler.open()
	// The consumer drains; the relay waits for the request in flight.
	eventually(t, 10*time.Second, "the consumer's event committed", func() bool {
		return e.count(t, `SELECT count(*) FROM outbox WHERE value = 'from-consumer'`) == 1
	})
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) while an HTTP request was in flight", err)
	default:
	}
	releaseRequest.open()
	if code := <-status; code != http.StatusAccepted {
		t.Errorf("the request in flight at shutdown got %d; want 202", code)
	}
	if err := waitRun(t, done, 20*time.Second); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := e.count(t, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 0 {
		t.Errorf("%d outbox rows left unpublished; the relay's flush should have published both", n)
	}
	got := map[string]bool{}
	cl := e.kafka.Client(t, kgo.ConsumeTopics(events), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	ctx, stop := context.WithTimeout(context.Background(), 20*time.Second)
	defer stop()
	for len(got) < 2 && ctx.Err() == nil {
		cl.PollFetches(ctx).EachRecord(func(rec *kgo.Record) { got[string(rec.Value)] = true })
	}
	if !got["from-consumer"] || !got["from-http"] {
		t.Errorf("events published: %v; want from-consumer and from-http", got)
	}
}

// readyz returns GET /readyz's status and body, as JSON when asJSON.
func readyz(t *testing.T, h http.Handler, asJSON bool) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, "/readyz", nil)
	if asJSON {
		req.Header.Set("Accept", "application/json")
	}
	w := &recorder{header: http.Header{}, status: http.StatusOK}
	h.ServeHTTP(w, req)
	return w.status, w.body.String()
}

type recorder struct {
	header http.Header
	status int
	body   strings.Builder
}

func (r *recorder) Header() http.Header         { return r.header }
func (r *recorder) WriteHeader(s int)           { r.status = s }
func (r *recorder) Write(b []byte) (int, error) { return r.body.Write(b) }

// healthRunner returns a runner on pool, with a relay of rc if not nil and
// a consumer of the env's topic that takes the runner's settings, checking
// its health every 50ms.
func (e *env) healthRunner(t *testing.T, pool *pgxpool.Pool, rc *outbox.RelayConfig) *oncely.Runner {
	t.Helper()
	r, err := oncely.New(oncely.Config{Pool: pool, Schema: e.db.Schema, Brokers: e.kafka.Brokers,
		Relay: rc, HealthInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.config("ready", recordEffect("ready"))
	cfg.Brokers, cfg.Pool, cfg.Schema = nil, nil, ""
	if _, err := r.AddConsumer(cfg); err != nil {
		t.Fatal(err)
	}
	return r
}

// TestRunnerReadyz: /readyz is 200 when everything runs, 503 naming the
// database while it is cut off, 200 again once it is back, and 503 naming
// the topic when a dead-letter topic is deleted.
func TestRunnerReadyz(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	dlqTopic := dlq.DefaultTopic(e.topic) // newEnv created it
	proxy := testenv.NewPostgresProxy(t)
	pool := e.runnerPool(t, proxy.URL)
	r := e.healthRunner(t, pool, &outbox.RelayConfig{PollInterval: 100 * time.Millisecond})
	h := r.Handler()
	if code, body := readyz(t, h, false); code != http.StatusServiceUnavailable || !strings.Contains(body, "not running") {
		t.Errorf("/readyz before Run: %d %q; want 503 naming the runner", code, body)
	}
	runRunner(t, r)
	eventually(t, 30*time.Second, "/readyz 200", func() bool { code, _ := readyz(t, h, false); return code == http.StatusOK })

	proxy.Cut()
	var body string
	eventually(t, 30*time.Second, "/readyz 503 naming the database", func() bool {
		var code int
		code, body = readyz(t, h, false)
		return code == http.StatusServiceUnavailable && strings.Contains(body, "database: unreachable")
	})
	// A record arriving meanwhile waits for the database: its consumer
	// says so, as the relay does.
	e.produce(t, []msg{{id: "during-the-outage"}})
	eventually(t, 30*time.Second, "/readyz naming the consumer and the relay", func() bool {
		_, body = readyz(t, h, false)
		return strings.Contains(body, `consumer group "`+e.group+`": partition `+e.topic+`/0 waits for the database`) &&
			strings.Contains(body, "outbox relay: the database did not answer its last query")
	})
	t.Logf("/readyz with the database cut off:\n%s", body)
	proxy.Restore()
	eventually(t, 60*time.Second, "/readyz 200 with the database back", func() bool { code, _ := readyz(t, h, false); return code == http.StatusOK })
	eventually(t, 30*time.Second, "the record of the outage processed", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'during-the-outage'`) == 1
	})

	adm := kadm.NewClient(e.kafka.Client(t))
	if _, err := adm.DeleteTopics(context.Background(), dlqTopic); err != nil {
		t.Fatal(err)
	}
	var reasons struct {
		Ready   bool            `json:"ready"`
		Reasons []oncely.Reason `json:"reasons"`
	}
	eventually(t, 30*time.Second, "/readyz 503 naming the deleted topic", func() bool {
		code, body := readyz(t, h, true)
		if code != http.StatusServiceUnavailable || json.Unmarshal([]byte(body), &reasons) != nil {
			return false
		}
		for _, rs := range reasons.Reasons {
			if rs.Component == `topic "`+dlqTopic+`"` && strings.Contains(rs.Reason, "does not exist") {
				return true
			}
		}
		return false
	})
	if reasons.Ready {
		t.Error(`JSON "ready" is true in a 503`)
	}
}

// TestRunnerConfigErrors: a component that names another schema or pool,
// and a pool too small for the concurrency the runner will use, fail at New
// or AddConsumer with an error naming the field.
func TestRunnerConfigErrors(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	pool := func(n int32) *pgxpool.Pool {
		p, err := testenv.NewPool(context.Background(), db.URL, db.Schema, n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	big := pool(10)
	handler := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }
	brokers := []string{"127.0.0.1:1"} // never dialled: nothing runs

	for _, tc := range []struct {
		name string
		cfg  oncely.Config
		want string
	}{
		{"relay schema", oncely.Config{Pool: big, Schema: "a", Brokers: brokers, Relay: &outbox.RelayConfig{Outbox: outbox.Config{Schema: "b"}}},
			`outbox.RelayConfig.Outbox.Schema: "b" differs from Config.Schema "a"`},
		{"cleaner schema", oncely.Config{Pool: big, Schema: "a", InboxCleaner: &dedup.CleanerConfig{Schema: "b", Retention: time.Hour}},
			`dedup.CleanerConfig.Schema: "b" differs`},
		{"relay pool", oncely.Config{Pool: big, Brokers: brokers, Relay: &outbox.RelayConfig{Pool: pool(2)}}, "outbox.RelayConfig.Pool"},
		{"pool below the reserve", oncely.Config{Pool: pool(3), Brokers: brokers, Relay: &outbox.RelayConfig{}}, "Config.Pool: MaxConns 3"},
		{"no pool", oncely.Config{}, "Config.Pool"},
		{"bad schema", oncely.Config{Pool: big, Schema: "Bad-Name"}, "Config.Schema"},
	} {
		if _, err := oncely.New(tc.cfg); !errors.Is(err, oncely.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: New: %v; want ErrInvalidConfig naming %q", tc.name, err, tc.want)
		}
	}

	for _, tc := range []struct {
		name string
		pool *pgxpool.Pool
		cfg  consumer.Config
		want string
	}{
		{"consumer schema", big, consumer.Config{Schema: "other"}, `consumer.Config.Schema: "other" differs from Config.Schema "` + db.Schema + `"`},
		{"consumer pool", big, consumer.Config{Pool: pool(2)}, "consumer.Config.Pool"},
		// 6 connections: relay 2 + cleanups 1 leave 3 for eight lanes.
		{"lanes", pool(6), consumer.Config{KeyParallelism: 8}, `Config.Pool: MaxConns 6 is 5 too small`},
		{"concurrency", pool(6), consumer.Config{Concurrency: 4}, `Concurrency 4`},
		{"concurrency below lanes", big, consumer.Config{Concurrency: 2, KeyParallelism: 4}, "consumer.Config.Concurrency: 2 is below KeyParallelism 4"},
		{"drain", big, consumer.Config{ShutdownTimeout: 8 * time.Second}, "consumer.Config.ShutdownTimeout"},
	} {
		r, err := oncely.New(oncely.Config{Pool: tc.pool, Schema: db.Schema, Brokers: brokers, Relay: &outbox.RelayConfig{}})
		if err != nil {
			t.Fatalf("%s: New: %v", tc.name, err)
		}
		cfg := tc.cfg
		cfg.Topics, cfg.Group, cfg.Handler = []string{"t"}, "g", handler
		if _, err := r.AddConsumer(cfg); !errors.Is(err, oncely.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: AddConsumer: %v; want ErrInvalidConfig naming %q", tc.name, err, tc.want)
		}
	}

	// Within the pool, the consumer's Concurrency defaults to what the
	// relay and the cleanups leave.
	r, err := oncely.New(oncely.Config{Pool: big, Schema: db.Schema, Brokers: brokers, Relay: &outbox.RelayConfig{}, ExtraConns: 2})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.AddConsumer(consumer.Config{Topics: []string{"t"}, Group: "g", Handler: handler, KeyParallelism: 5}); err != nil {
		t.Errorf("AddConsumer with 5 lanes in 10 connections less 5 kept: %v", err)
	}
}

// TestRunnerMigrate: on a schema never migrated, Run fails naming the
// missing migrations unless Config.Migrate is set, in which case it
// migrates and runs; a missing dead-letter topic fails Run at start, naming
// it.
func TestRunnerMigrate(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t) // an empty schema
	k := testenv.NewKafka(t)
	topic := k.CreateTopic(t, "orders", 1)
	newRunner := func(migrate bool) *oncely.Runner {
		r, err := oncely.New(oncely.Config{Pool: db.Pool, Schema: db.Schema, Brokers: k.Brokers, Migrate: migrate})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.AddConsumer(consumer.Config{Topics: []string{topic}, Group: testenv.UniqueName("g"), Handler: recordEffect("m")}); err != nil {
			t.Fatal(err)
		}
		return r
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	err := newRunner(false).Run(ctx)
	if !errors.Is(err, oncely.ErrNotMigrated) || !strings.Contains(err.Error(), "0001_inbox") || !strings.Contains(err.Error(), "Config.Migrate") {
		t.Fatalf("Run on an unmigrated schema: %v; want ErrNotMigrated naming 0001_inbox and Config.Migrate", err)
	}

	// Migrated now, but the dead-letter topic does not exist.
	err = newRunner(true).Run(ctx)
	if !errors.Is(err, oncely.ErrMissingTopic) || !strings.Contains(err.Error(), `topic "`+dlq.DefaultTopic(topic)+`"`) {
		t.Fatalf("Run without the dead-letter topic: %v; want ErrMissingTopic naming %s", err, dlq.DefaultTopic(topic))
	}
	var tables int64
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('inbox', 'outbox', 'idempotency_keys')`,
		db.Schema).Scan(&tables); err != nil || tables != 3 {
		t.Fatalf("after Migrate: %d of oncely's tables, %v; want 3", tables, err)
	}

	k.CreateTopicNamed(t, dlq.DefaultTopic(topic), 1)
	r := newRunner(false) // migrated by the previous run
	_, done := runRunner(t, r)
	eventually(t, 30*time.Second, "the runner ready", func() bool { return r.Ready() == nil })
	select {
	case err := <-done:
		t.Fatalf("Run returned %v", err)
	default:
	}
	resp := &recorder{header: http.Header{}, status: http.StatusOK}
	req, _ := http.NewRequest(http.MethodGet, "/metrics", nil)
	r.Handler().ServeHTTP(resp, req)
	if resp.status != http.StatusOK || !strings.Contains(resp.body.String(), "go_goroutines") {
		t.Errorf("/metrics of the runner's own provider: %d, %.200q", resp.status, resp.body.String())
	}
}

// TestRunnerStopWhileStarting: a shutdown asked for while Run waits in its
// start-up (here in BeforeStart, as behind another instance's migration
// lock) returns nil at once and starts no component; /readyz says why it is
// not ready meanwhile.
func TestRunnerStopWhileStarting(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	waiting := make(chan struct{})
	r, err := oncely.New(oncely.Config{Pool: e.runnerPool(t, e.db.URL), Schema: e.db.Schema, Brokers: e.kafka.Brokers,
		BeforeStart: func(ctx context.Context) error {
			close(waiting)
			<-ctx.Done()
			return ctx.Err()
		}})
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.config("starting", recordEffect("starting"))
	cfg.Brokers, cfg.Pool, cfg.Schema = nil, nil, ""
	c, err := r.AddConsumer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cancel, done := runRunner(t, r)
	<-waiting
	if code, body := readyz(t, r.Handler(), false); code != http.StatusServiceUnavailable || !strings.Contains(body, "runner: starting: BeforeStart") {
		t.Errorf("/readyz in BeforeStart: %d %q; want 503 naming the start-up step", code, body)
	}
	cancel()
	if err := waitRun(t, done, 10*time.Second); err != nil {
		t.Errorf("Run stopped while starting: %v; want nil", err)
	}
	if r.Started() || c.Ready() {
		t.Errorf("Started %v, consumer ready %v after a stop during start-up; want neither", r.Started(), c.Ready())
	}
}

// TestRunnerShutdownDeadline: a handler and an HTTP request that never
// finish by themselves do not hold Run past its ShutdownTimeout (plus the
// consumer's documented overrun of about a second): the record's
// transaction is abandoned (rolled back, redelivered later) and the request
// cancelled.
func TestRunnerShutdownDeadline(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	const timeout = 4 * time.Second
	r, err := oncely.New(oncely.Config{Pool: e.runnerPool(t, e.db.URL), Schema: e.db.Schema, Brokers: e.kafka.Brokers,
		Relay: &outbox.RelayConfig{}, ShutdownTimeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	inHandler := make(chan struct{})
	cfg := e.config("deadline", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		close(inHandler)
		<-ctx.Done() // until the consumer abandons the transaction
		return ctx.Err()
	})
	cfg.Brokers, cfg.Pool, cfg.Schema, cfg.MaxAttempts = nil, nil, "", 1000
	if _, err := r.AddConsumer(cfg); err != nil {
		t.Fatal(err)
	}
	inRequest, stuck := make(chan struct{}), newGate()
	t.Cleanup(stuck.open)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		close(inRequest)
		stuck.wait() // ignores its context: only the test ends it
	})}
	if err := r.AddServer(srv, ln); err != nil {
		t.Fatal(err)
	}
	cancel, done := runRunner(t, r)
	eventually(t, 30*time.Second, "the runner ready", func() bool { return r.Ready() == nil })
	go func() {
		if resp, err := http.Get("http://" + ln.Addr().String() + "/"); err == nil {
			_ = resp.Body.Close()
		}
	}()
	<-inRequest
	e.produce(t, []msg{{id: "never-done"}})
	<-inHandler

	start := time.Now()
	cancel()
	if err := waitRun(t, done, 30*time.Second); err != nil {
		t.Errorf("Run: %v", err)
	}
	if took := time.Since(start); took > timeout+2*time.Second {
		t.Errorf("Run took %s to shut down; want within ShutdownTimeout %s and the consumer's second of overrun", took, timeout)
	}
	if n := e.count(t, `SELECT count(*) FROM inbox`); n != 0 {
		t.Errorf("%d inbox rows; the abandoned record must have rolled back", n)
	}
}

// TestRunnerDispatcher: an outbound webhook dispatcher added to a runner
// works in the runner's schema (set once), delivers what OutboundStore
// enqueued, and stops with the runner; a dispatcher naming another schema
// is refused.
func TestRunnerDispatcher(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	r, err := oncely.New(oncely.Config{Pool: db.Pool, Schema: db.Schema, Migrate: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.AddDispatcher(outbound.DispatcherConfig{Store: outbound.Config{Schema: "elsewhere"}}); !errors.Is(err, oncely.ErrInvalidConfig) ||
		!strings.Contains(err.Error(), "outbound.DispatcherConfig.Store.Schema") {
		t.Errorf("AddDispatcher in another schema: %v; want ErrInvalidConfig naming the field", err)
	}
	got := make(chan string, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		got <- req.Header.Get("webhook-id")
	}))
	defer srv.Close()
	if _, err := r.AddDispatcher(outbound.DispatcherConfig{AllowNetworks: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
		PollInterval: 50 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	cancel, done := runRunner(t, r)
	eventually(t, 30*time.Second, "the runner started", r.Started)
	ctx := context.Background()
	if _, err := r.OutboundStore().CreateSubscription(ctx, db.Pool, outbound.Subscription{URL: srv.URL, EventTypes: []string{"order.*"}}); err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := r.OutboundStore().Enqueue(ctx, tx, outbound.Event{ID: "order-1-paid", Type: "order.paid", Payload: []byte(`{}`)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case id := <-got:
		if id == "" {
			t.Error("delivery without a webhook-id")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no delivery within 30s")
	}
	cancel()
	if err := waitRun(t, done, 20*time.Second); err != nil {
		t.Errorf("Run: %v", err)
	}
}

// TestRunnerWaitsForBrokers: brokers that do not answer at start are not a
// configuration error: Run waits for them, /readyz says so, and a shutdown
// meanwhile returns nil.
func TestRunnerWaitsForBrokers(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	_ = ln.Close() // nothing listens there now
	r, err := oncely.New(oncely.Config{Pool: db.Pool, Schema: db.Schema, Brokers: []string{dead}, Migrate: true,
		KafkaOpts: []kgo.Opt{kgo.RetryTimeout(200 * time.Millisecond)}, HealthInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.AddConsumer(consumer.Config{Topics: []string{"orders"}, Group: "g", Handler: recordEffect("w")}); err != nil {
		t.Fatal(err)
	}
	cancel, done := runRunner(t, r)
	eventually(t, 30*time.Second, "/readyz naming the brokers", func() bool {
		code, body := readyz(t, r.Handler(), false)
		return code == http.StatusServiceUnavailable && strings.Contains(body, "waiting for the brokers")
	})
	select {
	case err := <-done:
		t.Fatalf("Run returned %v while the brokers were unreachable; want it to wait", err)
	default:
	}
	cancel()
	if err := waitRun(t, done, 20*time.Second); err != nil {
		t.Errorf("Run stopped while waiting for the brokers: %v; want nil", err)
	}
}
