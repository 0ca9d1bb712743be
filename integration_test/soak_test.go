//go:build linux

package integration_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/integration_test/internal/chaos"
	"github.com/oncely/oncely/internal/testenv"
)

// The Kafka soak's group settings.
const (
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
	skipUnlessSoak(t)
	duration, seed := soakSettings(t)
	s := newSoak(t, duration, seed)
	t.Logf("soak: seed %d, %s of chaos, %d workers, %d records/s", seed, duration, soakWorkers, soakRate)

	chaosCtx, stopChaos := context.WithTimeout(context.Background(), duration)
	defer stopChaos()
	var loops sync.WaitGroup
	for _, w := range s.workers {
		loops.Go(func() { s.supervise(chaosCtx, w) })
	}
	producer := s.startProducer("--brokers", s.brokers, "--topic", soakTopic)
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
	s.calm()
	produced := s.waitProducer(producer)
	rep, checkErr := s.check("--brokers", s.brokers, "--topic", soakTopic, "--events-topic", soakEvents, "--group", s.group)
	s.settled = time.Since(calm)
	s.stopAll()
	if checkErr != nil {
		t.Fatalf("soak: the check did not run: %v", checkErr)
	}
	s.crossCheck(produced, injected, rep)
	s.report(rep, injected)
}

// soak is one run of the Kafka soak: the services, the processes and the
// figures.
type soak struct {
	*soakBase
	cluster *kfake.Cluster
	brokers string
	topics  []soakTopicInfo
	group   string
	proxy   *chaos.Proxy
	kfaults *chaos.KafkaFaults
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
	s := &soak{soakBase: newSoakBase(t, duration, seed, "", soakModes, `msg="oncely consumer started"`)}
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
		app := testenv.UniqueName("soak_w")
		q.Set("application_name", app) // how the driver finds its database sessions
		u.RawQuery = q.Encode()
		name := fmt.Sprintf("worker-%d", i)
		w := s.addWorker([]string{"run", "--brokers", s.brokers, "--topic", soakTopic, "--events-topic", soakEvents,
			"--group", s.group, "--schema", s.db.Schema, "--http-addr", "127.0.0.1:0",
			"--instance-id", name, "--session-timeout", soakSessionTimeout, "--rebalance-timeout", soakRebalanceTimeout},
			[]string{"DATABASE_URL=" + u.String()})
		w.app = app
	}
	return s
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
	s.figuresHead(&b, rep)
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
	s.figuresTail(&b, rep)
	fmt.Fprintf(&b, "  events parked               %d\n", rep.EventsParked)
	fmt.Fprintf(&b, "  poison injected             %d records read committed (+ %d aborted); rounds by kind:\n", in.records, in.aborted)
	for _, k := range soakInjectKinds {
		fmt.Fprintf(&b, "    %-80s %d\n", k, in.rounds[k])
	}
	s.violationFigures(&b)
	t.Log(b.String())

	s.requireProcessChaos(rep.UniqueOrders)
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
