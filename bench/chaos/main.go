// Command chaos measures throughput while group members are killed: the
// orderworker example with its defaults and a hand-written worker (franz-go
// and pgx, a transaction per record), each as 3 processes of one group on
// the contended workload (orders keyed by order id, 50 customers), once
// without chaos and once with one member killed by SIGKILL and restarted at
// once every ~1.5 s, on the same seeded schedule for both. It reports each
// run's rate (orders applied over the time from the first produce until the
// last order is applied, read from the database), the ratios, and how long a
// restarted process takes from its start to its first committed record.
//
//	cd bench && go run ./chaos [flags]
package main

import (
	"bufio"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	mrand "math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/bench/internal/kfakechild"
	"github.com/oncely/oncely/bench/internal/orderload"
	"github.com/oncely/oncely/bench/internal/runenv"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/migrations"
)

type options struct {
	dbURL            string
	repo             string
	workers          string
	orders           int
	over             time.Duration
	dupRate          float64
	customers        int
	partitions       int
	members          int
	killEvery        time.Duration
	seed             uint64
	sessionTimeout   time.Duration
	rebalanceTimeout time.Duration
	static           bool
	timeout          time.Duration
	rounds           int
	workerFlags      string
	handFlags        string
	logs             string
}

// The -workers values.
const (
	workerExample = "orderworker"
	workerHand    = "hand"
)

func main() {
	if len(os.Args) >= 2 {
		switch os.Args[1] {
		case kfakechild.Arg:
			// Groups accept session timeouts down to a second.
			exit(kfakechild.Serve(kfake.GroupMinSessionTimeout(time.Second)))
			return
		case handArg:
			exit(handWorker(os.Args[2:]))
			return
		}
	}
	var o options
	flag.StringVar(&o.dbURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "Postgres (each run gets a fresh schema, dropped afterwards)")
	flag.StringVar(&o.repo, "repo", "..", "the oncely repository, whose ./examples/orderworker is built")
	flag.StringVar(&o.workers, "workers", workerExample+","+workerHand, "workers to measure, comma-separated: "+workerExample+" (the example's defaults), "+workerHand+" (hand-written)")
	flag.IntVar(&o.orders, "orders", 30_000, "distinct orders produced")
	flag.DurationVar(&o.over, "over", 10*time.Second, "time over which the orders (and their duplicates) are produced")
	flag.Float64Var(&o.dupRate, "dup-rate", 0.2, "fraction of orders delivered a second time (same message-id header)")
	flag.IntVar(&o.customers, "customers", 50, "customers the orders are spread over")
	flag.IntVar(&o.partitions, "partitions", 6, "partitions of the orders topic")
	flag.IntVar(&o.members, "members", 3, "worker processes in the group")
	flag.DurationVar(&o.killEvery, "kill-every", 1500*time.Millisecond, "mean time between SIGKILLs in the chaos runs (uniform within +-20%), members in turn")
	flag.Uint64Var(&o.seed, "seed", 1, "seed of the orders, the duplicates and the kill schedule")
	flag.DurationVar(&o.sessionTimeout, "session-timeout", 3*time.Second, "group session timeout of every worker (the soak test's)")
	flag.DurationVar(&o.rebalanceTimeout, "rebalance-timeout", 4*time.Second, "group rebalance timeout of every worker (the soak test's)")
	flag.BoolVar(&o.static, "static", true, "static group membership (an instance id per member) for both workers")
	flag.DurationVar(&o.timeout, "timeout", 4*time.Minute, "limit for one run to apply every order")
	flag.IntVar(&o.rounds, "rounds", 1, "rounds; each runs every worker without and with chaos")
	flag.StringVar(&o.workerFlags, "orderworker-flags", "", "extra flags for `orderworker run`, space-separated (e.g. --batch-size 1)")
	flag.StringVar(&o.handFlags, "hand-flags", "", "extra flags for the hand-written worker, space-separated (e.g. -heartbeat-interval 1s)")
	flag.StringVar(&o.logs, "logs", "", "directory to keep every process's log in (default: a temporary one, removed)")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(1)
	}
}

