//go:build linux

package integration_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/integration_test/internal/chaos"
	"github.com/oncely/oncely/internal/testenv"
)

// The chaos soak's knobs, from the environment (make test-soak sets the
// first).
const (
	soakEnv         = "ONCELY_SOAK"          // 1: run TestSoak
	soakDurationEnv = "ONCELY_SOAK_DURATION" // how long the chaos lasts; default 60s
	soakSeedEnv     = "ONCELY_SOAK_SEED"     // replays a run's schedule; default random
	soakLogsEnv     = "ONCELY_SOAK_LOGS"     // a directory to keep the processes' logs in
)

// The soak's shape.
const (
	soakWorkers        = 3
	soakRate           = 100  // records a second while the producer runs
	soakPoisonRate     = 0.02 // poison records, as a fraction of the orders
	soakDupRate        = 0.15 // records delivered twice
	soakSessionTimeout = "3s"
	// A rebalance timeout under 10s/(workers-1), because of a bug in the
	// pinned kfake: after a static member is replaced while its old
	// incarnation waits in SyncGroup, the broker undercounts the members
	// that rejoined, so the rebalance completes only when its timer fires,
	// and every JoinGroup restarts that timer. Members whose JoinGroup
	// times out (after the rebalance timeout plus franz-go's 10s of
	// overhead) send it again; if their retries never leave a gap as long
	// as the rebalance timeout, the timer never fires and the group is
	// stuck for good (seen in 10-minute runs with the default 30s: three
	// members retrying every 40s, gaps of at most 28s). Three members
	// retrying every 14s leave a gap of at least 4.7s, longer than 4s.
	soakRebalanceTimeout = "4s"
	soakStopGrace        = 10 * time.Second // SIGTERM to exit: what orchestrators grant, and the worker promises
)

// soakModes are the consumer modes the worker slots run: batches of 100
// with the set-based batch handler (the example's default), batches of 100
// with the per-record handler, a transaction per record, and 8 keys of a
// partition at once. Slot i's n-th start runs mode i+n, so every mode runs
// and partitions move between modes mid-stream.
var soakModes = [][]string{{}, {"--handler", "record"}, {"--batch-size", "1"}, {"--key-parallelism", "8"}}

// The fault kinds the driver injects; every one must be met during a run.
const (
	faultCommitDropped  = "OffsetCommit requests dropped"
	faultFetchDropped   = "Fetch requests dropped"
	faultProduceDropped = "Produce requests dropped (events, DLQ)"
	faultDelayed        = "requests delayed"
	faultCoordinator    = "group coordinator moves"
	faultLeader         = "partition leader moves"
	faultTerminated     = "pg_terminate_backend calls"
	faultStalled        = "proxy stalls"
	faultCut            = "proxy cuts"
)

// How many database sessions and connections those faults ended.
const (
	sessionsTerminated = "sessions terminated"
	connectionsCut     = "connections cut"
)

var soakFaultKinds = []string{faultCommitDropped, faultFetchDropped, faultProduceDropped, faultDelayed,
	faultCoordinator, faultLeader, faultTerminated, faultStalled, faultCut}

// Requests the driver delays: the record path, group membership and the
// lookups clients fall back on after a fault.
var soakDelayedKeys = []kmsg.Key{kmsg.Fetch, kmsg.Produce, kmsg.OffsetCommit, kmsg.Heartbeat,
	kmsg.JoinGroup, kmsg.SyncGroup, kmsg.Metadata, kmsg.FindCoordinator}

