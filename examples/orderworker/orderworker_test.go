package main

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/outbox"
)

func TestMain(m *testing.M) {
	code := testenv.Main(m)
	if bin.dir != "" {
		_ = os.RemoveAll(bin.dir)
	}
	os.Exit(code)
}

// bin is the orderworker binary, built once per test run: the tests run
// workers as real processes so that SIGKILL and SIGTERM are real.
var bin struct {
	once sync.Once
	dir  string
	path string
	err  error
}

func workerBinary(t *testing.T) string {
	t.Helper()
	bin.once.Do(func() {
		if bin.dir, bin.err = os.MkdirTemp("", "orderworker-test-"); bin.err != nil {
			return
		}
		bin.path = filepath.Join(bin.dir, "orderworker")
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		out, err := exec.CommandContext(ctx, "go", "build", "-o", bin.path, ".").CombinedOutput()
		if err != nil {
			bin.err = fmt.Errorf("go build: %w\n%s", err, out)
		}
	})
	if bin.err != nil {
		t.Fatal(bin.err)
	}
	return bin.path
}

// env is one test's services and the worker command line that points at
// them.
type env struct {
	t      *testing.T
	db     *testenv.DB
	kafka  *testenv.Kafka
	topic  string
	events string // the order.accepted events' topic
	group  string
	cl     *kgo.Client
	adm    *kadm.Client
	log    *os.File // all the test's worker logs, printed if the test fails
}

func newEnv(t *testing.T, partitions int32) *env {
	t.Helper()
	workerBinary(t) // build first, so that the test's timings are the workers'
	// kfake's minimum session timeout is 6s; the churn test uses 3s.
	return newEnvOn(t, testenv.NewKafka(t, kfake.GroupMinSessionTimeout(time.Second)), partitions)
}

// newEnvOn is newEnv on the given Kafka.
func newEnvOn(t *testing.T, k *testenv.Kafka, partitions int32) *env {
	t.Helper()
	workerBinary(t)
	e := &env{
		t: t, db: testenv.Postgres(t), kafka: k,
		topic:  k.CreateTopic(t, "orders", partitions),
		events: k.CreateTopic(t, "order_events", partitions),
		group:  testenv.UniqueName("orderworker"),
	}
	// The worker checks at start that its dead-letter topic exists.
	k.CreateTopicNamed(t, dlq.DefaultTopic(e.topic), 1)
	e.cl = k.Client(t)
	e.adm = kadm.NewClient(e.cl)
	var err error
	if e.log, err = os.Create(filepath.Join(t.TempDir(), "workers.log")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(e.log.Name())
			t.Logf("worker logs:\n%s", tail(string(b), 150))
		}
		_ = e.log.Close()
	})
	return e
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// sessionTimeout is short on kfake; a real broker's minimum is usually 6s.
func (e *env) sessionTimeout() string {
	if e.kafka.Cluster != nil {
		return "3s"
	}
	return "6s"
}

// start runs a worker process; t.Cleanup kills it whatever happens.
func (e *env) start(name string, extra ...string) *workerProcess {
	e.t.Helper()
	return e.startWithEnv(name, nil, extra...)
}

// startWithEnv is start with variables added to the worker's environment.
func (e *env) startWithEnv(name string, environ []string, extra ...string) *workerProcess {
	e.t.Helper()
	args := append([]string{"run",
		"--brokers", strings.Join(e.kafka.Brokers, ","), "--topic", e.topic, "--events-topic", e.events,
		"--group", e.group, "--schema", e.db.Schema,
		"--http-addr", "127.0.0.1:0", "--session-timeout", e.sessionTimeout(),
	}, extra...)
	environ = append([]string{"DATABASE_URL=" + e.db.URL}, environ...)
	p, err := startWorkerProcess(e.t.Context(), workerBinary(e.t), args, environ, name, e.log)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(p.kill)
	return p
}

func (e *env) count(ctx context.Context, sql string, args ...any) (int64, error) {
	return queryInt(ctx, e.db.Pool, sql, args...)
}

// waitEffects waits until n distinct orders have an effect and the group's
// committed offsets reached the end of every partition.
func (e *env) waitEffects(ctx context.Context, n int, timeout time.Duration, ws ...*workerProcess) {
	e.t.Helper()
	q := newEffectQueries(e.db.Schema)
	err := poll(ctx, timeout, 20*time.Millisecond, fmt.Sprintf("%d orders with effects and offsets at the end", n),
		func(ctx context.Context) (bool, error) {
			if err := alive(ws...); err != nil {
				return false, err
			}
			got, err := e.count(ctx, q.countDistinct)
			if err != nil || got < int64(n) {
				return false, err
			}
			return offsetsCaughtUp(ctx, e.adm, e.group, e.topic)
		})
	if err != nil {
		e.t.Fatal(err)
	}
}

// waitPublished waits until the relays of the running workers ws published
// every event in the outbox.
func (e *env) waitPublished(ctx context.Context, timeout time.Duration, ws ...*workerProcess) {
	e.t.Helper()
	q := newEffectQueries(e.db.Schema)
	if err := poll(ctx, timeout, 20*time.Millisecond, "an empty outbox", func(ctx context.Context) (bool, error) {
		if err := alive(ws...); err != nil {
			return false, err
		}
		n, err := e.count(ctx, q.pending)
		return n == 0, err
	}); err != nil {
		e.t.Fatal(err)
	}
}