func exit(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// delivery is one record to produce: order i, a first or a second time.
type delivery struct {
	i   int
	dup bool
}

// schedule is what a run produces and when it kills: the same for every
// worker.
type schedule struct {
	gen        orderload.Gen
	deliveries []delivery
	kills      []time.Duration // since the first produce
}

func newSchedule(o options) schedule {
	rng := mrand.New(mrand.NewPCG(o.seed, 0x6368616f73))
	type pos struct {
		at float64
		d  delivery
	}
	var ps []pos
	for i := range o.orders {
		ps = append(ps, pos{float64(i), delivery{i: i}})
		if rng.Float64() < o.dupRate {
			// The second delivery comes up to 2,000 records later.
			ps = append(ps, pos{float64(i) + 1 + rng.Float64()*2000, delivery{i: i, dup: true}})
		}
	}
	sort.SliceStable(ps, func(a, b int) bool { return ps[a].at < ps[b].at })
	s := schedule{gen: orderload.NewGen(o.orders, o.customers, o.seed)}
	for _, p := range ps {
		s.deliveries = append(s.deliveries, p.d)
	}
	for t := time.Duration(0); t < o.timeout; {
		t += time.Duration(float64(o.killEvery) * (0.8 + 0.4*rng.Float64()))
		s.kills = append(s.kills, t)
	}
	return s
}

func run(ctx context.Context, o options) error {
	workers := strings.Split(o.workers, ",")
	for _, w := range workers {
		if w != workerExample && w != workerHand {
			return fmt.Errorf("unknown worker %q", w)
		}
	}
	if o.logs == "" {
		dir, err := os.MkdirTemp("", "oncely-chaos-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		o.logs = dir
	} else if err := os.MkdirAll(o.logs, 0o755); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	bin := filepath.Join(o.logs, "orderworker")
	if slices.Contains(workers, workerExample) {
		build := exec.CommandContext(ctx, "go", "build", "-o", bin, "./examples/orderworker")
		build.Dir, build.Stdout, build.Stderr = o.repo, os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			return fmt.Errorf("build the orderworker in %s: %w", o.repo, err)
		}
	}
	admin, err := pgxpool.New(ctx, o.dbURL)
	if err != nil {
		return err
	}
	defer admin.Close()
	b, err := kfakechild.Start(context.WithoutCancel(ctx))
	if err != nil {
		return err
	}
	defer b.Stop()
	if err := createTopics(ctx, b.Addrs, 1, orderload.EventsTopic); err != nil {
		return err
	}
	sched := newSchedule(o)
	fmt.Printf("oncely chaos: %d orders (+%d duplicate deliveries) over %s, keyed by order id over %d partitions, %d customers; "+
		"%d members, static membership %v, session timeout %s, rebalance timeout %s; chaos: SIGKILL every %s +-20%%, members in turn, "+
		"restarted at once; seed %d; rounds %d\n",
		o.orders, len(sched.deliveries)-o.orders, o.over, o.partitions, o.customers, o.members, o.static, o.sessionTimeout,
		o.rebalanceTimeout, o.killEvery, o.seed, o.rounds)
	if o.workerFlags != "" {
		fmt.Printf("orderworker flags: %s\n", o.workerFlags)
	}
	if o.handFlags != "" {
		fmt.Printf("hand worker flags: %s\n", o.handFlags)
	}
	fmt.Printf("load average at start: %s\n\n", runenv.LoadAverage())

	var results []*runResult
	for round := 1; round <= o.rounds && ctx.Err() == nil; round++ {
		for _, chaos := range []bool{false, true} {
			for _, w := range workers {
				if ctx.Err() != nil {
					break
				}
				r := &runResult{worker: w, chaos: chaos, round: round}
				fmt.Fprintf(os.Stderr, "chaos: round %d: %s, chaos %v...", round, w, chaos)
				d := &driver{o: o, sched: sched, admin: admin, brokers: b.Addrs, self: self, bin: bin, res: r}
				d.run(ctx)
				fmt.Fprintf(os.Stderr, " %.1fs, %.0f orders/s, %d kills\n", r.elapsed.Seconds(), r.rate(), r.kills)
				if r.err != nil {
					fmt.Fprintf(os.Stderr, "chaos: %s: %v\n", w, r.err)
				}
				results = append(results, r)
			}
		}
	}
	report(o, results)
	fmt.Printf("load average at end: %s\n", runenv.LoadAverage())
	for _, r := range results {
		if r.err != nil {
			return fmt.Errorf("%s (chaos %v, round %d) failed: %w", r.worker, r.chaos, r.round, r.err)
		}
	}
	return ctx.Err()
}

func createTopics(ctx context.Context, brokers []string, partitions int32, topics ...string) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return err
	}
	defer cl.Close()
	resp, err := kadm.NewClient(cl).CreateTopics(ctx, partitions, 1, nil, topics...)
	if err != nil {
		return err
	}
	return resp.Error()
}