// TestSoak is the chaos soak: real orderworker processes consume orders
// (duplicate deliveries and poison records mixed in) from an in-process
// kfake cluster of three brokers, through a TCP proxy to Postgres, while a
// driver kills them with SIGKILL and restarts them, stops others with
// SIGTERM, drops and delays broker requests, moves group coordinators and
// partition leaders, terminates the workers' database sessions, and stalls
// and cuts their connections. An injector adds the poison that must not
// stop a partition or the outbox (soakInjectKinds): message ids Postgres
// cannot store, records just under the topic's size limit, aborted and
// committed Kafka transactions, orders whose event the broker refuses.
// Then it checks the whole history with `orderworker check`: every valid
// order applied exactly once, balances equal to the sums, every poison
// record in the dead-letter topic with its class (a stub where the copy is
// too large) and no valid order, nothing of an aborted transaction applied,
// one event per order under one stable message id or, for an event too
// large, a parked outbox row, each customer's events in order. It prints
// its figures and fails on any violation, naming the seed that replays its
// schedule.
//
// It runs only with ONCELY_SOAK=1 (make test-soak).
func TestSoak(t *testing.T) {
	if os.Getenv(soakEnv) != "1" {
		t.Skipf("the chaos soak runs with %s=1: `make test-soak` (60s of chaos), or "+
			"`make test-soak %s=10m` for a long run; %s=N replays a run's schedule", soakEnv, soakDurationEnv, soakSeedEnv)
	}
	duration, seed := soakSettings(t)
	s := newSoak(t, duration, seed)
	t.Logf("soak: seed %d, %s of chaos, %d workers, %d records/s", seed, duration, soakWorkers, soakRate)
	t.Cleanup(func() {
		if t.Failed() {
			s.dumpGoroutines()
			s.dumpLogs()
			t.Logf("soak: FAILED; replay the schedule with %s=1 %s=%d %s=%s make test-soak",
				soakEnv, soakSeedEnv, seed, soakDurationEnv, duration)
		}
	})

	chaosCtx, stopChaos := context.WithTimeout(context.Background(), duration)
	defer stopChaos()
	var loops sync.WaitGroup
	for _, w := range s.workers {
		loops.Go(func() { s.supervise(chaosCtx, w) })
	}
	producer := s.startProducer()
	injected := s.startInjector(chaosCtx)
	loops.Go(func() { s.processChaos(chaosCtx) })
	loops.Go(func() { s.infraChaos(chaosCtx) })
	loops.Wait()
	injected.wait(s)
	s.appliedInChaos = s.countOrders()

	// Calm: no more faults; every worker up; the producer done; then the
	// history, once the workers caught up.
	calm := time.Now()
	s.kfaults.Off()
	s.proxy.Resume()
	for _, w := range s.workers {
		if w.current() == nil {
			s.start(w)
		}
	}
	produced := s.waitProducer(producer)
	rep, checkErr := s.check()
	s.settled = time.Since(calm)
	var stops sync.WaitGroup
	for _, w := range s.workers {
		stops.Go(func() { s.stop(w, "at the end") })
	}
	stops.Wait()
	if checkErr != nil {
		t.Fatalf("soak: the check did not run: %v", checkErr)
	}
	s.crossCheck(produced, injected, rep)
	s.report(rep, injected)
}

func soakSettings(t *testing.T) (time.Duration, uint64) {
	t.Helper()
	duration := 60 * time.Second
	if v := os.Getenv(soakDurationEnv); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 10*time.Second {
			t.Fatalf("%s=%q: want a Go duration of at least 10s", soakDurationEnv, v)
		}
		duration = d
	}
	seed := rand.Uint64N(1<<53) + 1 // printable exactly, never 0 (the producer's "random")
	if v := os.Getenv(soakSeedEnv); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || n == 0 {
			t.Fatalf("%s=%q: want a positive integer", soakSeedEnv, v)
		}
		seed = n
	}
	if dl, ok := t.Deadline(); ok && time.Until(dl) < duration+6*time.Minute {
		t.Fatalf("go test -timeout leaves %s; the soak needs its %s of chaos plus up to 6m to settle and check",
			time.Until(dl).Round(time.Second), duration)
	}
	return duration, seed
}

// soak is one run: the services, the processes and the figures.
type soak struct {
	t        *testing.T
	duration time.Duration
	seed     uint64
	bin      string // the orderworker binary
	logDir   string
	journal  *os.File // what the driver did, and when
	db       *testenv.DB
	cluster  *kfake.Cluster
	brokers  string
	topics   []soakTopicInfo
	group    string
	proxy    *chaos.Proxy
	kfaults  *chaos.KafkaFaults
	workers  []*soakWorker

	appliedInChaos int64         // orders with effects when the chaos ended
	settled        time.Duration // from the end of the chaos to a passing wait for the check

	mu            sync.Mutex
	kills         int            // SIGKILLs
	stops         int            // SIGTERMs during the chaos
	startFailures int            // workers that failed while starting up (and were restarted)
	longestStop   time.Duration  // from SIGTERM to exit
	faults        map[string]int // by kind; request faults are counted by kfaults
	violations    []string
}

