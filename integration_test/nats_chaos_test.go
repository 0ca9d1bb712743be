package integration_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/integration_test/internal/chaos"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/internal/testhook"
	"github.com/oncely/oncely/natsconsumer"
)

// The JetStream crash-point child runs in a child process (this test
// binary, run again with natsChildEnv set), which the test kills with
// SIGKILL at the crash point.
const (
	natsChildEnv       = "ONCELY_NATS_CHILD" // database url|schema|stream|batch size
	natsAtCrashPoint   = "oncely nats child: at the crash point"
	natsServerBinary   = "/usr/sbin/nats-server"
	natsChildPoisonErr = "order has no id"
)

// TestNATSChildWorker is the child process's body; it is skipped in an
// ordinary run. Its handler fails every message with a permanent error;
// after a dead letter's PubAck and inbox row, before its Term, it says so
// on stdout and waits to be killed.
func TestNATSChildWorker(t *testing.T) {
	spec := os.Getenv(natsChildEnv)
	if spec == "" {
		t.Skip("runs only as the child process of TestNATSCrashAfterDeadLetterBeforeTerm")
	}
	f := strings.Split(spec, "|")
	if len(f) != 4 {
		t.Fatalf("%s=%q: want 4 fields", natsChildEnv, spec)
	}
	batch, err := strconv.Atoi(f[3])
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pool, err := testenv.NewPool(ctx, f[0], f[1], 4)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	e := &natsEnv{sourceDB: sourceDB{t: t, db: &testenv.DB{URL: f[0], Schema: f[1], Pool: pool}}, js: js, stream: f[2]}
	cfg := e.config(js, func(context.Context, pgx.Tx, *consumer.Message) error {
		return dlq.Permanent(errors.New(natsChildPoisonErr))
	})
	cfg.BatchSize = batch
	c, err := natsconsumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	killed := make(chan struct{}) // never closed: the process ends with SIGKILL
	hooks := &testhook.Consumer{AfterDeadLetter: func(*kgo.Record) error {
		fmt.Println(natsAtCrashPoint)
		<-killed
		return nil
	}}
	t.Fatal(c.Run(testhook.WithConsumer(ctx, hooks)))
}

// A process is killed (SIGKILL) after a poison message's dead-letter copy
// was acknowledged by the dead-letter stream (PubAck) and recorded in the
// inbox, before the original was terminated. JetStream delivers the
// original again; the next process finds it dead-lettered in the inbox and
// acknowledges it without running the handler or publishing a second copy.
// Per message and in batch mode.
func TestNATSCrashAfterDeadLetterBeforeTerm(t *testing.T) {
	for _, batch := range []int{1, 10} {
		t.Run("batch="+strconv.Itoa(batch), func(t *testing.T) {
			e := newNATSEnv(t)
			e.publish(e.subject, "not an order", map[string]string{nats.MsgIdHdr: "poison-1"})
			e.killChildAtCrashPoint(batch)

			// At the crash point: the copy is stored and recorded, the
			// original not terminated.
			if n := e.streamMsgs(e.dlq); n != 1 {
				t.Fatalf("dead-letter stream holds %d messages after the crash, want 1", n)
			}
			if n := e.count(`SELECT count(*) FROM inbox WHERE message_id = 'poison-1' AND outcome = 'dead_lettered'`); n != 1 {
				t.Fatalf("inbox holds the dead letter %d times after the crash, want 1", n)
			}

			var runs atomic.Int32
			cfg := e.config(e.js, func(context.Context, pgx.Tx, *consumer.Message) error {
				runs.Add(1)
				return dlq.Permanent(errors.New(natsChildPoisonErr))
			})
			cfg.BatchSize = batch
			c, _ := e.start(t.Context(), cfg)
			e.settled()
			if n := e.streamMsgs(e.dlq); n != 1 {
				t.Errorf("dead-letter stream holds %d messages, want 1: the message was dead-lettered twice", n)
			}
			st := c.Stats()
			if runs.Load() != 0 || st.DeadLettered != 0 || st.Duplicates != 1 {
				t.Errorf("after the restart: handler runs %d, dead-lettered %d, duplicates %d; want 0, 0 and 1",
					runs.Load(), st.DeadLettered, st.Duplicates)
			}
		})
	}
}