// runResult is one worker's run.
type runResult struct {
	worker  string
	chaos   bool
	round   int
	elapsed time.Duration // first produce to the last order applied
	orders  int
	kills   int
	// restarts are the incarnations started after a kill.
	restarts []*incarnation
	err      error
}

func (r *runResult) rate() float64 {
	if r.elapsed <= 0 {
		return 0
	}
	return float64(r.orders) / r.elapsed.Seconds()
}

// incarnation is one process of a member.
type incarnation struct {
	member, n int
	app       string // application_name of its database sessions
	started   time.Time
	cmd       *exec.Cmd
	exited    chan struct{}
	logPath   string

	mu        sync.Mutex
	firstLog  time.Duration // arrival of its first-commit log line, since start; 0: none
	firstSQL  time.Duration // its first order row's insert time, since start; 0: none
	killed    bool
	timeline  []string // its log lines until the first commit, with arrival times
	sinceRun  string   // the since_start of the first-commit line
	exitError error
}

// driver runs one worker's run.
type driver struct {
	o       options
	sched   schedule
	admin   *pgxpool.Pool
	brokers []string
	self    string
	bin     string
	res     *runResult

	name, schema, topic, group string
	dbURL                      *url.URL

	mu    sync.Mutex
	live  []*incarnation // by member
	all   []*incarnation
	incNo int
}

func uniqueName(prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return prefix + "_" + hex.EncodeToString(b[:])
}

func (d *driver) run(ctx context.Context) {
	r := d.res
	r.orders = d.o.orders
	kind := "calm"
	if r.chaos {
		kind = "chaos"
	}
	d.name = uniqueName("chaos_" + r.worker + "_" + kind)
	d.schema, d.topic, d.group = d.name, strings.ReplaceAll(d.name, "_", "-"), d.name
	u, err := url.Parse(d.o.dbURL)
	if err != nil {
		r.err = fmt.Errorf("-database-url must be a URL: %w", err)
		return
	}
	d.dbURL = u
	if err := d.prepare(ctx); err != nil {
		r.err = err
		return
	}
	defer d.drop()
	if err := createTopics(ctx, d.brokers, int32(d.o.partitions), d.topic); err != nil {
		r.err = err
		return
	}
	if err := createTopics(ctx, d.brokers, 1, dlq.DefaultTopic(d.topic)); err != nil {
		r.err = err
		return
	}

	d.live = make([]*incarnation, d.o.members)
	for m := range d.o.members {
		if err := d.start(ctx, m); err != nil {
			r.err = err
			d.stopAll()
			return
		}
	}
	defer d.stopAll()
	if err := runenv.WaitStable(ctx, d.brokers, d.group, d.topic, d.o.members, d.o.partitions, 60*time.Second); err != nil {
		r.err = err
		return
	}

	runCtx, cancel := context.WithTimeout(ctx, d.o.timeout)
	defer cancel()
	start := time.Now()
	prodErr := make(chan error, 1)
	go func() { prodErr <- d.produce(runCtx, start) }()
	chaosDone := make(chan struct{})
	chaosCtx, stopChaos := context.WithCancel(runCtx)
	go func() {
		defer close(chaosDone)
		if r.chaos {
			d.chaos(chaosCtx, start)
		}
	}()
	applied, err := d.waitApplied(runCtx)
	stopChaos()
	<-chaosDone
	if perr := <-prodErr; perr != nil && err == nil {
		err = perr
	}
	if err != nil {
		r.err = fmt.Errorf("%w (%d of %d orders applied)", err, applied, d.o.orders)
		return
	}
	var last time.Time
	if err := d.admin.QueryRow(ctx, `SELECT max(inserted_at) FROM `+pgx.Identifier{d.schema, "orders"}.Sanitize()).Scan(&last); err != nil {
		r.err = err
		return
	}
	r.elapsed = last.Sub(start)
	d.stopAll()
	if err := d.firstCommits(ctx); err != nil {
		r.err = err
		return
	}
	store, err := orderload.NewStore(d.schema)
	if err == nil {
		_, err = store.Verify(ctx, d.admin, int64(d.o.orders))
	}
	r.err = err
}