// checkAll is checkEffects and checkEvents: the report of a finished run.
func (e *env) checkAll(ctx context.Context, b orderBatch) *report {
	e.t.Helper()
	rep, err := checkEffects(ctx, e.db.Pool, e.db.Schema, e.group, b)
	if err == nil {
		err = checkEvents(ctx, e.kafka.Brokers, e.events, b, rep)
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return rep
}

// alive fails, so that poll gives up, if a worker exited.
func alive(ws ...*workerProcess) error {
	for _, w := range ws {
		if w.exited() {
			return giveUp(fmt.Errorf("%s exited: %s", w.Name, w.cmd.ProcessState))
		}
	}
	return nil
}

// stopAll sends SIGTERM to every worker at once and requires each to exit 0
// within 10s, the grace period orchestrators usually give.
func stopAll(t *testing.T, ws ...*workerProcess) {
	t.Helper()
	type result struct {
		name string
		code int
		took time.Duration
		err  error
	}
	results := make(chan result, len(ws))
	for _, w := range ws {
		go func() {
			start := time.Now()
			code, err := w.terminate(10 * time.Second)
			results <- result{w.Name, code, time.Since(start), err}
		}()
	}
	for range ws {
		r := <-results
		if r.err != nil || r.code != 0 {
			t.Errorf("%s: SIGTERM: exit code %d after %s, err %v; want 0 within 10s", r.name, r.code, r.took.Round(time.Millisecond), r.err)
		} else {
			t.Logf("%s: exit 0 %s after SIGTERM", r.name, r.took.Round(time.Millisecond))
		}
	}
}

// stats parses a stopped worker's final log line.
func stats(t *testing.T, w *workerProcess) (processed, duplicates int64) {
	t.Helper()
	m := w.find(stoppedRE)
	if m == nil {
		t.Fatalf("%s: no %q line in its log", w.Name, "orderworker stopped")
	}
	processed, _ = strconv.ParseInt(m[1], 10, 64)
	duplicates, _ = strconv.ParseInt(m[2], 10, 64)
	return processed, duplicates
}

func requireExactlyOnce(t *testing.T, rep *report) {
	t.Helper()
	var buf bytes.Buffer
	rep.print(&buf)
	t.Logf("\n%s", buf.String())
	if rep.DuplicateEffects != 0 || rep.MissingEffects != 0 || rep.BalanceErrors != 0 ||
		rep.Effects != int64(rep.UniqueOrders) || rep.InboxRows != int64(rep.UniqueOrders+rep.PoisonRecords) {
		t.Errorf("not exactly once: %+v", *rep)
	}
	if rep.EventsTopic == "" {
		t.Error("the events were not checked")
	} else if !rep.eventsOK() || rep.EventRecords != rep.EventIDs+rep.Republished {
		t.Errorf("not one order.accepted event per order: %+v", *rep)
	}
}

// TestDemo runs the README's main job against the test's schema and checks
// its figures.
func TestDemo(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	logPath := filepath.Join(t.TempDir(), "demo.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = logFile.Close() })
	var progress bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	exe := workerBinary(t)
	start := time.Now()
	rep, err := runDemo(ctx, demoConfig{
		DatabaseURL: db.URL, Schema: db.Schema,
		Spec:      orderSpec{Count: 3000, Customers: 50, DupRate: 0.2},
		WorkerExe: exe, WorkerLog: logFile,
	}, &progress)
	t.Logf("demo took %s:\n%s", time.Since(start).Round(time.Millisecond), progress.String())
	if err != nil {
		b, _ := os.ReadFile(logPath)
		t.Fatalf("demo: %v\nworker logs:\n%s", err, tail(string(b), 100))
	}
	requireExactlyOnce(t, rep)
	if rep.Delivered != 3600 || rep.DuplicatesSent != 600 || rep.UniqueOrders != 3000 || rep.Crashes != 1 || rep.LastExit != 0 {
		t.Errorf("report = %+v; want 3600 delivered, 600 duplicates, 3000 orders, 1 crash, exit 0", *rep)
	}
	if rep.EventsTopic != demoEventsTopic || rep.EventIDs != 3000 || rep.EventOrders != 3000 {
		t.Errorf("events: %+v; want 3000 distinct order.accepted events on %s", *rep, demoEventsTopic)
	}
	if rep.Absorbed < 1 {
		t.Errorf("the last worker skipped %d deliveries; the demo's duplicates should reach it", rep.Absorbed)
	}
	if !rep.ok() {
		t.Error("report.ok() = false")
	}
}

// TestDemoCommand runs `orderworker demo` as a user would (a smaller one):
// exit status 0 and the table on stdout.
func TestDemoCommand(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, workerBinary(t), "demo", "--orders", "300", "--schema", db.Schema,
		"--database-url", db.URL, "--log-file", filepath.Join(t.TempDir(), "demo.log"))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("orderworker demo: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	for _, want := range []string{"(300 orders + 60 duplicate deliveries)", "duplicate effects",
		"order.accepted events on order-events", "duplicate events",
		"every order counted exactly once, and was announced by exactly one order.accepted event."} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout.String())
		}
	}
}

// TestChurn is the acceptance test: three instances, one of them
// killed with SIGKILL and restarted every two seconds while orders (20% of
// them delivered twice) stream in. The group must keep making progress, and
// every order must have exactly one effect.
func TestChurn(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 6)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	start := time.Now()

	// Three instances start at the same moment against an empty schema:
	// the migrations' advisory locks must sort them out.
	names := []string{"worker-a", "worker-b", "worker-c"}
	workers := make([]*workerProcess, len(names))
	for i, name := range names {
		workers[i] = e.start(name, "--instance-id", name)
	}

	batch := generate(orderSpec{Count: 3000, Customers: 50, DupRate: 0.2}, newRand())
	produced := make(chan error, 1)
	go func() {
		// ~12s at 300 records a second.
		produced <- produce(ctx, e.cl, e.topic, batch.Deliveries, 300)
	}()

	// Sample each partition's effects every 100ms to find the longest
	// stall: the longest time a partition went without a new effect while
	// orders kept arriving on it.
	q := newEffectQueries(e.db.Schema)
	sampleCtx, stopSampling := context.WithCancel(ctx)
	defer stopSampling()
	type stall struct {
		d time.Duration
		p int32
	}
	stalls := make(chan stall, 1)
	go func() {
		d, p := longestStall(sampleCtx, e)
		stalls <- stall{d, p}
	}()

	// Churn until the producer is done: every 2s, SIGKILL the next
	// instance and restart it with the same instance id.
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	var effectsAtKill []int64
	kills := 0
