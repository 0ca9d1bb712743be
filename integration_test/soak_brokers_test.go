//go:build linux

package integration_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/oncely/oncely/integration_test/internal/chaos"
	"github.com/oncely/oncely/internal/testenv"
)

// The broker soaks' modes: the orderworker's JetStream and RabbitMQ workers
// take no --key-parallelism. Batches of 100 with the set-based batch
// handler (the default), with the per-record handler, and a transaction
// per message.
var brokerSoakModes = [][]string{{}, {"--handler", "record"}, {"--batch-size", "1"}}

// The broker faults of the JetStream and RabbitMQ soaks; each must be met
// during a run.
const (
	faultBrokerCut     = "connections cut (proxy)"
	faultBrokerStall   = "connections stalled (proxy)"
	faultBrokerRestart = "broker restarts (SIGKILL, down 1-5 s, same store)"
)

var brokerFaultKinds = []string{faultBrokerCut, faultBrokerStall, faultBrokerRestart}

// brokerRestartEvery is how much chaos there is per broker restart: a
// 60-second run restarts its broker once.
const brokerRestartEvery = 60 * time.Second

// soakBroker is the broker under a soak: a server of the test's own, which
// the driver kills and starts again, and the orderworker's flags for it.
type soakBroker struct {
	name    string // the --source
	addr    string // the server's host:port, which the proxy forwards to
	urlFlag string // --nats or --amqp
	scheme  string // of the URL: nats:// or amqp://guest:guest@
	// kill kills the server with SIGKILL; start starts it again on the
	// same store and port, returning once it accepts connections.
	kill, start func() error
	// workerArgs are the worker's extra flags; produceArgs and checkArgs
	// the producer's and the check's.
	workerArgs, produceArgs, checkArgs []string
	started                            string // the log line of a worker whose consumer started
}

func (b soakBroker) url(addr string) string { return b.scheme + addr + "/" }

// TestSoakJetStream and TestSoakRabbitMQ are the chaos soak of the
// JetStream and RabbitMQ sources (TestSoak's, on those brokers): three
// orderworker slots consume orders (duplicate deliveries and poison
// messages mixed in, published at a steady rate) from a server of the
// test's own, through a TCP proxy, while a driver kills the workers with
// SIGKILL and restarts them, stops others with SIGTERM (the slots' modes
// rotate: the batch handler, the per-record handler, a transaction per
// message), cuts and stalls their connections at the proxy, and kills the
// broker itself and starts it again on the same store. The producer talks
// to the broker directly and publishes a message again, under the same
// message id, when a publish failed. Then, with the workers drained, it
// checks the whole history with `orderworker check --source`: every order
// applied exactly once, balances equal to the sums, every poison message
// dead-lettered with its class and no order there, one event per order
// under one message id, each customer's events in commit order. It prints
// its figures and fails on any violation, naming the seed that replays its
// schedule.
//
// They run only with ONCELY_SOAK=1 (make test-soak).
func TestSoakJetStream(t *testing.T) {
	skipUnlessSoak(t)
	srv := newNATSServer(t)
	testSoakBroker(t, soakBroker{
		name: "jetstream", addr: strings.TrimPrefix(srv.url(), "nats://"), urlFlag: "--nats", scheme: "nats://",
		kill: func() error {
			srv.kill()
			return nil
		},
		start: srv.tryStart,
		// A killed worker's messages come back after the ack wait.
		workerArgs: []string{"--ack-wait", "2s"},
		started:    `msg="oncely nats consumer started"`,
	})
}

func TestSoakRabbitMQ(t *testing.T) {
	skipUnlessSoak(t)
	srv := newRabbitServer(t)
	history := filepath.Join(t.TempDir(), "history.jsonl")
	testSoakBroker(t, soakBroker{
		name: "rabbitmq", addr: fmt.Sprintf("127.0.0.1:%d", srv.port), urlFlag: "--amqp", scheme: "amqp://guest:guest@",
		kill: srv.crash,
		start: func() error {
			if err := srv.start(); err != nil {
				return err
			}
			return srv.waitUp(2 * time.Minute)
		},
		// A queue keeps nothing once acknowledged: the check reads what
		// the producer wrote down before publishing.
		produceArgs: []string{"--history", history},
		checkArgs:   []string{"--history", history},
		started:     `msg="oncely rabbitmq consumer started"`,
	})
}