// killChildAtCrashPoint runs the child worker on e's stream until it
// reaches the crash point, then kills it with SIGKILL.
func (e *natsEnv) killChildAtCrashPoint(batch int) {
	e.t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestNATSChildWorker$", "-test.count=1")
	cmd.Env = append(os.Environ(), natsChildEnv+"="+strings.Join([]string{e.db.URL, e.db.Schema, e.stream, strconv.Itoa(batch)}, "|"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out := &markerWriter{marker: natsAtCrashPoint, seen: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	select {
	case <-out.seen:
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		e.t.Fatalf("the child never reached the crash point:\n%s", out.String())
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		e.t.Fatal(err)
	}
	err := cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		e.t.Fatalf("child ended with %v, want SIGKILL", err)
	}
}

// markerWriter is a process's output; seen is closed once marker was
// written.
type markerWriter struct {
	marker string
	seen   chan struct{}
	mu     sync.Mutex
	buf    strings.Builder
	once   sync.Once
}

func (w *markerWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if strings.Contains(w.buf.String(), w.marker) {
		w.once.Do(func() { close(w.seen) })
	}
	return len(p), nil
}

func (w *markerWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// streamMsgs is how many messages stream holds.
func (e *natsEnv) streamMsgs(stream string) uint64 {
	e.t.Helper()
	s, err := e.js.Stream(e.t.Context(), stream)
	if err != nil {
		e.t.Fatal(err)
	}
	info, err := s.Info(e.t.Context())
	if err != nil {
		e.t.Fatal(err)
	}
	return info.State.Msgs
}

// natsServer is a nats-server of the test's own, with JetStream and a file
// store in a temporary directory, on a port of its own: it can be killed
// and started again on the same port and store.
type natsServer struct {
	t    *testing.T
	dir  string
	port int

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	out  bytes.Buffer
}

func newNATSServer(t *testing.T) *natsServer {
	t.Helper()
	if _, err := os.Stat(natsServerBinary); err != nil {
		t.Fatalf("%s: %v (the NATS tests need nats-server installed)", natsServerBinary, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	s := &natsServer{t: t, dir: t.TempDir(), port: port}
	s.start()
	t.Cleanup(s.kill)
	return s
}

func (s *natsServer) url() string { return "nats://127.0.0.1:" + strconv.Itoa(s.port) }

// start runs the server and waits until it accepts connections.
func (s *natsServer) start() {
	s.t.Helper()
	if err := s.tryStart(); err != nil {
		s.t.Fatal(err)
	}
}

// tryStart is start returning its error, for a goroutine other than the
// test's.
func (s *natsServer) tryStart() error {
	s.mu.Lock()
	s.out.Reset()
	s.cmd = exec.Command(natsServerBinary, "-js", "-sd", s.dir, "-p", strconv.Itoa(s.port), "-a", "127.0.0.1")
	s.cmd.Stdout, s.cmd.Stderr = &s.out, &s.out
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := s.cmd.Start(); err != nil {
		s.mu.Unlock()
		return err
	}
	done := make(chan struct{})
	s.done = done
	cmd := s.cmd
	s.mu.Unlock()
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	exited := false
	err := pollFor(30*time.Second, "nats-server to accept connections", func() bool {
		select {
		case <-done:
			exited = true
			return true
		default:
		}
		nc, err := nats.Connect(s.url(), nats.MaxReconnects(0), nats.Timeout(time.Second))
		if err != nil {
			return false
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return false
		}
		_, err = js.AccountInfo(s.t.Context())
		return err == nil
	})
	if exited {
		s.mu.Lock()
		defer s.mu.Unlock()
		return fmt.Errorf("nats-server exited: %s", s.out.String())
	}
	return err
}

// kill ends the server with SIGKILL and waits for it.
func (s *natsServer) kill() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

// reconnecting is a connection to url that reconnects without limit.
func reconnecting(t *testing.T, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.Timeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// gatedEffect is natsEffect whose n-th run (counting every run) waits at
// the gate, in its transaction, until the test opens it; entered is closed
// when it gets there.
type gatedEffect struct {
	runs    atomic.Int64
	at      []int64
	entered []chan struct{}
	gate    []chan struct{}
}

func newGatedEffect(at ...int64) *gatedEffect {
	g := &gatedEffect{at: at}
	for range at {
		g.entered = append(g.entered, make(chan struct{}))
		g.gate = append(g.gate, make(chan struct{}))
	}
	return g
}

func (g *gatedEffect) handler(member string) consumer.Handler {
	apply := sourceEffect(member)
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		n := g.runs.Add(1)
		for i, at := range g.at {
			if n == at {
				close(g.entered[i])
				select {
				case <-g.gate[i]:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		return apply(ctx, tx, msg)
	}
}

// publishMany stores n messages with ids prefix0 .. prefix<n-1>.
func (e *natsEnv) publishMany(prefix string, n int) {
	e.t.Helper()
	for i := range n {
		e.publish(e.subject, "order", map[string]string{nats.MsgIdHdr: prefix + strconv.Itoa(i)})
	}
}

// exactlyOnce fails the test unless every one of n ids took effect once.
func (e *natsEnv) exactlyOnce(n int64) {
	e.t.Helper()
	testenv.Eventually(e.t, time.Minute, "every message's effect", func() bool {
		return e.count(`SELECT count(DISTINCT message_id) FROM effects`) == n
	})
	e.settled()
	if total := e.count(`SELECT count(*) FROM effects`); total != n {
		e.t.Fatalf("%d effects for %d messages: some took effect twice", total, n)
	}
}

// The consumer's nats-server is killed (SIGKILL) mid-stream, while a
// handler is in its transaction, and started again on the same port and
// store. Readiness goes from ready to not ready (naming the connection) and
// back; every message, those published before and after the restart, takes
// effect exactly once. Per message and in batch mode.
func TestNATSServerRestart(t *testing.T) {
	for _, batch := range []int{1, 20} {
		t.Run("batch="+strconv.Itoa(batch), func(t *testing.T) {
			srv := newNATSServer(t)
			_, js := reconnecting(t, srv.url())
			e := newNATSEnvOn(t, js)
			const before, after = 200, 50
			e.publishMany("before-", before)
			g := newGatedEffect(60)
			cfg := e.config(js, g.handler("a"))
			cfg.BatchSize = batch
			c, done := e.start(t.Context(), cfg)
			select {
			case <-g.entered[0]:
			case <-time.After(30 * time.Second):
				t.Fatal("the handler never reached message 60")
			}
			testenv.Eventually(t, 10*time.Second, "the consumer to be ready", c.Ready)

			srv.kill()
			var why string
			testenv.Eventually(t, 10*time.Second, "the consumer not ready while the server is down", func() bool {
				why = c.NotReady()
				return why != ""
			})
			if !strings.Contains(why, "NATS connection") {
				t.Errorf("NotReady while the server is down: %q, want it to name the connection", why)
			}
			close(g.gate[0]) // the transaction commits; its ack cannot reach the server now

			srv.start()
			testenv.Eventually(t, 30*time.Second, "the consumer ready again after the restart", c.Ready)
			e.publishMany("after-", after)
			e.exactlyOnce(before + after)
			select {
			case err := <-done:
				t.Fatalf("Run returned %v during the restart", err)
			default:
			}
		})
	}
}

// The consumer's connections are cut (through a TCP proxy in front of the
// shared nats-server) three times mid-stream, each time while a handler is
// in its transaction; the client reconnects through the proxy, and every
// message takes effect exactly once. Per message and in batch mode.
func TestNATSConnectionCuts(t *testing.T) {
	for _, batch := range []int{1, 20} {
		t.Run("batch="+strconv.Itoa(batch), func(t *testing.T) {
			proxy, err := chaos.NewProxy(strings.TrimPrefix(natsURL, "nats://"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = proxy.Close() })
			e := newNATSEnv(t)
			_, js := reconnecting(t, "nats://"+proxy.Addr())
			const n = 300
			e.publishMany("order-", n)
			g := newGatedEffect(50, 120, 200)
			cfg := e.config(js, g.handler("a"))
			cfg.BatchSize = batch
			_, done := e.start(t.Context(), cfg)
			cuts := 0
			for i := range g.at {
				select {
				case <-g.entered[i]:
				case <-time.After(30 * time.Second):
					t.Fatalf("the handler never reached run %d", g.at[i])
				}
				cuts += proxy.Cut()
				close(g.gate[i])
			}
			if cuts < len(g.at) {
				t.Fatalf("%d connections cut, want at least %d", cuts, len(g.at))
			}
			e.exactlyOnce(n)
			select {
			case err := <-done:
				t.Fatalf("Run returned %v after the cuts", err)
			default:
			}
		})
	}
}

// A natsconsumer.Consumer added to a runner with AddWorker runs with it, and
// /readyz names it while its nats-server is down and is 200 again once the
// server is back; a message published then takes effect.
func TestNATSRunnerReadyz(t *testing.T) {
	srv := newNATSServer(t)
	_, js := reconnecting(t, srv.url())
	e := newNATSEnvOn(t, js)
	r, err := oncely.New(oncely.Config{Pool: e.db.Pool, Schema: e.db.Schema, HealthInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	c, err := natsconsumer.New(e.config(js, sourceEffect("a")))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.AddWorker("nats consumer "+e.stream, c); err != nil {
		t.Fatal(err)
	}
	h := r.Handler()
	runRunner(t, r)
	testenv.Eventually(t, 30*time.Second, "/readyz 200", func() bool { code, _ := readyz(t, h, false); return code == http.StatusOK })
	srv.kill()
	var body string
	testenv.Eventually(t, 30*time.Second, "/readyz naming the NATS consumer", func() bool {
		var code int
		code, body = readyz(t, h, false)
		return code == http.StatusServiceUnavailable && strings.Contains(body, "nats consumer "+e.stream) && strings.Contains(body, "NATS connection")
	})
	srv.start()
	testenv.Eventually(t, 30*time.Second, "/readyz 200 after the restart", func() bool { code, _ := readyz(t, h, false); return code == http.StatusOK })
	e.publish(e.subject, "order", map[string]string{nats.MsgIdHdr: "after-restart"})
	e.exactlyOnce(1)
}