churn:
	for {
		select {
		case err := <-produced:
			if err != nil {
				t.Fatal(err)
			}
			break churn
		case <-tick.C:
		}
		n, err := e.count(ctx, q.count)
		if err != nil {
			t.Fatal(err)
		}
		effectsAtKill = append(effectsAtKill, n)
		i := kills % len(workers)
		workers[i].kill()
		workers[i] = e.start(fmt.Sprintf("%s-%d", names[i], kills/len(workers)+2), "--instance-id", names[i])
		kills++
	}
	churnDone := time.Since(start)
	stopSampling()
	worst := <-stalls
	t.Logf("churn: %d kills in %s; effects at each kill: %v; longest partition stall: %s (partition %d)",
		kills, churnDone.Round(time.Millisecond), effectsAtKill, worst.d.Round(time.Millisecond), worst.p)
	if worst.d > 6*time.Second {
		t.Errorf("partition %d made no progress for %s while orders kept arriving", worst.p, worst.d.Round(time.Millisecond))
	}
	if kills < 4 {
		t.Errorf("only %d kills during the churn phase; want at least 4", kills)
	}
	// Progress under churn: the group must not stall between two kills.
	for i := 1; i < len(effectsAtKill); i++ {
		if effectsAtKill[i] <= effectsAtKill[i-1] {
			t.Errorf("no progress between kill %d and kill %d: effects %d then %d", i, i+1, effectsAtKill[i-1], effectsAtKill[i])
		}
	}

	e.waitEffects(ctx, len(batch.Orders), 90*time.Second-time.Since(start), workers...)
	e.waitPublished(ctx, 90*time.Second-time.Since(start), workers...)
	t.Logf("all %d orders applied and their events published %s after the churn ended",
		len(batch.Orders), (time.Since(start) - churnDone).Round(time.Millisecond))
	stopAll(t, workers...)

	rep := e.checkAll(ctx, batch)
	rep.Crashes = kills
	requireExactlyOnce(t, rep)
	t.Logf("churn test took %s", time.Since(start).Round(time.Millisecond))
}

// longestStall samples each partition's effects every 100ms until ctx is
// done and returns the longest time one partition went without a new effect
// (orders arrive on every partition all along), and which partition.
func longestStall(ctx context.Context, e *env) (time.Duration, int32) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	type progress struct {
		n    int64
		last time.Time
	}
	parts := make(map[int32]*progress)
	var longest time.Duration
	var worst int32
	start := time.Now()
	for {
		select {
		case <-ctx.Done():
			for p, pr := range parts { // a stall still going on counts too
				if d := time.Since(pr.last); d > longest {
					longest, worst = d, p
				}
			}
			return longest, worst
		case <-t.C:
		}
		rows, _ := e.db.Pool.Query(ctx, `SELECT partition, count(*) FROM `+
			pgx.Identifier{e.db.Schema, "orders"}.Sanitize()+` GROUP BY partition`)
		var p int32
		var n int64
		_, _ = pgx.ForEachRow(rows, []any{&p, &n}, func() error { // errors: tables not created yet
			pr := parts[p]
			if pr == nil {
				pr = &progress{last: start}
				parts[p] = pr
			}
			if n != pr.n {
				if d := time.Since(pr.last); d > longest {
					longest, worst = d, p
				}
				pr.n, pr.last = n, time.Now()
			}
			return nil
		})
	}
}

