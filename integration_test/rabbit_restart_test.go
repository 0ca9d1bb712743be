package integration_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/oncely/oncely/internal/testenv"
)

// rabbitServerBinary starts a RabbitMQ node (the Debian package's script).
const rabbitServerBinary = "/usr/sbin/rabbitmq-server"

// rabbitServer is a RabbitMQ node of a test's own, on ports and in a
// directory of its own: the test can stop its application, or kill the
// node and start it again on the same directory, without disturbing the
// shared RabbitMQ that other tests and processes use.
type rabbitServer struct {
	t        *testing.T
	name     string // the Erlang node name
	port     int
	distPort int
	dir      string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed once cmd exited
	out  bytes.Buffer
}

func newRabbitServer(t *testing.T) *rabbitServer {
	t.Helper()
	if _, err := os.Stat(rabbitServerBinary); err != nil {
		t.Fatalf("%s: %v (the RabbitMQ tests need rabbitmq-server installed)", rabbitServerBinary, err)
	}
	ports := make([]int, 2) // AMQP, Erlang distribution
	for i := range ports {
		ln, err := (&net.ListenConfig{}).Listen(t.Context(), "tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ports[i] = ln.Addr().(*net.TCPAddr).Port
		_ = ln.Close()
	}
	// The node runs as the rabbitmq user: its directory must be its own.
	dir, err := os.MkdirTemp("", "oncely-rabbit-node-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	s := &rabbitServer{t: t, name: "oncely-" + strconv.Itoa(ports[0]) + "@localhost", port: ports[0], distPort: ports[1], dir: dir}
	for _, f := range []struct{ name, text string }{
		{"enabled_plugins", "[].\n"},
		{"rabbitmq.conf", "listeners.tcp.default = 127.0.0.1:" + strconv.Itoa(s.port) + "\n"},
	} {
		if err := os.WriteFile(filepath.Join(dir, f.name), []byte(f.text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.CommandContext(t.Context(), "chown", "-R", "rabbitmq", dir).CombinedOutput(); err != nil {
		t.Fatalf("chown %s to the rabbitmq user: %v: %s", dir, err, out)
	}
	if err := s.start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.mu.Lock()
		done := s.done
		s.mu.Unlock()
		if err := s.tryCtl("stop"); err != nil { // the whole node, and the helpers it started
			t.Error(err)
		}
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Errorf("RabbitMQ node %s did not stop", s.name)
		}
	})
	if err := s.waitUp(60 * time.Second); err != nil {
		t.Fatal(err)
	}
	return s
}

// start runs the node on s's ports and directory; waitUp waits for it.
// Stopped by rabbitmqctl at the end (a killed script would leave the node,
// which runs as another user, behind).
func (s *rabbitServer) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	dir := s.dir
	s.out.Reset()
	s.cmd = exec.CommandContext(context.WithoutCancel(s.t.Context()), rabbitServerBinary)
	s.cmd.Env = append(os.Environ(),
		"RABBITMQ_NODENAME="+s.name, "RABBITMQ_NODE_PORT="+strconv.Itoa(s.port), "RABBITMQ_DIST_PORT="+strconv.Itoa(s.distPort),
		"RABBITMQ_MNESIA_BASE="+dir+"/mnesia", "RABBITMQ_MNESIA_DIR="+dir+"/mnesia/node", "RABBITMQ_LOG_BASE="+dir+"/log",
		"RABBITMQ_ENABLED_PLUGINS_FILE="+dir+"/enabled_plugins", "RABBITMQ_CONFIG_FILE="+dir+"/rabbitmq.conf",
		"RABBITMQ_PID_FILE="+dir+"/pid", "RABBITMQ_FEATURE_FLAGS_FILE="+dir+"/feature_flags",
		"RABBITMQ_PLUGINS_EXPAND_DIR="+dir+"/plugins", "RABBITMQ_QUORUM_DIR="+dir+"/quorum", "RABBITMQ_STREAM_DIR="+dir+"/stream")
	s.cmd.Stdout, s.cmd.Stderr = &s.out, &s.out
	if err := s.cmd.Start(); err != nil {
		return fmt.Errorf("start RabbitMQ node %s: %w", s.name, err)
	}
	done := make(chan struct{})
	s.done = done
	cmd := s.cmd
	go func() { _ = cmd.Wait(); close(done) }()
	return nil
}

// crash kills the node's Erlang VM with SIGKILL (no chance to close a
// connection or a file) and waits for its script to exit.
func (s *rabbitServer) crash() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "rabbitmqctl", "-n", s.name, "eval", "os:getpid().").CombinedOutput()
	if err != nil {
		return fmt.Errorf("the pid of RabbitMQ node %s: %v: %s", s.name, err, out)
	}
	pid, err := strconv.Atoi(strings.Trim(strings.TrimSpace(string(out)), `"`))
	if err != nil {
		return fmt.Errorf("the pid of RabbitMQ node %s: %q", s.name, out)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("kill RabbitMQ node %s (pid %d): %w", s.name, pid, err)
	}
	s.mu.Lock()
	done := s.done
	s.mu.Unlock()
	select {
	case <-done:
		return nil
	case <-time.After(30 * time.Second):
		return fmt.Errorf("RabbitMQ node %s: its script did not exit within 30s of the VM's SIGKILL", s.name)
	}
}