const (
	soakTopic  = "orders"
	soakEvents = "order-events"
)

type soakTopicInfo struct {
	name       string
	partitions int32
}

func newSoak(t *testing.T, duration time.Duration, seed uint64) *soak {
	t.Helper()
	s := &soak{t: t, duration: duration, seed: seed, faults: make(map[string]int), logDir: os.Getenv(soakLogsEnv)}
	if s.logDir == "" {
		s.logDir = t.TempDir()
	} else if err := os.MkdirAll(s.logDir, 0o755); err != nil {
		t.Fatal(err)
	}
	journal, err := os.Create(filepath.Join(s.logDir, "driver.log"))
	if err != nil {
		t.Fatal(err)
	}
	s.journal = journal
	t.Cleanup(func() { _ = journal.Close() })
	s.bin = filepath.Join(t.TempDir(), "orderworker")
	build := exec.CommandContext(t.Context(), "go", "build", "-o", s.bin, "github.com/oncely/oncely/examples/orderworker")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build orderworker: %v\n%s", err, out)
	}

	s.db = testenv.Postgres(t)
	k := testenv.NewKafka(t, kfake.NumBrokers(3), kfake.GroupMinSessionTimeout(time.Second))
	if k.Cluster == nil {
		t.Skip("the soak injects broker faults into an in-process kfake cluster; unset KAFKA_BROKERS and ONCELY_TEST_CONTAINERS")
	}
	s.cluster, s.brokers = k.Cluster, strings.Join(k.Brokers, ",")
	s.group = testenv.UniqueName("soak")
	s.topics = []soakTopicInfo{{soakTopic, 6}, {soakEvents, 6}, {dlq.DefaultTopic(soakTopic), 2}}
	ids := make(map[string][16]byte)
	for _, tp := range s.topics {
		ids[tp.name] = k.CreateTopicNamed(t, tp.name, tp.partitions)
	}
	s.limitTopics(k.Client(t))
	// Produce faults meet the workers' relays and dead-letter writes, not
	// the producer of the orders.
	faultTopics := map[string][16]byte{soakEvents: ids[soakEvents], dlq.DefaultTopic(soakTopic): ids[dlq.DefaultTopic(soakTopic)]}
	s.kfaults = chaos.NewKafkaFaults(s.cluster, []kmsg.Key{kmsg.OffsetCommit, kmsg.Fetch, kmsg.Produce,
		kmsg.Heartbeat, kmsg.JoinGroup, kmsg.SyncGroup, kmsg.Metadata, kmsg.FindCoordinator}, faultTopics)

	u, err := url.Parse(s.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	if s.proxy, err = chaos.NewProxy(u.Host); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.proxy.Close() })
	u.Host = s.proxy.Addr()
	q := u.Query()
	q.Set("connect_timeout", "5")
	for i := range soakWorkers {
		w := &soakWorker{name: fmt.Sprintf("worker-%d", i), app: testenv.UniqueName("soak_w")}
		q.Set("application_name", w.app) // how the driver finds its database sessions
		u.RawQuery = q.Encode()
		w.env = []string{"DATABASE_URL=" + u.String()}
		w.args = []string{"run", "--brokers", s.brokers, "--topic", soakTopic, "--events-topic", soakEvents,
			"--group", s.group, "--schema", s.db.Schema, "--http-addr", "127.0.0.1:0",
			"--instance-id", w.name, "--session-timeout", soakSessionTimeout, "--rebalance-timeout", soakRebalanceTimeout}
		w.slot = i
		if w.log, err = os.OpenFile(filepath.Join(s.logDir, w.name+".log"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC|os.O_APPEND, 0o644); err != nil {
			t.Fatal(err)
		}
		s.workers = append(s.workers, w)
	}
	t.Cleanup(func() {
		for _, w := range s.workers {
			w.kill() // none outlives the test
			_ = w.log.Close()
		}
	})
	return s
}

// soakWorker is one worker slot: a static member id whose process the
// driver kills and stops, and restarts as an orchestrator would.
type soakWorker struct {
	name, app string // instance id; application_name of its database sessions
	args, env []string
	slot      int // which of soakModes its first start runs
	log       *os.File

	mu     sync.Mutex
	proc   *soakProc // the latest process
	starts int
}