// brokerSoak is one run of a broker soak.
type brokerSoak struct {
	*soakBase
	broker soakBroker
	proxy  *chaos.Proxy
	group  string
}

func testSoakBroker(t *testing.T, b soakBroker) {
	duration, seed := soakSettings(t)
	s := &brokerSoak{soakBase: newSoakBase(t, duration, seed, b.name, brokerSoakModes, b.started), broker: b, group: "soak"}
	s.db = testenv.Postgres(t)
	var err error
	if s.proxy, err = chaos.NewProxy(b.addr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.proxy.Close() })
	direct := []string{"--source", b.name, b.urlFlag, b.url(b.addr), "--topic", soakTopic, "--events-topic", soakEvents}
	for range soakWorkers {
		s.addWorker(append([]string{"run", "--source", b.name, b.urlFlag, b.url(s.proxy.Addr()), "--topic", soakTopic,
			"--events-topic", soakEvents, "--group", s.group, "--schema", s.db.Schema, "--http-addr", "127.0.0.1:0"}, b.workerArgs...),
			[]string{"DATABASE_URL=" + s.db.URL})
	}
	t.Logf("soak %s: seed %d, %s of chaos, %d workers, %d records/s", b.name, seed, duration, soakWorkers, soakRate)

	chaosCtx, stopChaos := context.WithTimeout(context.Background(), duration)
	defer stopChaos()
	var loops sync.WaitGroup
	for _, w := range s.workers {
		loops.Go(func() { s.supervise(chaosCtx, w) })
	}
	// The producer outlives the broker's restarts: it publishes a message
	// again until the broker has it.
	producer := s.startProducer(append(append(slices.Clone(direct), "--retry-for", "3m"), b.produceArgs...)...)
	loops.Go(func() { s.processChaos(chaosCtx) })
	loops.Go(func() { s.connectionChaos(chaosCtx) })
	loops.Go(func() { s.restartChaos(chaosCtx) })
	loops.Wait()
	s.appliedInChaos = s.countOrders()

	// Calm: no more faults; every worker up; the producer done; then the
	// history, once the workers drained the queue.
	calm := time.Now()
	s.proxy.Resume()
	s.calm()
	produced := s.waitProducer(producer)
	rep, checkErr := s.check(append(append(slices.Clone(direct), "--group", s.group), b.checkArgs...)...)
	s.settled = time.Since(calm)
	s.stopAll()
	if checkErr != nil {
		t.Fatalf("soak: the check did not run: %v", checkErr)
	}
	s.crossCheck(produced, rep)
	s.report(rep, produced)
}

// connectionChaos cuts the workers' connections to the broker at the proxy
// (both ends closed), or one time in four stalls them (no byte moves), every
// 0.5 to 3 s: a cut first, then a stall, then at random.
func (s *brokerSoak) connectionChaos(ctx context.Context) {
	rng := rand.New(rand.NewPCG(s.seed, 3))
	for n := 0; wait(ctx, between(rng, 500*time.Millisecond, 3*time.Second)); n++ {
		if n == 1 || (n > 1 && rng.IntN(4) == 0) {
			d := between(rng, 200*time.Millisecond, 2*time.Second)
			s.proxy.Stall(d)
			s.countFault(faultBrokerStall, 1)
			s.note("%s for %s", faultBrokerStall, d.Round(time.Millisecond))
			continue
		}
		cut := s.proxy.Cut()
		s.countFault(faultBrokerCut, min(cut, 1))
		s.countFault(connectionsCut, cut)
		s.note("%s: %d connections", faultBrokerCut, cut)
	}
}

