//go:build linux

package integration_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
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

	"github.com/oncely/oncely/internal/testenv"
)

// The chaos soaks' knobs, from the environment (make test-soak sets the
// first).
const (
	soakEnv         = "ONCELY_SOAK"          // 1: run TestSoak, TestSoakJetStream and TestSoakRabbitMQ
	soakDurationEnv = "ONCELY_SOAK_DURATION" // how long the chaos lasts; default 60s
	soakSeedEnv     = "ONCELY_SOAK_SEED"     // replays a run's schedule; default random
	soakLogsEnv     = "ONCELY_SOAK_LOGS"     // a directory to keep the processes' logs in
)

// The shape every soak shares.
const (
	soakWorkers    = 3
	soakRate       = 100              // records a second while the producer runs
	soakPoisonRate = 0.02             // poison records, as a fraction of the orders
	soakDupRate    = 0.15             // records delivered twice
	soakStopGrace  = 10 * time.Second // SIGTERM to exit: what orchestrators grant, and the worker promises
	// soakRestartBackoff is how long a slot waits before it restarts a
	// worker that exited by itself (one that could not reach its broker
	// while the broker restarts): an orchestrator's crash-loop backoff.
	soakRestartBackoff = 500 * time.Millisecond
)

// skipUnlessSoak skips t unless ONCELY_SOAK=1 (make test-soak).
func skipUnlessSoak(t *testing.T) {
	t.Helper()
	if os.Getenv(soakEnv) != "1" {
		t.Skipf("the chaos soaks run with %s=1: `make test-soak` (60s of chaos each), or "+
			"`make test-soak %s=10m` for a long run; %s=N replays a run's schedule", soakEnv, soakDurationEnv, soakSeedEnv)
	}
}

// soakBase is what every chaos soak shares: the orderworker binary, the
// worker slots and their processes, the process chaos (SIGKILL, SIGTERM,
// restarts), the driver's journal, the logs and the figures.
type soakBase struct {
	t        *testing.T
	duration time.Duration
	seed     uint64
	bin      string // the orderworker binary
	logDir   string
	journal  *os.File // what the driver did, and when
	workers  []*soakWorker
	db       *testenv.DB    // the workers' database
	modes    [][]string     // the consumer modes the worker slots rotate through
	started  *regexp.Regexp // the log line of a worker whose consumer started

	appliedInChaos int64         // orders with effects when the chaos ended
	settled        time.Duration // from the end of the chaos to a passing wait for the check

	mu            sync.Mutex
	kills         int            // SIGKILLs
	stops         int            // SIGTERMs during the chaos
	startFailures int            // workers that failed while starting up (and were restarted)
	modeStarts    map[int]int    // starts by index in modes
	longestStop   time.Duration  // from SIGTERM to exit
	faults        map[string]int // by kind
	violations    []string
}