func (s *rabbitServer) url() string {
	return "amqp://guest:guest@127.0.0.1:" + strconv.Itoa(s.port) + "/"
}

// ctl runs rabbitmqctl on the node, failing the test if it fails.
func (s *rabbitServer) ctl(args ...string) {
	s.t.Helper()
	if err := s.tryCtl(args...); err != nil {
		s.t.Fatal(err)
	}
}

// tryCtl runs rabbitmqctl on the node (also from a cleanup, after the
// test's context ended).
func (s *rabbitServer) tryCtl(args ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "rabbitmqctl", append([]string{"-n", s.name}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("rabbitmqctl %s on %s: %v: %s", strings.Join(args, " "), s.name, err, out)
	}
	return nil
}

// waitUp waits up to timeout until the node accepts AMQP connections.
func (s *rabbitServer) waitUp(timeout time.Duration) error {
	err := pollFor(timeout, "RabbitMQ node "+s.name+" to accept connections", func() bool {
		conn, err := amqp.Dial(s.url())
		if err != nil {
			return false
		}
		_ = conn.Close()
		return true
	})
	if err != nil {
		s.mu.Lock()
		defer s.mu.Unlock()
		return fmt.Errorf("%w; its output:\n%s", err, s.out.String())
	}
	return nil
}

// The consumer's RabbitMQ node stops its application (rabbitmqctl
// stop_app: every connection closed, the port shut) mid-stream, while a
// handler is in its transaction, and starts it again. Readiness goes from
// ready to not ready (naming RabbitMQ) and back; every message, those
// published before and after the restart, takes effect exactly once. Per
// message and in batch mode. The node is the test's own, so no other test
// sees the restart.
func TestRabbitServerRestart(t *testing.T) {
	for _, batch := range []int{1, 20} {
		t.Run("batch="+strconv.Itoa(batch), func(t *testing.T) {
			srv := newRabbitServer(t)
			e := newRabbitEnvOn(t, srv.url())
			const before, after = 200, 50
			for i := range before {
				e.publish(e.queue, "order", "before-"+strconv.Itoa(i), nil)
			}
			g := newGatedEffect(60)
			cfg := e.config(g.handler("a"))
			cfg.BatchSize = batch
			r := e.start(t.Context(), cfg)
			select {
			case <-g.entered[0]:
			case <-time.After(30 * time.Second):
				t.Fatal("the handler never reached message 60")
			}
			testenv.Eventually(t, 10*time.Second, "the consumer to be ready", r.c.Ready)

			srv.ctl("stop_app")
			var why string
			testenv.Eventually(t, 10*time.Second, "the consumer not ready while RabbitMQ is down", func() bool {
				why = r.c.NotReady()
				return why != ""
			})
			if !strings.Contains(why, "RabbitMQ") {
				t.Errorf("NotReady while RabbitMQ is down: %q, want it to name RabbitMQ", why)
			}
			close(g.gate[0]) // the transaction commits; its ack cannot reach RabbitMQ now

			srv.ctl("start_app")
			if err := srv.waitUp(60 * time.Second); err != nil {
				t.Fatal(err)
			}
			testenv.Eventually(t, 30*time.Second, "the consumer ready again after the restart", r.c.Ready)
			e.conn = rabbitConnTo(t, srv.url()) // the test's own connection closed with the application
			for i := range after {
				e.publish(e.queue, "order", "after-"+strconv.Itoa(i), nil)
			}
			testenv.Eventually(t, time.Minute, "every message's effect", func() bool {
				return e.count(`SELECT count(DISTINCT message_id) FROM effects`) == before+after
			})
			r.stop(t)
			e.empty(e.queue)
			e.effects(before + after)
			if n := r.c.Connections(); n < 2 {
				t.Errorf("%d connections, want a second one after the restart", n)
			}
			if st := r.c.Stats(); st.Duplicates == 0 {
				t.Errorf("no duplicate: the message committed while RabbitMQ was down was not delivered again (stats %+v)", st)
			}
		})
	}
}