// restartChaos kills the broker, leaves it down for 1 to 5 s (the workers
// and the producer meet refused connections), and starts it again on the
// same store, once per brokerRestartEvery of chaos (at least once), each at
// a random time in its share of the first 80% of the chaos, so that the
// workers also run for a while after the last restart.
func (s *brokerSoak) restartChaos(ctx context.Context) {
	rng := rand.New(rand.NewPCG(s.seed, 4))
	n := max(1, int(s.duration/brokerRestartEvery))
	share := s.duration * 8 / 10 / time.Duration(n)
	start := time.Now()
	for i := range n {
		at := time.Duration(i)*share + share/5 + time.Duration(rng.Int64N(int64(share*3/5)))
		if !wait(ctx, time.Until(start.Add(at))) {
			return
		}
		down := between(rng, time.Second, 5*time.Second)
		s.note("%s: killing the broker for %s", faultBrokerRestart, down.Round(time.Millisecond))
		began := time.Now()
		if err := s.broker.kill(); err != nil {
			s.t.Errorf("kill the %s broker: %v", s.broker.name, err)
			return
		}
		// The broker stays down for down whatever the chaos does
		// meanwhile: the test must not end with it dead.
		time.Sleep(time.Until(began.Add(down))) // the outage's length, not a wait for an event
		if err := s.broker.start(); err != nil {
			s.t.Errorf("start the %s broker again: %v", s.broker.name, err)
			return
		}
		s.countFault(faultBrokerRestart, 1)
		s.note("%s: the broker is back after %s", faultBrokerRestart, time.Since(began).Round(time.Millisecond))
	}
}

// crossCheck compares what the producer says it published with what the
// check read back. A publish repeated after a failure may or may not have
// reached the broker before the failure: the check may read up to that
// many more records (as duplicate deliveries), never fewer.
func (s *brokerSoak) crossCheck(p soakProduced, rep *soakReport) {
	for _, c := range []struct {
		what           string
		produced, read int
	}{
		{"orders", p.orders, rep.UniqueOrders}, {"poison messages", p.poison, rep.PoisonRecords},
	} {
		if c.produced != c.read {
			s.violation("%s: the producer sent %d, the check read %d", c.what, c.produced, c.read)
		}
	}
	if rep.Delivered < p.records || rep.Delivered > p.records+p.repeated ||
		rep.DuplicatesSent < p.duplicates || rep.DuplicatesSent > p.duplicates+p.repeated {
		s.violation("the producer sent %d messages (%d duplicate deliveries) and repeated %d publishes; the check read %d (%d duplicate deliveries)",
			p.records, p.duplicates, p.repeated, rep.Delivered, rep.DuplicatesSent)
	}
}

// report prints the figures and fails the test on a violation, or if the
// run did not exercise what it must.
func (s *brokerSoak) report(rep *soakReport, p soakProduced) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	s.figuresHead(&b, rep)
	fmt.Fprintf(&b, "  publishes repeated          %d (after a failed publish: the broker restarting)\n", p.repeated)
	for _, k := range brokerFaultKinds {
		if k == faultBrokerCut {
			fmt.Fprintf(&b, "  %-49s %d (%d %s)\n", k, s.faults[k], s.faults[connectionsCut], connectionsCut)
			continue
		}
		fmt.Fprintf(&b, "  %-49s %d\n", k, s.faults[k])
	}
	s.figuresTail(&b, rep)
	s.violationFigures(&b)
	s.t.Logf("%s %s", s.broker.name, b.String())

	s.requireProcessChaos(rep.UniqueOrders)
	for _, k := range brokerFaultKinds {
		if s.faults[k] == 0 {
			s.t.Errorf("soak: no %s: that fault kind was never exercised", k)
		}
	}
	if rep.PoisonRecords == 0 || rep.DuplicatesSent == 0 {
		s.t.Errorf("soak: %d poison messages and %d duplicate deliveries: the history must have both", rep.PoisonRecords, rep.DuplicatesSent)
	}
}