// newSoakBase builds the orderworker binary and opens the driver's journal
// in the log directory (ONCELY_SOAK_LOGS, in its subdirectory sub if not
// empty; else a temporary one). Its workers rotate through modes; started
// matches the log line of a worker whose consumer started.
func newSoakBase(t *testing.T, duration time.Duration, seed uint64, sub string, modes [][]string, started string) *soakBase {
	t.Helper()
	s := &soakBase{t: t, duration: duration, seed: seed, modes: modes, started: regexp.MustCompile(started),
		faults: make(map[string]int), modeStarts: make(map[int]int), logDir: os.Getenv(soakLogsEnv)}
	if s.logDir == "" {
		s.logDir = t.TempDir()
	} else {
		s.logDir = filepath.Join(s.logDir, sub)
		if err := os.MkdirAll(s.logDir, 0o755); err != nil {
			t.Fatal(err)
		}
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
	t.Cleanup(func() {
		for _, w := range s.workers {
			w.kill() // none outlives the test
			_ = w.log.Close()
		}
	})
	t.Cleanup(func() {
		if t.Failed() {
			s.dumpGoroutines()
			s.dumpLogs()
			t.Logf("soak: FAILED; replay the schedule with %s=1 %s=%d %s=%s go test -count=1 -v -run '^%s$' ./integration_test/",
				soakEnv, soakSeedEnv, seed, soakDurationEnv, duration, t.Name())
		}
	})
	return s
}

// addWorker adds a worker slot, worker-N, whose processes run the
// orderworker with args (and their mode's flags) and env.
func (s *soakBase) addWorker(args, env []string) *soakWorker {
	s.t.Helper()
	w := &soakWorker{name: fmt.Sprintf("worker-%d", len(s.workers)), slot: len(s.workers), args: args, env: env}
	var err error
	if w.log, err = os.OpenFile(filepath.Join(s.logDir, w.name+".log"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC|os.O_APPEND, 0o644); err != nil {
		s.t.Fatal(err)
	}
	s.workers = append(s.workers, w)
	return w
}

// calm starts a process in every slot that has none, once the chaos ended.
func (s *soakBase) calm() {
	for _, w := range s.workers {
		if w.current() == nil {
			s.start(w)
		}
	}
}

// stopAll stops every worker with SIGTERM, at the end.
func (s *soakBase) stopAll() {
	var stops sync.WaitGroup
	for _, w := range s.workers {
		stops.Go(func() { s.stop(w, "at the end") })
	}
	stops.Wait()
}

// figuresHead writes the start of the soak's figures to b: the seed, what
// the check read of the history, and the process chaos.
func (s *soakBase) figuresHead(b *strings.Builder, rep *soakReport) {
	fmt.Fprintf(b, "soak figures (seed %d, %s of chaos):\n", s.seed, s.duration)
	fmt.Fprintf(b, "  records produced            %d (%d orders, %d poison records, %d duplicate deliveries)\n",
		rep.Delivered, rep.UniqueOrders, rep.PoisonRecords, rep.DuplicatesSent)
	fmt.Fprintf(b, "  workers killed (SIGKILL)    %d\n", s.kills)
	fmt.Fprintf(b, "  workers stopped (SIGTERM)   %d (+ %d at the end; the longest stop took %s)\n",
		s.stops, len(s.workers), s.longestStop.Round(time.Millisecond))
	fmt.Fprintf(b, "  workers failed starting up  %d (a fault met their start-up, or SIGTERM came first; restarted)\n", s.startFailures)
	var modes []string
	for i, m := range s.modes {
		name := strings.Join(m, " ")
		if name == "" {
			name = "default"
		}
		modes = append(modes, fmt.Sprintf("%s: %d", name, s.modeStarts[i]))
	}
	fmt.Fprintf(b, "  worker starts by mode       %s\n", strings.Join(modes, ", "))
}

// figuresTail writes the check's figures of the effects, the events and
// the dead letters to b.
func (s *soakBase) figuresTail(b *strings.Builder, rep *soakReport) {
	fmt.Fprintf(b, "  effects                     %d (%d of them during the chaos; inbox rows %d; %d customers' balances checked)\n",
		rep.Effects, s.appliedInChaos, rep.InboxRows, rep.Customers)
	fmt.Fprintf(b, "  caught up and checked       %s after the chaos\n", s.settled.Round(time.Millisecond))
	fmt.Fprintf(b, "  order.accepted events       %d (%d message ids + %d republished)\n",
		rep.EventRecords, rep.EventIDs, rep.Republished)
	fmt.Fprintf(b, "  dead-lettered               %d (+ %d copies; %d stubs)\n", rep.DeadLettered, rep.DeadLetterCopies, rep.DeadLetterStubs)
}

// violationFigures writes the violations found to b.
func (s *soakBase) violationFigures(b *strings.Builder) {
	fmt.Fprintf(b, "  violations found            %d\n", len(s.violations))
	for _, v := range s.violations {
		fmt.Fprintf(b, "    %s\n", v)
	}
}

// requireProcessChaos fails the test unless the run killed and stopped
// workers often enough, started every mode and applied half the orders
// while the chaos ran; unique is the number of orders.
func (s *soakBase) requireProcessChaos(unique int) {
	t := s.t
	if s.appliedInChaos < int64(unique)/2 {
		t.Errorf("soak: only %d of %d orders were applied while the chaos ran: the workers stalled", s.appliedInChaos, unique)
	}
	if want := soakMinKills(s.duration); s.kills < want {
		t.Errorf("soak: %d kills; a run of %s must have at least %d", s.kills, s.duration, want)
	}
	if s.stops == 0 {
		t.Error("soak: no worker stopped with SIGTERM during the chaos: that fault kind was never exercised")
	}
	for i, m := range s.modes {
		if s.modeStarts[i] == 0 {
			t.Errorf("soak: no worker ran the mode %q", m)
		}
	}
	if len(s.violations) > 0 {
		t.Errorf("soak: %d violations", len(s.violations))
	}
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

// soakWorker is one worker slot: a static member id whose process the
// driver kills and stops, and restarts as an orchestrator would.
type soakWorker struct {
	name, app string // instance id; application_name of its database sessions
	args, env []string
	slot      int // which of the modes its first start runs
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
func (s *soakBase) start(w *soakWorker) *soakProc {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.starts++
	p := &soakProc{done: make(chan struct{})}
	if fi, err := w.log.Stat(); err == nil {
		p.logFrom = fi.Size()
	}
	var err error
	i := (w.slot + w.starts - 1) % len(s.modes)
	mode := s.modes[i]
	args := append(slices.Clip(w.args), mode...)
	if p.cmd, err = s.spawn(w.log, fmt.Sprintf("%s start %d %v", w.name, w.starts, mode), w.env, args...); err != nil {
		s.t.Error(err)
		return nil
	}
	s.mu.Lock()
	s.modeStarts[i]++
	s.mu.Unlock()
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
func (s *soakBase) judgeExit(w *soakWorker, p *soakProc, what string) {
	out, _ := os.ReadFile(w.log.Name())
	out = out[min(p.logFrom, int64(len(out))):]
	// Up to its successor's output, which the supervisor may have started.
	if i := bytes.Index(out, []byte("\n--- soak: "+w.name+" start ")); i >= 0 {
		out = out[:i+1]
	}
	if !s.started.Match(out) {
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
func (s *soakBase) spawn(log *os.File, what string, env []string, args ...string) (*exec.Cmd, error) {
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
func (s *soakBase) stop(w *soakWorker, when string) {
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
// restarting it at once whenever the driver ended it, and after
// soakRestartBackoff when it exited by itself.
func (s *soakBase) supervise(ctx context.Context, w *soakWorker) {
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
		if !p.expected.Load() && !wait(ctx, soakRestartBackoff) {
			return
		}
	}
}

// processChaos kills a random worker with SIGKILL every 0.6 to 2 s; one
// time in five it stops the worker with SIGTERM instead. Each worker's
// supervisor restarts it.
func (s *soakBase) processChaos(ctx context.Context) {
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

func (s *soakBase) count(n *int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	*n++
}

func (s *soakBase) countFault(kind string, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults[kind] += n
}

// note writes a line to the driver's journal.
func (s *soakBase) note(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, _ = fmt.Fprintf(s.journal, "%s %s\n", time.Now().UTC().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

func (s *soakBase) violation(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.violations = append(s.violations, fmt.Sprintf(format, args...))
}

// soakProduced is the producer's summary line.
type soakProduced struct{ records, orders, poison, duplicates, repeated int }

var producedRE = regexp.MustCompile(`^produced (\d+) records to \S+: (\d+) orders \(total \d+ cents\), (\d+) poison records and (\d+) duplicate deliveries(?:; (\d+) publishes repeated after a failure)?`)

type soakProducer struct {
	done chan struct{} // closed once it exited
	err  error         // its exit error, once done
}

// waitProducer waits for the producer's exit and returns its summary.
func (s *soakBase) waitProducer(p *soakProducer) soakProduced {
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
			return soakProduced{records: n(1), orders: n(2), poison: n(3), duplicates: n(4), repeated: n(5)}
		}
	}
	s.t.Fatalf("no summary line in the producer's output:\n%s", out)
	return soakProduced{}
}

// soakMinKills is what a run of d must reach: one kill every 3 s, 20 in a
// minute.
func soakMinKills(d time.Duration) int { return int(d / (3 * time.Second)) }

// dumpGoroutines writes the test process's goroutines (the brokers', the
// proxy's) to the log directory: where a wedged broker is stuck.
func (s *soakBase) dumpGoroutines() {
	f, err := os.Create(filepath.Join(s.logDir, "goroutines.txt"))
	if err != nil {
		return
	}
	defer f.Close()
	_ = pprof.Lookup("goroutine").WriteTo(f, 2)
}

// dumpLogs prints the end of each process's log and of the driver's
// journal.
func (s *soakBase) dumpLogs() {
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

// countOrders returns the orders with effects so far.
func (s *soakBase) countOrders() int64 {
	var n int64
	if err := s.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+
		pgx.Identifier{s.db.Schema, "orders"}.Sanitize()).Scan(&n); err != nil {
		s.t.Errorf("count the orders: %v", err)
	}
	return n
}

// startProducer runs `orderworker produce` with args (the broker's) for
// 85% of the chaos, so that the workers also recover from the last faults
// with a backlog.
func (s *soakBase) startProducer(args ...string) *soakProducer {
	s.t.Helper()
	count := int(float64(soakRate) * s.duration.Seconds() * 0.85)
	log, err := os.Create(filepath.Join(s.logDir, "producer.log"))
	if err != nil {
		s.t.Fatal(err)
	}
	cmd, err := s.spawn(log, "producer", nil, append([]string{"produce",
		"--count", strconv.Itoa(count), "--rate", strconv.Itoa(soakRate), "--customers", "40",
		"--dup-rate", fmt.Sprint(soakDupRate), "--poison-rate", fmt.Sprint(soakPoisonRate),
		"--seed", strconv.FormatUint(s.seed, 10)}, args...)...)
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

// check runs `orderworker check` with args (the broker's, the topics and
// the group), straight to Postgres, once the group caught up with the
// orders and the outbox is empty. A group that does not catch up within 3
// minutes is a violation, and the check then runs on what is there, to
// name what is missing.
func (s *soakBase) check(args ...string) (*soakReport, error) {
	rep, err := s.runCheck(append([]string{"--wait", "3m"}, args...)...)
	if err == nil {
		return rep, nil
	}
	rep, nowErr := s.runCheck(args...)
	if nowErr != nil {
		return nil, err
	}
	s.violation("the workers did not catch up: %v", err)
	return rep, nil
}

// runCheck runs `orderworker check --json` with args and reads its report.
func (s *soakBase) runCheck(args ...string) (*soakReport, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(s.t.Context(), s.bin, append([]string{"check", "--json", "--schema", s.db.Schema}, args...)...)
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