// prepare creates the run's schema: oncely's tables and the example's, with
// the orders table's columns that say which process inserted a row, when.
func (d *driver) prepare(ctx context.Context) error {
	if _, err := d.admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{d.schema}.Sanitize()); err != nil {
		return err
	}
	m, err := migrations.New(d.admin, migrations.Config{Schema: d.schema})
	if err == nil {
		_, err = m.Up(ctx)
	}
	for _, stmt := range orderload.Tables(d.schema) {
		if err == nil {
			_, err = d.admin.Exec(ctx, stmt)
		}
	}
	return err
}

func (d *driver) drop() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, _ = d.admin.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{d.schema}.Sanitize()+" CASCADE")
}

// start starts member m's next process.
func (d *driver) start(ctx context.Context, m int) error {
	d.mu.Lock()
	d.incNo++
	inc := &incarnation{member: m, n: d.incNo, app: fmt.Sprintf("%s-m%d-%d", d.res.worker, m, d.incNo), exited: make(chan struct{})}
	d.mu.Unlock()
	u := *d.dbURL
	q := u.Query()
	q.Set("application_name", inc.app)
	u.RawQuery = q.Encode()
	var args []string
	var cmd *exec.Cmd
	instance := ""
	if d.o.static {
		instance = fmt.Sprintf("member-%d", m)
	}
	common := []string{"--brokers", strings.Join(d.brokers, ","), "--database-url", u.String(), "--schema", d.schema,
		"--group", d.group, "--topic", d.topic, "--session-timeout", d.o.sessionTimeout.String(),
		"--rebalance-timeout", d.o.rebalanceTimeout.String()}
	if instance != "" {
		common = append(common, "--instance-id", instance)
	}
	switch d.res.worker {
	case workerExample:
		args = append([]string{"run", "--http-addr", "127.0.0.1:0"}, common...)
		args = append(args, strings.Fields(d.o.workerFlags)...)
		cmd = exec.Command(d.bin, args...)
	case workerHand:
		args = append(append([]string{handArg}, common...), strings.Fields(d.o.handFlags)...)
		cmd = exec.Command(d.self, args...)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Env = append(os.Environ(), "DATABASE_URL=")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	inc.logPath = filepath.Join(d.o.logs, d.name+"-"+inc.app+".log")
	logf, err := os.Create(inc.logPath)
	if err != nil {
		return err
	}
	cmd.Stdout = logf
	inc.started = time.Now()
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", inc.app, err)
	}
	inc.cmd = cmd
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			at := time.Since(inc.started)
			line := sc.Text()
			fmt.Fprintf(logf, "+%-9s %s\n", at.Round(time.Millisecond), line)
			inc.mu.Lock()
			if inc.firstLog == 0 {
				inc.timeline = append(inc.timeline, fmt.Sprintf("+%s %s", at.Round(time.Millisecond), line))
				if strings.Contains(line, "first record committed") {
					inc.firstLog = at
					inc.sinceRun = logField(line, "since_start")
				}
			}
			inc.mu.Unlock()
		}
		inc.exitError = cmd.Wait()
		logf.Close()
		close(inc.exited)
	}()
	d.mu.Lock()
	d.live[m] = inc
	d.all = append(d.all, inc)
	d.mu.Unlock()
	return nil
}

// logField reads key=value from a slog text line.
func logField(line, key string) string {
	i := strings.Index(line, " "+key+"=")
	if i < 0 {
		return ""
	}
	v := line[i+len(key)+2:]
	if j := strings.IndexByte(v, ' '); j >= 0 {
		v = v[:j]
	}
	return v
}

// kill sends SIGKILL to member m's process and waits for it to exit.
func (d *driver) kill(m int) {
	d.mu.Lock()
	inc := d.live[m]
	d.mu.Unlock()
	if inc == nil {
		return
	}
	inc.mu.Lock()
	inc.killed = true
	inc.mu.Unlock()
	_ = inc.cmd.Process.Signal(syscall.SIGKILL)
	<-inc.exited
}