// TestSIGTERM stops a worker in the middle of a backlog: it must exit 0
// within 10s, having committed the offset of every record whose effects
// committed, so that its successor reprocesses nothing.
func TestSIGTERM(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	// Generous bounds: on a loaded machine the backlog takes a while.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	batch := generate(orderSpec{Count: 4000, Customers: 50}, newRand())
	if err := produce(ctx, e.cl, e.topic, batch.Deliveries, 0); err != nil {
		t.Fatal(err)
	}
	w1 := e.start("worker-1")
	q := newEffectQueries(e.db.Schema)
	if err := poll(ctx, 30*time.Second, 5*time.Millisecond, "300 effects", func(ctx context.Context) (bool, error) {
		if err := alive(w1); err != nil {
			return false, err
		}
		n, err := e.count(ctx, q.count)
		return n >= 300, err
	}); err != nil {
		t.Fatal(err)
	}
	stopAll(t, w1)
	processed, _ := stats(t, w1)
	if processed >= int64(len(batch.Orders)) {
		t.Fatalf("worker-1 processed all %d records before SIGTERM; the test wants work in flight", processed)
	}

	// Every record whose effects committed has its offset committed, and
	// no other: per partition, committed offset == inbox rows.
	inbox := inboxPerPartition(t, e)
	offs, err := e.adm.FetchOffsetsForTopics(ctx, e.group, e.topic)
	if err != nil {
		t.Fatal(err)
	}
	var committed int64
	for p := range int32(4) {
		o, _ := offs.Lookup(e.topic, p)
		at := max(o.At, 0)
		committed += at
		if at != inbox[p] {
			t.Errorf("partition %d: committed offset %d, but %d records have effects", p, at, inbox[p])
		}
	}
	if committed != processed {
		t.Errorf("committed offsets sum to %d; worker-1 processed %d", committed, processed)
	}
	t.Logf("worker-1 processed %d of %d records before SIGTERM; all committed", processed, len(batch.Orders))

	// A successor reprocesses nothing: it sees the rest of the backlog and
	// one new order per partition, and no duplicate. It runs customers side
	// by side where worker-1 ran batches: the modes share the inbox.
	w2 := e.start("worker-2", "--key-parallelism", "4")
	extra := generate(orderSpec{Count: 4, Customers: 4}, newRand())
	manual := e.kafka.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	for p, d := range extra.Deliveries {
		r := d.record(e.topic)
		r.Partition = int32(p)
		if err := manual.ProduceSync(ctx, r).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	total := len(batch.Orders) + len(extra.Orders)
	e.waitEffects(ctx, total, 2*time.Minute, w2)
	e.waitPublished(ctx, 30*time.Second, w2)
	stopAll(t, w2)
	processed2, dups2 := stats(t, w2)
	if processed2 != int64(total)-processed || dups2 != 0 {
		t.Errorf("worker-2 processed %d and skipped %d as duplicates; want %d and 0", processed2, dups2, int64(total)-processed)
	}
	all := batch
	all.Orders = append(all.Orders, extra.Orders...)
	all.Deliveries = append(all.Deliveries, extra.Deliveries...)
	requireExactlyOnce(t, e.checkAll(ctx, all))
}

func inboxPerPartition(t *testing.T, e *env) map[int32]int64 {
	t.Helper()
	rows, _ := e.db.Pool.Query(context.Background(),
		`SELECT partition, count(*) FROM `+pgx.Identifier{e.db.Schema, "inbox"}.Sanitize()+
			` WHERE consumer_group = $1 GROUP BY partition`, e.group)
	m := make(map[int32]int64)
	var p int32
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&p, &n}, func() error { m[p] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestHealthz: 503 while the worker waits for its migration lock, 200 once
// it consumes.
func TestHealthz(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// Hold the example's migration lock, as another instance starting at
	// the same moment would.
	st, err := newStore(e.db.Schema, e.events)
	if err != nil {
		t.Fatal(err)
	}
	key := st.lockKey()
	tx, err := e.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`, key); err != nil {
		t.Fatal(err)
	}

	w := e.start("worker-1")
	var addr string
	if err := poll(ctx, 20*time.Second, 10*time.Millisecond, "the worker's http address", func(context.Context) (bool, error) {
		if err := alive(w); err != nil {
			return false, err
		}
		if m := w.find(httpAddrRE); m != nil {
			addr = m[1]
		}
		return addr != "", nil
	}); err != nil {
		t.Fatal(err)
	}
	// The worker is now blocked on the lock (pg_locks shows it waiting).
	if err := poll(ctx, 20*time.Second, 10*time.Millisecond, "the worker waiting for the lock", func(ctx context.Context) (bool, error) {
		if err := alive(w); err != nil {
			return false, err
		}
		n, err := e.count(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
			AND ((classid::bigint << 32) | objid::bigint) = hashtextextended($1, 0)`, key)
		return n > 0, err
	}); err != nil {
		t.Fatal(err)
	}
	if code := healthz(t, addr); code != http.StatusServiceUnavailable {
		t.Fatalf("GET /healthz before migrations = %d; want 503", code)
	}
	// /readyz says why; /livez: the process is alive.
	for path, want := range map[string]struct {
		code int
		body string
	}{"/readyz": {http.StatusServiceUnavailable, "runner: starting: BeforeStart"}, "/livez": {http.StatusOK, "ok"}} {
		r, err := send(ctx, http.MethodGet, "http://"+addr+path, nil, nil)
		if err != nil || r.status != want.code || !strings.Contains(string(r.body), want.body) {
			t.Errorf("GET %s before migrations: %d %q, %v; want %d with %q", path, r.status, r.body, err, want.code, want.body)
		}
	}
	// The order routes, whose tables may not exist yet, answer 503 too.
	for _, path := range []string{ordersPath, webhookPath} {
		r, err := send(ctx, http.MethodPost, "http://"+addr+path, keyed("before-migrations"), []byte(`{}`))
		if err != nil || r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" {
			t.Errorf("POST %s before migrations: %d, %v; want 503 with Retry-After", path, r.status, err)
		}
	}

	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := poll(ctx, 20*time.Second, 10*time.Millisecond, "GET /healthz = 200", func(context.Context) (bool, error) {
		if err := alive(w); err != nil {
			return false, err
		}
		return healthz(t, addr) == http.StatusOK, nil
	}); err != nil {
		t.Fatal(err)
	}
	// Ready means consuming: an order produced now gets its effect.
	one := generate(orderSpec{Count: 1, Customers: 1}, newRand())
	if err := produce(ctx, e.cl, e.topic, one.Deliveries, 0); err != nil {
		t.Fatal(err)
	}
	e.waitEffects(ctx, 1, 20*time.Second, w)
	stopAll(t, w)
}