// soakProc is one process of a slot.
type soakProc struct {
	cmd      *exec.Cmd
	done     chan struct{} // closed once it exited
	logFrom  int64         // where its output starts in the slot's log
	expected atomic.Bool   // the driver signalled it
	draining atomic.Bool   // the driver sent it SIGTERM (a second one would kill it)
	killed   atomic.Bool   // the driver sent it SIGKILL (perhaps while it drained)
}

// current returns w's process if it is running.
func (w *soakWorker) current() *soakProc {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.proc == nil {
		return nil
	}
	select {
	case <-w.proc.done:
		return nil
	default:
		return w.proc
	}
}

// start runs a new process in w's slot; nil (and the test failed) if it
// could not.
func (s *soak) start(w *soakWorker) *soakProc {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.starts++
	p := &soakProc{done: make(chan struct{})}
	if fi, err := w.log.Stat(); err == nil {
		p.logFrom = fi.Size()
	}
	var err error
	mode := soakModes[(w.slot+w.starts-1)%len(soakModes)]
	args := append(slices.Clip(w.args), mode...)
	if p.cmd, err = s.spawn(w.log, fmt.Sprintf("%s start %d %v", w.name, w.starts, mode), w.env, args...); err != nil {
		s.t.Error(err)
		return nil
	}
	w.proc = p
	go func() {
		_ = p.cmd.Wait()
		close(p.done)
		if !p.expected.Load() {
			s.judgeExit(w, p, fmt.Sprintf("exited by itself (%s)", p.cmd.ProcessState))
		}
	}()
	return p
}

// judgeExit sorts out a worker exit the driver did not ask for, or a
// non-zero exit status after SIGTERM. A worker that fails while starting up
// (its migrations meet a database fault, or SIGTERM comes before its
// handler is installed) is restarted like any other, as an orchestrator
// would, and counted; one that fails after its consumer started is a
// violation.
func (s *soak) judgeExit(w *soakWorker, p *soakProc, what string) {
	out, _ := os.ReadFile(w.log.Name())
	out = out[min(p.logFrom, int64(len(out))):]
	// Up to its successor's output, which the supervisor may have started.
	if i := bytes.Index(out, []byte("\n--- soak: "+w.name+" start ")); i >= 0 {
		out = out[:i+1]
	}
	if !bytes.Contains(out, []byte(`msg="oncely consumer started"`)) {
		s.mu.Lock()
		s.startFailures++
		s.mu.Unlock()
		return
	}
	last := ""
	for line := range strings.Lines(string(out)) {
		if strings.Contains(line, "level=ERROR") {
			last = strings.TrimSpace(line)
		}
	}
	s.violation("%s %s after its consumer started; its last error: %s", w.name, what, last)
}

// spawn starts the orderworker binary with args, its output appended to
// log after a marker line. The process gets SIGKILL when the test ends, or
// if the test process dies first.
func (s *soak) spawn(log *os.File, what string, env []string, args ...string) (*exec.Cmd, error) {
	_, _ = fmt.Fprintf(log, "--- soak: %s: %s\n", what, strings.Join(args, " "))
	cmd := exec.CommandContext(s.t.Context(), s.bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", what, err)
	}
	return cmd, nil
}

// signal sends sig to w's running process, marking its exit as expected,
// and returns it; nil if none is running.
func (w *soakWorker) signal(sig os.Signal) *soakProc {
	p := w.current()
	if p == nil {
		return nil
	}
	p.expected.Store(true)
	switch sig {
	case syscall.SIGTERM:
		p.draining.Store(true)
	case syscall.SIGKILL:
		p.killed.Store(true)
	}
	_, _ = fmt.Fprintf(w.log, "--- soak: %s: %s\n", w.name, sig)
	_ = p.cmd.Process.Signal(sig)
	return p
}

// kill sends SIGKILL and waits for the exit; false if nothing ran.
func (w *soakWorker) kill() bool {
	p := w.signal(syscall.SIGKILL)
	if p != nil {
		<-p.done
	}
	return p != nil
}

