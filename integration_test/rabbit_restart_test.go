package integration_test

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/oncely/oncely/internal/testenv"
)

// rabbitServerBinary starts a RabbitMQ node (the Debian package's script).
const rabbitServerBinary = "/usr/sbin/rabbitmq-server"

// rabbitServer is a RabbitMQ node of a test's own, on ports and in a
// directory of its own: the test can stop its application without
// disturbing the shared RabbitMQ that other tests and processes use.
type rabbitServer struct {
	t    *testing.T
	name string // the Erlang node name
	port int
	dir  string
	cmd  *exec.Cmd
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
	s := &rabbitServer{t: t, name: "oncely-" + strconv.Itoa(ports[0]) + "@localhost", port: ports[0], dir: dir}
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
	// Stopped by rabbitmqctl at the end (a killed script would leave the
	// node, which runs as another user, behind).
	s.cmd = exec.CommandContext(context.WithoutCancel(t.Context()), rabbitServerBinary)
	s.cmd.Env = append(os.Environ(),
		"RABBITMQ_NODENAME="+s.name, "RABBITMQ_NODE_PORT="+strconv.Itoa(s.port), "RABBITMQ_DIST_PORT="+strconv.Itoa(ports[1]),
		"RABBITMQ_MNESIA_BASE="+dir+"/mnesia", "RABBITMQ_MNESIA_DIR="+dir+"/mnesia/node", "RABBITMQ_LOG_BASE="+dir+"/log",
		"RABBITMQ_ENABLED_PLUGINS_FILE="+dir+"/enabled_plugins", "RABBITMQ_CONFIG_FILE="+dir+"/rabbitmq.conf",
		"RABBITMQ_PID_FILE="+dir+"/pid", "RABBITMQ_FEATURE_FLAGS_FILE="+dir+"/feature_flags",
		"RABBITMQ_PLUGINS_EXPAND_DIR="+dir+"/plugins", "RABBITMQ_QUORUM_DIR="+dir+"/quorum", "RABBITMQ_STREAM_DIR="+dir+"/stream")
	s.cmd.Stdout, s.cmd.Stderr = &s.out, &s.out
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		s.ctl("stop") // the whole node, and the helpers it started
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Errorf("RabbitMQ node %s did not stop", s.name)
		}
	})
	s.waitUp()
	return s
}

func (s *rabbitServer) url() string {
	return "amqp://guest:guest@127.0.0.1:" + strconv.Itoa(s.port) + "/"
}

// ctl runs rabbitmqctl on the node (also from a cleanup, after the test's
// context ended).
func (s *rabbitServer) ctl(args ...string) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "rabbitmqctl", append([]string{"-n", s.name}, args...)...).CombinedOutput()
	if err != nil {
		s.t.Fatalf("rabbitmqctl %s on %s: %v: %s", strings.Join(args, " "), s.name, err, out)
	}
}

// waitUp waits until the node accepts AMQP connections.
func (s *rabbitServer) waitUp() {
	s.t.Helper()
	testenv.Eventually(s.t, 60*time.Second, "the RabbitMQ node to accept connections", func() bool {
		conn, err := amqp.Dial(s.url())
		if err != nil {
			return false
		}
		_ = conn.Close()
		return true
	})
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
			srv.waitUp()
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