// TestHealthzDatabaseOutage: the worker's database becomes unreachable (a
// proxy between them drops every connection): GET /healthz answers 503
// although no record arrives, the process keeps running, and once the
// database is back it answers 200 and consumes again.
func TestHealthzDatabaseOutage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	proxy := testenv.NewPostgresProxy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	w := e.startWithEnv("worker-1", []string{"DATABASE_URL=" + proxy.URL})
	var addr string
	waitHealth := func(what string, want int) {
		t.Helper()
		if err := poll(ctx, time.Minute, 10*time.Millisecond, what, func(context.Context) (bool, error) {
			if err := alive(w); err != nil {
				return false, err
			}
			if m := w.find(httpAddrRE); m != nil {
				addr = m[1]
			}
			return addr != "" && healthz(t, addr) == want, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	waitHealth("GET /healthz = 200", http.StatusOK)
	proxy.Cut()
	waitHealth("GET /healthz = 503 with the database cut off", http.StatusServiceUnavailable)
	proxy.Restore()
	waitHealth("GET /healthz = 200 with the database back", http.StatusOK)
	one := generate(orderSpec{Count: 1, Customers: 1}, newRand())
	if err := produce(ctx, e.cl, e.topic, one.Deliveries, 0); err != nil {
		t.Fatal(err)
	}
	e.waitEffects(ctx, 1, time.Minute, w)
	stopAll(t, w)
}

func healthz(t *testing.T, addr string) int {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+addr+"/healthz", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET /healthz: %v", err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// TestHandler checks the handler alone: one order, two effects and one
// order.accepted event in the outbox, in the caller's transaction; a record
// that cannot be an order is an error that the consumer dead-letters at
// once, and its transaction, event included, rolls back.
func TestHandler(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	st, err := newStore(db.Schema, "order-events")
	if err != nil {
		t.Fatal(err)
	}
	// The balances table as versions before the events' seq created it:
	// migrate adds the column.
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE customer_balances (customer_id text PRIMARY KEY, balance_cents bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if err := st.migrate(ctx, db.Pool, nil); err != nil {
		t.Fatal(err)
	}
	handle := st.handler()
	run := func(value string) error {
		return pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			return handle(ctx, tx, &consumer.Message{ID: "m1", Topic: "orders", Value: []byte(value)})
		})
	}
	for _, v := range []string{
		`{"order_id":"o1","customer_id":"c1","amount_cents":250}`,
		`{"order_id":"o2","customer_id":"c1","amount_cents":50}`,
	} {
		if err := run(v); err != nil {
			t.Fatalf("handle(%s): %v", v, err)
		}
	}
	var balance int64
	if err := db.Pool.QueryRow(ctx, `SELECT balance_cents FROM customer_balances WHERE customer_id = 'c1'`).Scan(&balance); err != nil || balance != 300 {
		t.Errorf("balance of c1 = %d, %v; want 300", balance, err)
	}
	for _, tc := range []struct {
		value string
		class dlq.Class
	}{
		{`not json`, dlq.ClassUndecodable},
		{`{"order_id":"o3","customer_id":"c1","amount_cents":1.5}`, dlq.ClassUndecodable},
		{`{"order_id":"o3","customer_id":"c1","amount_cents":1,"coupon":"x"}`, dlq.ClassUndecodable},
		{`{"customer_id":"c1","amount_cents":1}`, dlq.ClassPermanent},
		{`{"order_id":"o3","amount_cents":1}`, dlq.ClassPermanent},
		{`{"order_id":"o3","customer_id":"c1"}`, dlq.ClassPermanent}, // amount_cents missing: 0
		{`{"order_id":"o3","customer_id":"c1","amount_cents":0}`, dlq.ClassPermanent},
		{`{"order_id":"o3","customer_id":"c1","amount_cents":-100}`, dlq.ClassPermanent},
	} {
		err := run(tc.value)
		if class, ok := dlq.PermanentClass(err); !ok || class != tc.class {
			t.Errorf("handle(%s) = %v (class %q); want a %q error", tc.value, err, class, tc.class)
		}
	}
	if n, _ := queryInt(ctx, db.Pool, `SELECT count(*) FROM orders`); n != 2 {
		t.Errorf("%d orders rows; want 2 (failed records roll back)", n)
	}

	// One event per applied order, in the outbox, waiting for the relay.
	rows, _ := db.Pool.Query(ctx, `SELECT topic, convert_from(key, 'UTF8'), convert_from(value, 'UTF8'), header_keys, header_values
		FROM outbox WHERE sent_at IS NULL ORDER BY id`)
	type event struct {
		topic, key, value string
		headers           map[string]string
	}
	var events []event
	var ev event
	var hks []string
	var hvs [][]byte
	if _, err := pgx.ForEachRow(rows, []any{&ev.topic, &ev.key, &ev.value, &hks, &hvs}, func() error {
		ev.headers = map[string]string{}
		for i, k := range hks {
			ev.headers[k] = string(hvs[i])
		}
		events = append(events, ev)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(events) != 2 {
		t.Fatalf("%d events in the outbox; want 2 (failed records roll back theirs): %+v", len(events), events)
	}
	// Keyed by customer, numbered in the customer's commit order.
	for i, want := range []struct{ key, value string }{
		{"c1", `{"order_id":"o1","customer_id":"c1","amount_cents":250,"seq":1}`},
		{"c1", `{"order_id":"o2","customer_id":"c1","amount_cents":50,"seq":2}`},
	} {
		ev := events[i]
		if ev.topic != "order-events" || ev.key != want.key || ev.value != want.value ||
			ev.headers[eventTypeHeader] != orderAcceptedType || ev.headers[outbox.MessageIDHeader] == "" {
			t.Errorf("event %d = %+v; want %s on order-events with key %s, type %s and a message id",
				i, ev, want.value, want.key, orderAcceptedType)
		}
	}
}

// TestPoisonRecord: records that are not valid orders (not JSON, a field
// missing, an amount that is not positive) go to orders.dlq at once, with
// oncely's headers, and the orders behind them in their partition still get
// their effects and their events.
func TestPoisonRecord(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dlqTopic := dlq.DefaultTopic(e.topic) // created by newEnv

	poisons := []struct {
		id, value string
		class     dlq.Class
		err       string // in the error header
	}{
		{"poison-json", `{"order_id": 42}`, dlq.ClassUndecodable, "cannot unmarshal number"},
		{"poison-missing", `{"customer_id":"cust-x","amount_cents":100}`, dlq.ClassPermanent, "order_id and customer_id are required"},
		{"poison-zero", `{"order_id":"ord-zero","customer_id":"cust-x","amount_cents":0}`, dlq.ClassPermanent, "amount_cents must be positive, got 0"},
		{"poison-negative", `{"order_id":"ord-neg","customer_id":"cust-x","amount_cents":-500}`, dlq.ClassPermanent, "amount_cents must be positive, got -500"},
	}
	offsets := map[string]int64{}
	producePoison := func(i int) {
		p := poisons[i]
		r := &kgo.Record{Topic: e.topic, Key: []byte("cust-x"), Value: []byte(p.value),
			Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(p.id)}}}
		if err := e.cl.ProduceSync(ctx, r).FirstErr(); err != nil {
			t.Fatal(err)
		}
		offsets[p.id] = r.Offset
	}
	// One partition: poison, orders, more poison, more orders.
	batch := generate(orderSpec{Count: 10, Customers: 3}, newRand())
	producePoison(0)
	if err := produce(ctx, e.cl, e.topic, batch.Deliveries[:5], 0); err != nil {
		t.Fatal(err)
	}
	for i := 1; i < len(poisons); i++ {
		producePoison(i)
	}
	if err := produce(ctx, e.cl, e.topic, batch.Deliveries[5:], 0); err != nil {
		t.Fatal(err)
	}

	w := e.start("worker-1")
	e.waitEffects(ctx, len(batch.Orders), 30*time.Second, w)
	e.waitPublished(ctx, 20*time.Second, w)
	stopAll(t, w)
	if _, dups := stats(t, w); dups != 0 {
		t.Errorf("%d duplicates; want 0", dups)
	}
	if m := w.find(regexp.MustCompile(`dead_lettered=(\d+)`)); m == nil || m[1] != strconv.Itoa(len(poisons)) {
		t.Errorf("dead-lettered: %v; want %d", m, len(poisons))
	}

	// The dead-letter records, read back as `oncely dlq list` does: the
	// original value and message id, and where and why it failed.
	entries, err := dlq.List(ctx, []kgo.Opt{kgo.SeedBrokers(e.kafka.Brokers...)}, dlqTopic, dlq.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != len(poisons) {
		t.Fatalf("%d dead-letter records; want %d: %+v", len(entries), len(poisons), entries)
	}
	for i, p := range poisons {
		en := entries[i] // in offset order, as produced
		if en.Err != nil {
			t.Errorf("dead-letter record %d: %v", i, en.Err)
			continue
		}
		info := en.Info
		if string(en.Record.Value) != p.value || info.MessageID != p.id || info.Class != p.class ||
			info.Topic != e.topic || info.Partition != 0 || info.Offset != offsets[p.id] || info.Group != e.group ||
			info.Attempts != 1 || !strings.Contains(info.Error, p.err) || en.Copies != 1 {
			t.Errorf("dead-letter record %d: value %s, %+v (copies %d); want value %s, message id %s, class %s, "+
				"source %s/0/%d, group %s, 1 attempt, an error containing %q",
				i, en.Record.Value, *info, en.Copies, p.value, p.id, p.class, e.topic, offsets[p.id], e.group, p.err)
		}
	}
	permanent, err := dlq.List(ctx, []kgo.Opt{kgo.SeedBrokers(e.kafka.Brokers...)}, dlqTopic, dlq.Filter{Class: dlq.ClassPermanent})
	if err != nil {
		t.Fatal(err)
	}
	if len(permanent) != 3 {
		t.Errorf("%d permanent dead-letter records; want 3", len(permanent))
	}

	// Exactly the valid orders have effects and events; no poison record
	// left an event behind.
	rep := e.checkAll(ctx, batch)
	var buf bytes.Buffer
	rep.print(&buf)
	t.Logf("\n%s", buf.String())
	if rep.DuplicateEffects != 0 || rep.MissingEffects != 0 || rep.BalanceErrors != 0 || rep.Effects != 10 ||
		!rep.eventsOK() || rep.EventRecords != 10 {
		t.Errorf("effects and events: %+v", *rep)
	}
}

// TestFlags: invalid values exit 2 with an error naming the flag (and its
// environment variable).
func TestFlags(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string // in stderr; "" means exit 0
		hide string // a secret that must appear in neither stdout nor stderr
	}{
		{args: []string{"run", "--session-timeout", "soon"}, want: "--session-timeout (SESSION_TIMEOUT)"},
		{env: map[string]string{"SESSION_TIMEOUT": "-1s"}, want: "--session-timeout (SESSION_TIMEOUT)"},
		{args: []string{"run", "--batch-size", "0"}, want: "--batch-size (BATCH_SIZE)"},
		{env: map[string]string{"KEY_PARALLELISM": "many"}, want: "--key-parallelism (KEY_PARALLELISM)"},
		{env: map[string]string{"GROUP_CONCURRENCY": "-2"}, want: "--group-concurrency (GROUP_CONCURRENCY)"},
		{args: []string{"--source", "rabbitmq", "--group-concurrency", "4"}, want: "--group-concurrency (GROUP_CONCURRENCY)"},
		{args: []string{"run", "--batch-size", "50", "--key-parallelism", "8"}, want: "cannot be combined with --key-parallelism 8"},
		{args: []string{"--rebalance-timeout", "0s"}, want: "--rebalance-timeout (REBALANCE_TIMEOUT)"},
		{env: map[string]string{"REBALANCE_TIMEOUT": "later"}, want: "--rebalance-timeout (REBALANCE_TIMEOUT)"},
		{args: []string{"--schema", "Orders; DROP"}, want: "--schema (ONCELY_SCHEMA)"},
		{env: map[string]string{"ONCELY_SCHEMA": "pg_catalog"}, want: "--schema (ONCELY_SCHEMA)"},
		{args: []string{"--brokers", "a:9092,,b:9092"}, want: "--brokers (KAFKA_BROKERS)"},
		{args: []string{"--database-url", "postgres://x:y@[::1"}, want: "--database-url (DATABASE_URL)"},
		{args: []string{"--group", ""}, want: "--group (CONSUMER_GROUP)"},
		{args: []string{"--no-such-flag"}, want: "flag provided but not defined: -no-such-flag"},
		{args: []string{"run", "extra"}, want: `unexpected argument "extra"`},
		{args: []string{"deploy"}, want: `unknown command "deploy"`},
		{args: []string{"produce"}, want: "--brokers (KAFKA_BROKERS)"},
		{args: []string{"produce", "--brokers", "x:1", "--dup-rate", "2"}, want: "--dup-rate"},
		{args: []string{"demo", "--orders", "0"}, want: "--orders"},
		{args: []string{"--source", "sqs"}, want: "--source (SOURCE)"},
		{env: map[string]string{"SOURCE": "jetstream", "KEY_PARALLELISM": "8"}, want: "--key-parallelism (KEY_PARALLELISM)"},
		{args: []string{"--source", "jetstream", "--ack-wait", "never"}, want: "--ack-wait (ACK_WAIT)"},
		{args: []string{"produce", "--source", "kafka-ish"}, want: "--source (SOURCE)"},
		{args: []string{"--source", "rabbitmq", "--key-parallelism", "8"}, want: "--key-parallelism (KEY_PARALLELISM)"},
		{args: []string{"run", "-h"}, env: map[string]string{"AMQP_URL": "amqp://u:amqp-pw-77c1@127.0.0.1:5672/"}, hide: "amqp-pw-77c1"},
		{args: []string{"--events-topic", ""}, want: "--events-topic (EVENTS_TOPIC)"},
		{args: []string{"--topic", "x", "--events-topic", "x"}, want: "--events-topic (EVENTS_TOPIC)"},
		{env: map[string]string{"EVENTS_TOPIC": "orders.dlq"}, want: "--events-topic (EVENTS_TOPIC)"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, want: "OTEL_EXPORTER_OTLP_PROTOCOL"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, want: "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"},
		{args: []string{"--trace-stdout=maybe"}, want: "invalid boolean value"},
		{args: []string{"run", "-h"}},
		{args: []string{"--webhook-secret", "whsec_not*base64"}, want: "--webhook-secret (WEBHOOK_SECRET)", hide: "not*base64"},
		{env: map[string]string{"WEBHOOK_SECRET": "whsec_c2VjcmV0LWtleQ==,"}, want: "--webhook-secret (WEBHOOK_SECRET)", hide: "c2VjcmV0LWtleQ"},
		{env: map[string]string{"WEBHOOK_SECRET": "whsec_"}, want: "--webhook-secret (WEBHOOK_SECRET)"},
		// -h prints the flags' defaults: the secret from the environment is none of them.
		{args: []string{"run", "-h"}, env: map[string]string{"WEBHOOK_SECRET": "whsec_c2VjcmV0LWtleQ=="}, hide: "c2VjcmV0LWtleQ"},
		{env: map[string]string{"ONCELY_TEST_ORDERS_HALT": "sometimes"}, want: "ONCELY_TEST_ORDERS_HALT"},
		// Kafka's TLS and SASL flags (shared with the oncely CLI).
		{args: []string{"--sasl-mechanism", "scram-sha-256", "--sasl-user", "u"}, env: map[string]string{"KAFKA_SASL_PASSWORD": "sasl-pw-9d2e"},
			want: "--brokers (KAFKA_BROKERS)", hide: "sasl-pw-9d2e"},
		{args: []string{"--brokers", "x:1", "--sasl-mechanism", "kerberos", "--sasl-user", "u"}, want: "--sasl-mechanism"},
		{args: []string{"--brokers", "x:1", "--sasl-mechanism", "scram-sha-512", "--sasl-user", "u"}, want: "--sasl-password (KAFKA_SASL_PASSWORD)"},
		{args: []string{"--brokers", "x:1", "--tls-cert", "c.pem"}, want: "--tls-cert and --tls-key"},
		{args: []string{"produce", "--brokers", "x:1", "--sasl-mechanism", "plain"}, want: "--sasl-user (KAFKA_SASL_USER)"},
		{args: []string{"run", "-h"}, env: map[string]string{"KAFKA_SASL_PASSWORD": "sasl-pw-9d2e"}, hide: "sasl-pw-9d2e"},
		{args: []string{"run", "-h"}, env: map[string]string{"DATABASE_URL": "postgres://u:db-pw-51aa@127.0.0.1:1/x"}, hide: "db-pw-51aa"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := run(tc.args, func(k string) string { return tc.env[k] }, &stdout, &stderr)
			switch {
			case tc.want == "" && code != exitOK:
				t.Errorf("exit %d; want 0; stderr: %s", code, stderr.String())
			case tc.want != "" && (code != exitUsage || !strings.Contains(stderr.String(), tc.want)):
				t.Errorf("exit %d, stderr %q; want exit 2 and %q", code, stderr.String(), tc.want)
			}
			if tc.hide != "" && strings.Contains(stdout.String()+stderr.String(), tc.hide) {
				t.Errorf("the secret is in the output: stdout %q, stderr %q", stdout.String(), stderr.String())
			}
		})
	}
}

// TestTelemetry: a worker with an OTLP endpoint in its environment and
// --trace-stdout exports its spans over OTLP/HTTP and to stdout, pushes its
// metrics over OTLP/HTTP and serves them on GET /metrics in the Prometheus
// format; on SIGTERM it flushes all of it before it exits.
func TestTelemetry(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	col := newFakeCollector(t)

	w := e.startWithEnv("worker-1", []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + col.URL,
		"OTEL_METRIC_EXPORT_INTERVAL=500", // ms
	}, "--trace-stdout", "--instance-id", "telemetry-1")
	batch := generate(orderSpec{Count: 20, Customers: 5, DupRate: 0.25}, newRand())
	if err := produce(ctx, e.cl, e.topic, batch.Deliveries, 0); err != nil {
		t.Fatal(err)
	}
	records := len(batch.Deliveries) // 25: 20 orders, 5 delivered twice
	e.waitEffects(ctx, len(batch.Orders), 30*time.Second, w)
	e.waitPublished(ctx, 20*time.Second, w)

	// GET /metrics: the Prometheus names of oncely's metrics (dots become
	// underscores, counters get _total, units a suffix).
	addr := w.find(httpAddrRE)[1]
	topic := `messaging_destination_name="` + e.topic + `"`
	want := []struct {
		name   string
		labels []string
		value  float64
	}{
		{"messaging_client_consumed_messages_total", []string{topic, `messaging_consumer_group_name="` + e.group + `"`}, float64(records)},
		{"oncely_consumer_duplicates_total", []string{topic}, float64(batch.Duplicates)},
		{"messaging_process_duration_seconds_count", []string{topic}, float64(records)},
		{"messaging_client_sent_messages_total", []string{`messaging_destination_name="` + e.events + `"`}, float64(len(batch.Orders))},
		{"oncely_outbox_pending", nil, 0},
		{"target_info", []string{`service_name="orderworker"`, `service_instance_id="telemetry-1"`}, 1},
	}
	var body string
	err := poll(ctx, 10*time.Second, 50*time.Millisecond, "the expected values on GET /metrics", func(ctx context.Context) (bool, error) {
		if err := alive(w); err != nil {
			return false, err
		}
		var err error
		if body, err = get(ctx, "http://"+addr+"/metrics"); err != nil {
			return false, err
		}
		for _, m := range want {
			if v, ok := promSum(body, m.name, m.labels...); !ok || v != m.value {
				return false, nil
			}
		}
		return true, nil
	})
	for _, m := range want {
		v, ok := promSum(body, m.name, m.labels...)
		t.Logf("GET /metrics: %s{%s} = %v (found %v; want %v)", m.name, strings.Join(m.labels, ","), v, ok, m.value)
	}
	if err != nil {
		t.Fatalf("%v; the last answer:\n%s", err, body)
	}
	stopAll(t, w)

	// Stdout: one JSON span a line. One process span per delivery; one
	// send span per event, continuing the trace of the process span whose
	// transaction enqueued it.
	type jsonSpan struct {
		Name        string
		SpanContext struct{ TraceID, SpanID string }
		Parent      struct{ TraceID, SpanID string }
		Resource    []struct {
			Key   string
			Value struct{ Value any }
		}
	}
	processSpans := map[string]bool{} // span id
	var process, send int
	var sends []jsonSpan
	var resource map[string]any
	for _, line := range w.stdoutLines() {
		var s jsonSpan
		if err := json.Unmarshal([]byte(line), &s); err != nil {
			t.Fatalf("stdout line is not a JSON span: %v\n%s", err, line)
		}
		switch s.Name {
		case "process " + e.topic:
			process++
			processSpans[s.SpanContext.SpanID] = true
		case "send " + e.events:
			send++
			sends = append(sends, s)
		}
		if resource == nil {
			resource = map[string]any{}
			for _, kv := range s.Resource {
				resource[kv.Key] = kv.Value.Value
			}
		}
	}
	t.Logf("stdout: %d spans named %q, %d named %q", process, "process "+e.topic, send, "send "+e.events)
	if process != records || send != len(batch.Orders) {
		t.Errorf("%d process spans and %d send spans on stdout; want %d and %d", process, send, records, len(batch.Orders))
	}
	for _, s := range sends {
		if !processSpans[s.Parent.SpanID] {
			t.Errorf("send span %s: parent %s/%s is no process span on stdout", s.SpanContext.SpanID, s.Parent.TraceID, s.Parent.SpanID)
			break
		}
	}
	if resource["service.name"] != "orderworker" || resource["service.instance.id"] != "telemetry-1" {
		t.Errorf("span resource %v; want service.name orderworker, service.instance.id telemetry-1", resource)
	}

	// OTLP: the collector got spans and metrics (protobuf, whose strings
	// are stored as they are).
	for _, c := range []struct{ path, want string }{
		{"/v1/traces", "process " + e.topic},
		{"/v1/traces", "send " + e.events},
		{"/v1/traces", "orderworker"},
		{"/v1/metrics", "messaging.client.consumed.messages"},
		{"/v1/metrics", "oncely.outbox.pending"},
	} {
		if !col.received(c.path, c.want) {
			t.Errorf("the OTLP collector got no %s request containing %q (requests: %v)", c.path, c.want, col.paths())
		}
	}
}