// stop sends SIGTERM to w's process and waits up to soakStopGrace for it
// to exit 0 (or to be killed by the chaos meanwhile); past it, it kills the
// process and reports a violation.
func (s *soak) stop(w *soakWorker, when string) {
	p := w.signal(syscall.SIGTERM)
	if p == nil {
		s.violation("%s was not running %s", w.name, when)
		return
	}
	start := time.Now()
	t := time.NewTimer(soakStopGrace)
	defer t.Stop()
	select {
	case <-p.done:
		took := time.Since(start)
		s.mu.Lock()
		s.longestStop = max(s.longestStop, took)
		s.mu.Unlock()
		if p.cmd.ProcessState.ExitCode() != 0 && !p.killed.Load() {
			s.judgeExit(w, p, fmt.Sprintf("ended with %q %s, %s after SIGTERM", p.cmd.ProcessState, when, took.Round(time.Millisecond)))
		}
	case <-t.C:
		_ = p.cmd.Process.Signal(syscall.SIGQUIT) // a goroutine dump in its log
		w.kill()
		s.violation("%s did not exit within %s of SIGTERM %s; killed it", w.name, soakStopGrace, when)
	}
}

// supervise keeps a process running in w's slot until ctx is done,
// restarting it at once whenever it exits.
func (s *soak) supervise(ctx context.Context, w *soakWorker) {
	for {
		p := s.start(w)
		if p == nil {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-p.done:
		}
	}
}

// processChaos kills a random worker with SIGKILL every 0.6 to 2 s; one
// time in five it stops the worker with SIGTERM instead. Each worker's
// supervisor restarts it.
func (s *soak) processChaos(ctx context.Context) {
	rng := rand.New(rand.NewPCG(s.seed, 1))
	var stops sync.WaitGroup
	defer stops.Wait()
	for wait(ctx, between(rng, 600*time.Millisecond, 2*time.Second)) {
		w := s.workers[rng.IntN(len(s.workers))]
		if rng.IntN(5) > 0 {
			if w.kill() {
				s.count(&s.kills)
				s.note("SIGKILL %s", w.name)
			}
			continue
		}
		// One SIGTERM per process, as an orchestrator sends: the worker
		// takes a second one as "stop now" and dies of it.
		if p := w.current(); p != nil && !p.draining.Load() {
			s.count(&s.stops)
			s.note("SIGTERM %s", w.name)
			stops.Go(func() { s.stop(w, "during the chaos") })
		}
	}
}