// stopAll stops every live process with SIGTERM (SIGKILL after 15s).
func (d *driver) stopAll() {
	d.mu.Lock()
	live := slices.Clone(d.live)
	for i := range d.live {
		d.live[i] = nil
	}
	d.mu.Unlock()
	for _, inc := range live {
		if inc != nil {
			_ = inc.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	for _, inc := range live {
		if inc == nil {
			continue
		}
		select {
		case <-inc.exited:
		case <-time.After(15 * time.Second):
			_ = inc.cmd.Process.Kill()
			<-inc.exited
		}
	}
}

// chaos kills a member on the schedule, members in turn, and restarts it
// at once.
func (d *driver) chaos(ctx context.Context, start time.Time) {
	for k, at := range d.sched.kills {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Until(start.Add(at))):
		}
		m := k % d.o.members
		d.kill(m)
		d.res.kills++
		if ctx.Err() != nil {
			return
		}
		if err := d.start(ctx, m); err != nil {
			fmt.Fprintf(os.Stderr, "chaos: restart member %d: %v\n", m, err)
			return
		}
		d.mu.Lock()
		d.res.restarts = append(d.res.restarts, d.live[m])
		d.mu.Unlock()
	}
}

// produce sends the schedule's deliveries evenly over -over, keyed by order
// id (franz-go's default partitioner), each with its order's message id.
func (d *driver) produce(ctx context.Context, start time.Time) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(d.brokers...), kgo.ProducerLinger(0), kgo.MaxBufferedRecords(100_000))
	if err != nil {
		return err
	}
	defer cl.Close()
	var (
		mu   sync.Mutex
		perr error
	)
	n := len(d.sched.deliveries)
	for j, del := range d.sched.deliveries {
		due := start.Add(time.Duration(float64(j) / float64(n) * float64(d.o.over)))
		if w := time.Until(due); w > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(w):
			}
		}
		o := d.sched.gen.Order(del.i, 0)
		v, err := json.Marshal(o)
		if err != nil {
			return err
		}
		cl.Produce(ctx, &kgo.Record{Topic: d.topic, Key: []byte(o.OrderID), Value: v,
			Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(orderload.MessageID(del.i))}}},
			func(_ *kgo.Record, err error) {
				if err != nil {
					mu.Lock()
					perr = cmp.Or(perr, err)
					mu.Unlock()
				}
			})
	}
	if err := cl.Flush(ctx); err != nil {
		return err
	}
	mu.Lock()
	defer mu.Unlock()
	return perr
}