// fakeCollector is an OTLP/HTTP endpoint that keeps what it is sent.
type fakeCollector struct {
	*httptest.Server
	mu     sync.Mutex
	bodies map[string][][]byte // path -> request bodies
}

func newFakeCollector(t *testing.T) *fakeCollector {
	c := &fakeCollector{bodies: map[string][][]byte{}}
	c.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body io.Reader = r.Body
		if r.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			body = zr
		}
		b, err := io.ReadAll(body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		c.mu.Lock()
		c.bodies[r.URL.Path] = append(c.bodies[r.URL.Path], b)
		c.mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK) // an empty Export*ServiceResponse
	}))
	t.Cleanup(c.Close)
	return c
}

func (c *fakeCollector) received(path, s string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, b := range c.bodies[path] {
		if bytes.Contains(b, []byte(s)) {
			return true
		}
	}
	return false
}

func (c *fakeCollector) paths() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := map[string]int{}
	for p, bs := range c.bodies {
		m[p] = len(bs)
	}
	return m
}

func get(ctx context.Context, url string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(b), err
}

// promSum sums the samples of the metric name, in the Prometheus text
// format, whose labels include all of labels (each `key="value"`), and
// reports whether there was one.
func promSum(body, name string, labels ...string) (float64, bool) {
	var sum float64
	found := false
	for _, line := range strings.Split(body, "\n") {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || (rest == "" || (rest[0] != '{' && rest[0] != ' ')) {
			continue
		}
		var set string
		if rest[0] == '{' {
			end := strings.LastIndexByte(rest, '}')
			if end < 0 {
				continue
			}
			set, rest = rest[1:end], rest[end+1:]
		}
		match := true
		for _, l := range labels {
			match = match && strings.Contains(","+set+",", ","+l+",")
		}
		fields := strings.Fields(rest)
		if !match || len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			continue
		}
		sum += v
		found = true
	}
	return sum, found
}

// TestKafkaOverTLSAndSCRAM: the worker, given --tls-ca and the --sasl-*
// flags (the password in KAFKA_SASL_PASSWORD), consumes from a kfake cluster
// that takes only TLS with SASL SCRAM-SHA-512, and its relay publishes the
// order's event there.
func TestKafkaOverTLSAndSCRAM(t *testing.T) {
	t.Parallel()
	k := testenv.NewSecureKafka(t, kfake.GroupMinSessionTimeout(time.Second))
	e := newEnvOn(t, k.Kafka, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	w := e.startWithEnv("secure", []string{"KAFKA_SASL_PASSWORD=" + k.Passwords[testenv.SCRAM512User]},
		"--tls-ca", k.CAFile, "--sasl-mechanism", "scram-sha-512", "--sasl-user", testenv.SCRAM512User)
	one := generate(orderSpec{Count: 1, Customers: 1}, newRand())
	if err := produce(ctx, e.cl, e.topic, one.Deliveries, 0); err != nil {
		t.Fatal(err)
	}
	e.waitEffects(ctx, 1, time.Minute, w)
	e.waitPublished(ctx, time.Minute, w)
	stopAll(t, w)
}