// infraChaos injects a broker or database fault every 0.2 to 1 s: every
// kind once, in a random order, then kinds at random.
func (s *soak) infraChaos(ctx context.Context) {
	rng := rand.New(rand.NewPCG(s.seed, 2))
	kinds := slices.Clone(soakFaultKinds)
	rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
	for n := 0; wait(ctx, between(rng, 200*time.Millisecond, time.Second)); n++ {
		kind := soakFaultKinds[rng.IntN(len(soakFaultKinds))]
		if n < len(kinds) {
			kind = kinds[n]
		}
		detail := ""
		switch kind {
		case faultCommitDropped:
			n := 1 + rng.IntN(3)
			s.kfaults.Drop(kmsg.OffsetCommit, n)
			detail = fmt.Sprint("the next ", n)
		case faultFetchDropped:
			n := 1 + rng.IntN(3)
			s.kfaults.Drop(kmsg.Fetch, n)
			detail = fmt.Sprint("the next ", n)
		case faultProduceDropped:
			n := 1 + rng.IntN(2)
			s.kfaults.Drop(kmsg.Produce, n)
			detail = fmt.Sprint("the next ", n)
		case faultDelayed:
			key := soakDelayedKeys[rng.IntN(len(soakDelayedKeys))]
			d := between(rng, 50*time.Millisecond, 1500*time.Millisecond)
			s.kfaults.Delay(key, d)
			detail = fmt.Sprintf("the next %s by %s", key.Name(), d.Round(time.Millisecond))
		case faultCoordinator:
			s.cluster.RehashCoordinators()
			s.countFault(kind, 1)
		case faultLeader:
			tp := s.topics[rng.IntN(len(s.topics))]
			p, node := rng.Int32N(tp.partitions), rng.Int32N(3)
			if err := s.cluster.MoveTopicPartition(tp.name, p, node); err != nil {
				s.t.Errorf("move a partition leader of %s: %v", tp.name, err)
			}
			s.countFault(kind, 1)
			detail = fmt.Sprintf("%s/%d to broker %d", tp.name, p, node)
		case faultTerminated:
			w := s.workers[rng.IntN(len(s.workers))]
			var n int
			if err := s.db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
				FROM pg_stat_activity WHERE application_name = $1`, w.app).Scan(&n); err != nil && ctx.Err() == nil {
				s.t.Errorf("terminate the backends of %s: %v", w.name, err)
			}
			s.countFault(kind, min(n, 1))
			s.countFault(sessionsTerminated, n)
			detail = fmt.Sprintf("%s: %d sessions", w.name, n)
		case faultStalled:
			d := between(rng, 200*time.Millisecond, 2*time.Second)
			s.proxy.Stall(d)
			s.countFault(kind, 1)
			detail = fmt.Sprint("for ", d.Round(time.Millisecond))
		case faultCut:
			n := s.proxy.Cut()
			s.countFault(kind, min(n, 1))
			s.countFault(connectionsCut, n)
			detail = fmt.Sprint(n, " connections")
		}
		s.note("%s %s", kind, detail)
	}
}

// between returns a random duration in [lo, hi).
func between(rng *rand.Rand, lo, hi time.Duration) time.Duration {
	return lo + time.Duration(rng.Int64N(int64(hi-lo)))
}

// wait waits d; false if ctx ended first.
func wait(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func (s *soak) count(n *int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	*n++
}

func (s *soak) countFault(kind string, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults[kind] += n
}

// note writes a line to the driver's journal.
func (s *soak) note(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, _ = fmt.Fprintf(s.journal, "%s %s\n", time.Now().UTC().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

func (s *soak) violation(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.violations = append(s.violations, fmt.Sprintf(format, args...))
}

// countOrders returns the orders with effects so far.
func (s *soak) countOrders() int64 {
	var n int64
	if err := s.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+
		pgx.Identifier{s.db.Schema, "orders"}.Sanitize()).Scan(&n); err != nil {
		s.t.Errorf("count the orders: %v", err)
	}
	return n
}

// soakProduced is the producer's summary line.
type soakProduced struct{ records, orders, poison, duplicates int }

var producedRE = regexp.MustCompile(`^produced (\d+) records to \S+: (\d+) orders \(total \d+ cents\), (\d+) poison records and (\d+) duplicate deliveries`)

// startProducer runs `orderworker produce` for 85% of the chaos, so that
// the workers also recover from the last faults with a backlog.
func (s *soak) startProducer() *soakProducer {
	s.t.Helper()
	count := int(float64(soakRate) * s.duration.Seconds() * 0.85)
	log, err := os.Create(filepath.Join(s.logDir, "producer.log"))
	if err != nil {
		s.t.Fatal(err)
	}
	cmd, err := s.spawn(log, "producer", nil, "produce", "--brokers", s.brokers, "--topic", soakTopic,
		"--count", strconv.Itoa(count), "--rate", strconv.Itoa(soakRate), "--customers", "40",
		"--dup-rate", fmt.Sprint(soakDupRate), "--poison-rate", fmt.Sprint(soakPoisonRate),
		"--seed", strconv.FormatUint(s.seed, 10))
	if err != nil {
		s.t.Fatal(err)
	}
	p := &soakProducer{done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	s.t.Cleanup(func() {
		_ = cmd.Process.Kill() // a no-op once it exited
		<-p.done
		_ = log.Close()
	})
	return p
}

type soakProducer struct {
	done chan struct{} // closed once it exited
	err  error         // its exit error, once done
}

// waitProducer waits for the producer's exit and returns its summary.
func (s *soak) waitProducer(p *soakProducer) soakProduced {
	s.t.Helper()
	select {
	case <-p.done:
		if p.err != nil {
			s.t.Fatalf("producer: %v", p.err)
		}
	case <-time.After(2 * time.Minute):
		s.t.Fatal("the producer did not finish within 2m of the chaos")
	}
	out, _ := os.ReadFile(filepath.Join(s.logDir, "producer.log"))
	for line := range strings.Lines(string(out)) {
		if m := producedRE.FindStringSubmatch(line); m != nil {
			n := func(i int) int { v, _ := strconv.Atoi(m[i]); return v }
			return soakProduced{records: n(1), orders: n(2), poison: n(3), duplicates: n(4)}
		}
	}
	s.t.Fatalf("no summary line in the producer's output:\n%s", out)
	return soakProduced{}
}

// soakReport is what the soak reads of `orderworker check --json`.
type soakReport struct {
	Delivered        int      `json:"delivered"`
	DuplicatesSent   int      `json:"duplicates_sent"`
	UniqueOrders     int      `json:"unique_orders"`
	PoisonRecords    int      `json:"poison_records"`
	Effects          int64    `json:"effects"`
	InboxRows        int64    `json:"inbox_rows"`
	Customers        int      `json:"customers"`
	EventRecords     int      `json:"event_records"`
	EventIDs         int      `json:"event_ids"`
	Republished      int      `json:"republished"`
	EventsParked     int      `json:"events_parked"`
	DeadLettered     int      `json:"dead_lettered"`
	DeadLetterCopies int      `json:"dead_letter_copies"`
	DeadLetterStubs  int      `json:"dead_letter_stubs"`
	Transactional    int      `json:"transactional"`
	AbortedRecords   int      `json:"aborted_records"`
	UnstorableIDs    int      `json:"unstorable_ids"`
	NearLimitOrders  int      `json:"near_limit_orders"`
	NearLimitPoison  int      `json:"near_limit_poison"`
	Violations       []string `json:"violations"`
}

// check runs `orderworker check`, straight to Postgres, once the group
// caught up with the orders topic and the outbox is empty.
func (s *soak) check() (*soakReport, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(s.t.Context(), s.bin, "check", "--json", "--wait", "3m", "--brokers", s.brokers,
		"--topic", soakTopic, "--events-topic", soakEvents, "--group", s.group, "--schema", s.db.Schema)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+s.db.URL)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if stdout.Len() == 0 {
		if err == nil {
			err = errors.New("exit status 0")
		}
		return nil, fmt.Errorf("check printed no report: %w; its stderr: %s", err, stderr.String())
	}
	var rep soakReport
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		return nil, fmt.Errorf("check --json printed %q: %w", stdout.String(), err)
	}
	for _, v := range rep.Violations {
		s.violation("%s", v)
	}
	return &rep, nil
}

// crossCheck compares what the producer and the injector say they sent
// with what the check read back from the orders topic and took for orders
// and poison records of each kind, and with what it found dead-lettered as
// stubs and parked.
func (s *soak) crossCheck(p soakProduced, in *soakInjected, rep *soakReport) {
	for _, c := range []struct {
		what           string
		produced, read int
	}{
		{"records", p.records + in.records, rep.Delivered}, {"orders", p.orders + in.orders, rep.UniqueOrders},
		{"poison records", p.poison + in.poison, rep.PoisonRecords}, {"duplicate deliveries", p.duplicates, rep.DuplicatesSent},
		{"records of committed transactions", in.transactional, rep.Transactional},
		{"records of aborted transactions", in.aborted, rep.AbortedRecords},
		{"message ids Postgres cannot store", in.unstorable, rep.UnstorableIDs},
		{"orders near the size limit", in.nearOrders, rep.NearLimitOrders},
		{"poison records near the size limit", in.nearPoison, rep.NearLimitPoison},
		{"dead letters written as stubs (poison records near the size limit)", in.nearPoison, rep.DeadLetterStubs},
		{"events parked (orders whose event is over the limit)", in.bigEvents, rep.EventsParked},
	} {
		if c.produced != c.read {
			s.violation("%s: the producer sent %d, the check read %d", c.what, c.produced, c.read)
		}
	}
}

// report prints the figures and fails the test on a violation, or if the
// run did not exercise what it must.
func (s *soak) report(rep *soakReport, in *soakInjected) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.t
	f := s.kfaults
	s.faults[faultCommitDropped] = f.Dropped(kmsg.OffsetCommit)
	s.faults[faultFetchDropped] = f.Dropped(kmsg.Fetch)
	s.faults[faultProduceDropped] = f.Dropped(kmsg.Produce)
	for _, k := range soakDelayedKeys {
		s.faults[faultDelayed] += f.Delayed(k)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "soak figures (seed %d, %s of chaos):\n", s.seed, s.duration)
	fmt.Fprintf(&b, "  records produced            %d (%d orders, %d poison records, %d duplicate deliveries)\n",
		rep.Delivered, rep.UniqueOrders, rep.PoisonRecords, rep.DuplicatesSent)
	fmt.Fprintf(&b, "  workers killed (SIGKILL)    %d\n", s.kills)
	fmt.Fprintf(&b, "  workers stopped (SIGTERM)   %d (+ %d at the end; the longest stop took %s)\n",
		s.stops, len(s.workers), s.longestStop.Round(time.Millisecond))
	fmt.Fprintf(&b, "  workers failed starting up  %d (a database fault met their migrations, or SIGTERM came first; restarted)\n", s.startFailures)
	for _, k := range soakFaultKinds {
		switch k {
		case faultTerminated:
			fmt.Fprintf(&b, "  %-39s %d (%d %s)\n", k, s.faults[k], s.faults[sessionsTerminated], sessionsTerminated)
		case faultCut:
			fmt.Fprintf(&b, "  %-39s %d (%d %s)\n", k, s.faults[k], s.faults[connectionsCut], connectionsCut)
		default:
			fmt.Fprintf(&b, "  %-39s %d\n", k, s.faults[k])
		}
	}
	fmt.Fprintf(&b, "  effects                     %d (%d of them during the chaos; inbox rows %d; %d customers' balances checked)\n",
		rep.Effects, s.appliedInChaos, rep.InboxRows, rep.Customers)
	fmt.Fprintf(&b, "  caught up and checked       %s after the chaos\n", s.settled.Round(time.Millisecond))
	fmt.Fprintf(&b, "  order.accepted events       %d (%d message ids + %d republished)\n",
		rep.EventRecords, rep.EventIDs, rep.Republished)
	fmt.Fprintf(&b, "  dead-lettered               %d (+ %d copies; %d stubs)\n", rep.DeadLettered, rep.DeadLetterCopies, rep.DeadLetterStubs)
	fmt.Fprintf(&b, "  events parked               %d\n", rep.EventsParked)
	fmt.Fprintf(&b, "  poison injected             %d records read committed (+ %d aborted); rounds by kind:\n", in.records, in.aborted)
	for _, k := range soakInjectKinds {
		fmt.Fprintf(&b, "    %-80s %d\n", k, in.rounds[k])
	}
	fmt.Fprintf(&b, "  violations found            %d\n", len(s.violations))
	for _, v := range s.violations {
		fmt.Fprintf(&b, "    %s\n", v)
	}
	t.Log(b.String())

	if len(s.violations) > 0 {
		t.Errorf("soak: %d violations", len(s.violations))
	}
	if s.appliedInChaos < int64(rep.UniqueOrders)/2 {
		t.Errorf("soak: only %d of %d orders were applied while the chaos ran: the workers stalled", s.appliedInChaos, rep.UniqueOrders)
	}
	if want := soakMinKills(s.duration); s.kills < want {
		t.Errorf("soak: %d kills; a run of %s must have at least %d", s.kills, s.duration, want)
	}
	for _, k := range soakFaultKinds {
		if s.faults[k] == 0 {
			t.Errorf("soak: no %s: that fault kind was never exercised", k)
		}
	}
	for _, k := range soakInjectKinds {
		if in.rounds[k] == 0 {
			t.Errorf("soak: no %s injected: that poison kind was never exercised", k)
		}
	}
}

// soakMinKills is what a run of d must reach: one kill every 3 s, 20 in a
// minute.
func soakMinKills(d time.Duration) int { return int(d / (3 * time.Second)) }

// dumpGoroutines writes the test process's goroutines (the brokers', the
// proxy's) to the log directory: where a wedged broker is stuck.
func (s *soak) dumpGoroutines() {
	f, err := os.Create(filepath.Join(s.logDir, "goroutines.txt"))
	if err != nil {
		return
	}
	defer f.Close()
	_ = pprof.Lookup("goroutine").WriteTo(f, 2)
}

// dumpLogs prints the end of each process's log and of the driver's
// journal.
func (s *soak) dumpLogs() {
	entries, _ := os.ReadDir(s.logDir)
	for _, e := range entries {
		if e.Name() == "goroutines.txt" {
			s.t.Logf("--- the test process's goroutines: %s", filepath.Join(s.logDir, e.Name()))
			continue
		}
		b, _ := os.ReadFile(filepath.Join(s.logDir, e.Name()))
		s.t.Logf("--- %s (last 60 lines; all in %s):\n%s", e.Name(), s.logDir, tailLines(string(b), 60))
	}
}

func tailLines(s string, n int) string {
	lines := strings.Split(s, "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