// waitApplied polls the orders table until every order has a row.
func (d *driver) waitApplied(ctx context.Context) (int64, error) {
	q := `SELECT count(*) FROM ` + pgx.Identifier{d.schema, "orders"}.Sanitize()
	var n int64
	for {
		if err := d.admin.QueryRow(ctx, q).Scan(&n); err != nil {
			if ctx.Err() != nil {
				return n, fmt.Errorf("orders not all applied within %s", d.o.timeout)
			}
			return n, err
		}
		if n >= int64(d.o.orders) {
			return n, nil
		}
		select {
		case <-ctx.Done():
			return n, fmt.Errorf("orders not all applied within %s", d.o.timeout)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// firstCommits reads, for every process, when its first order row was
// inserted (its sessions carry its application_name into the app column).
func (d *driver) firstCommits(ctx context.Context) error {
	rows, err := d.admin.Query(ctx, `SELECT app, min(inserted_at) FROM `+pgx.Identifier{d.schema, "orders"}.Sanitize()+` GROUP BY app`)
	if err != nil {
		return err
	}
	first := map[string]time.Time{}
	var (
		app string
		at  time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&app, &at}, func() error { first[app] = at; return nil }); err != nil {
		return err
	}
	for _, inc := range d.all {
		if t, ok := first[inc.app]; ok {
			inc.mu.Lock()
			inc.firstSQL = t.Sub(inc.started)
			inc.mu.Unlock()
		}
	}
	return nil
}

// report prints every run, the ratios and the restart times.
func report(o options, rs []*runResult) {
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "worker\tchaos\tround\torders\tseconds\torders/s\tkills\trestarts committing\tfirst commit p50\tp90\tmax\t\tresult\t")
	for _, r := range rs {
		st := restartStats(r)
		status := "ok, verified exactly once"
		if r.err != nil {
			status = "FAILED: " + r.err.Error()
		}
		fmt.Fprintf(tw, "%s\t%v\t%d\t%d\t%.2f\t%.0f\t%d\t%s\t%s\t%s\t%s\t\t%s\t\n", r.worker, r.chaos, r.round, r.orders,
			r.elapsed.Seconds(), r.rate(), r.kills, st.counted, sec(st.p50), sec(st.p90), sec(st.max), status)
	}
	_ = tw.Flush()
	fmt.Printf("\nproduction rate: %.0f orders/s (%d orders over %s); a run at about that rate kept pace with production and "+
		"its ratios to slower runs are bounded by it.\n", float64(o.orders)/o.over.Seconds(), o.orders, o.over)
	fmt.Println("orders/s: orders over the time from the first produce to the insert of the last order's row (SQL). " +
		"first commit: from a restarted process's start to the insert of its first committed order row (SQL, application_name); " +
		"restarts committing: restarts whose process committed a record / restarts.")

	fmt.Println("\nRatios (per round; median):")
	rate := func(w string, chaos bool) []float64 {
		var v []float64
		for _, r := range rs {
			if r.worker == w && r.chaos == chaos && r.err == nil {
				v = append(v, r.rate())
			} else if r.worker == w && r.chaos == chaos {
				v = append(v, 0)
			}
		}
		return v
	}
	ratio := func(a, b []float64) (float64, string) {
		var each []string
		var vs []float64
		for i := range min(len(a), len(b)) {
			if a[i] <= 0 || b[i] <= 0 {
				return 0, "a run failed"
			}
			vs = append(vs, a[i]/b[i])
			each = append(each, fmt.Sprintf("%.2f", a[i]/b[i]))
		}
		if len(vs) == 0 {
			return 0, ""
		}
		slices.Sort(vs)
		med := vs[len(vs)/2]
		if len(vs)%2 == 0 {
			med = (vs[len(vs)/2-1] + med) / 2
		}
		return med, strings.Join(each, " ")
	}
	line := func(name string, target float64, a, b []float64) {
		v, each := ratio(a, b)
		status := "    "
		switch {
		case each == "":
			status = "not run"
		case target > 0 && v >= target:
			status = "PASS"
		case target > 0:
			status = "FAIL"
		}
		fmt.Printf("  %-7s %-58s %.2f [%s]\n", status, name, v, each)
	}
	line("example default / hand, under chaos (target >= 3)", 3, rate(workerExample, true), rate(workerHand, true))
	line("example default / hand, without chaos", 0, rate(workerExample, false), rate(workerHand, false))
	line("example default: chaos / no chaos", 0, rate(workerExample, true), rate(workerExample, false))
	line("hand: chaos / no chaos", 0, rate(workerHand, true), rate(workerHand, false))

	// The restart closest to the median, for each worker: where its time
	// to first commit went.
	for _, w := range []string{workerExample, workerHand} {
		var incs []*incarnation
		for _, r := range rs {
			if r.worker == w {
				for _, inc := range r.restarts {
					if inc.firstSQL > 0 {
						incs = append(incs, inc)
					}
				}
			}
		}
		if len(incs) == 0 {
			continue
		}
		slices.SortFunc(incs, func(a, b *incarnation) int { return cmp.Compare(a.firstSQL, b.firstSQL) })
		inc := incs[(len(incs)-1)/2]
		fmt.Printf("\n%s: the median restart (%s): first order row %s after start; its log until then:\n", w, inc.app, sec(inc.firstSQL))
		for _, l := range inc.timeline {
			fmt.Printf("    %s\n", l)
		}
		if inc.firstLog > 0 {
			fmt.Printf("  first-commit log line at +%s (since_start %s, the consumer's Run)\n", sec(inc.firstLog), inc.sinceRun)
		}
	}
}

type rstats struct {
	counted       string
	p50, p90, max time.Duration
}

func restartStats(r *runResult) rstats {
	var ds []time.Duration
	for _, inc := range r.restarts {
		inc.mu.Lock()
		if inc.firstSQL > 0 {
			ds = append(ds, inc.firstSQL)
		}
		inc.mu.Unlock()
	}
	s := rstats{counted: fmt.Sprintf("%d/%d", len(ds), len(r.restarts))}
	if len(ds) == 0 {
		return s
	}
	slices.Sort(ds)
	at := func(p float64) time.Duration { return ds[min(len(ds)-1, int(math.Ceil(p*float64(len(ds))))-1)] }
	s.p50, s.p90, s.max = at(0.5), at(0.9), ds[len(ds)-1]
	return s
}

func sec(d time.Duration) string {
	if d <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fs", d.Seconds())
}
