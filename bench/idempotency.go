package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/oncely/oncely/bench/internal/runenv"
	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/idempotency/redisstore"
	"github.com/oncely/oncely/internal/handredis"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/migrations"
)

// idemCommand is the argument that selects the Idempotency-Key benchmark:
//
//	cd bench && go run . idempotency [flags]
const idemCommand = "idempotency"

// The stores it compares.
const (
	idemPostgres = "postgres"
	idemRedis    = "redis"
	idemHand     = "hand" // internal/handredis: GET, SET NX, SET, DEL
)

type idemOptions struct {
	dbURL, redisAddr string
	n, concurrency   int
	rounds           int
	conns            int32
	only             string
	cpuProfile       string
}

// idemPhase is one timed phase of one store: n requests, each a first
// request of its key ("first") or a retry of an already recorded key
// ("replay").
type idemPhase struct {
	rate float64       // requests/s
	p99  time.Duration // of one request's ServeHTTP
	cpu  time.Duration // per request: this process and the store's server (Redis, or the pool's Postgres backends)
}

// runIdempotency measures the middleware on its three stores in one run:
// each round, for each store, n keyed POSTs with fresh keys from
// concurrency goroutines (the handler's effect: an atomic counter, so the
// store is what is measured), then the same n keys again (all replays).
// Requests go straight to ServeHTTP: no HTTP client or socket in between.
func runIdempotency(args []string) error {
	var o idemOptions
	fs := flag.NewFlagSet(idemCommand, flag.ExitOnError)
	fs.StringVar(&o.dbURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "Postgres of the Postgres store (a fresh schema, dropped afterwards)")
	fs.StringVar(&o.redisAddr, "redis", cmp.Or(os.Getenv("REDIS_ADDR"), "127.0.0.1:6379"), "Redis of the Redis store and the hand-written version (a fresh key prefix, deleted afterwards)")
	fs.IntVar(&o.n, "n", 2000, "requests per phase and store")
	fs.IntVar(&o.concurrency, "concurrency", 16, "goroutines sending requests")
	fs.IntVar(&o.rounds, "rounds", 21, "rounds; the table shows medians, the target the median of each round's ratio (many short rounds: the stores share the machine's load alike)")
	var conns int
	fs.StringVar(&o.only, "store", "", "measure this store alone ("+idemPostgres+", "+idemRedis+" or "+idemHand+"); default all three, with their ratios")
	fs.IntVar(&conns, "conns", 16, "Postgres pool size (each in-flight request of the Postgres store holds a connection)")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the timed phases to this file (with -store, of that store alone)")
	_ = fs.Parse(args)
	o.conns = int32(conns)
	if o.n <= 0 || o.concurrency <= 0 || o.rounds <= 0 || o.conns <= 0 {
		return errors.New("idempotency: -n, -concurrency, -rounds and -conns must be positive")
	}
	ctx := context.Background()

	schema := uniqueName("bench_idem")
	pcfg, err := pgxpool.ParseConfig(o.dbURL)
	if err != nil {
		return err
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = schema
	pcfg.MaxConns, pcfg.MinConns = o.conns, o.conns
	var pgBackends backends
	pcfg.AfterConnect = func(_ context.Context, c *pgx.Conn) error {
		pgBackends.add(c.PgConn().PID())
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+sqlident.Quote(schema)); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	defer func() { _, _ = pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+sqlident.Quote(schema)+" CASCADE") }()
	mig, err := migrations.New(pool, migrations.Config{Schema: schema})
	if err != nil {
		return err
	}
	if _, err := mig.Up(ctx); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}

	rdb := redis.NewClient(&redis.Options{Addr: o.redisAddr, PoolSize: 2 * o.concurrency})
	defer rdb.Close()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis at %s: %w", o.redisAddr, err)
	}
	redisPID := 0 // Redis's CPU counts when it runs on this machine
	if info, err := rdb.InfoMap(ctx, "server").Result(); err == nil {
		redisPID, _ = strconv.Atoi(info["Server"]["process_id"])
	}
	serverCPU := map[string]func() time.Duration{
		idemPostgres: pgBackends.cpu,
		idemRedis:    func() time.Duration { return procCPU(redisPID) },
		idemHand:     func() time.Duration { return procCPU(redisPID) },
	}
	prefix := "oncely-bench:" + uniqueName("idem") + ":"
	defer deleteRedisPrefix(context.WithoutCancel(ctx), rdb, prefix)

	handlers := map[string]http.Handler{}
	var effects atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		effects.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"` + strconv.FormatInt(effects.Load(), 10) + `"}`))
	})
	pg, err := idempotency.New(pool, idempotency.Config{Schema: schema})
	if err != nil {
		return err
	}
	handlers[idemPostgres] = pg.Require(h)
	store, err := redisstore.New(rdb, redisstore.Config{Prefix: prefix + "store:"})
	if err != nil {
		return err
	}
	rs, err := idempotency.NewWithStore(store, idempotency.Config{})
	if err != nil {
		return err
	}
	handlers[idemRedis] = rs.Require(h)
	handlers[idemHand] = (&handredis.Middleware{RDB: rdb, Prefix: prefix + "hand:", LockTTL: 30 * time.Second, TTL: 24 * time.Hour}).Handler(h)

	stores := []string{idemPostgres, idemRedis, idemHand}
	if o.only != "" {
		stores = []string{o.only}
	}
	results := map[string][2][]idemPhase{}
	fmt.Printf("idempotency benchmark: %d requests per phase, %d goroutines, %d rounds, load average %s\n", o.n, o.concurrency, o.rounds, runenv.LoadAverage())
	if o.only != "" && handlers[o.only] == nil {
		return fmt.Errorf("idempotency: -store %q: want %s, %s or %s", o.only, idemPostgres, idemRedis, idemHand)
	}
	var ratios [2][]float64 // per round: Redis store / hand-written, first requests and replays
	stopProfile, err := startCPUProfile(o.cpuProfile)
	if err != nil {
		return fmt.Errorf("idempotency: cpu profile: %w", err)
	}
	defer stopProfile()
	for round := range o.rounds {
		// Each round starts with another store, so that none always runs
		// on the machine the previous one warmed up (or loaded).
		order := append(slices.Clone(stores[round%len(stores):]), stores[:round%len(stores)]...)
		for _, s := range order {
			keys := fmt.Sprintf("r%d-%s-", round, s)
			before := effects.Load()
			first, err := idemRun(ctx, handlers[s], serverCPU[s], keys, o)
			if err != nil {
				return fmt.Errorf("%s first: %w", s, err)
			}
			replay, err := idemRun(ctx, handlers[s], serverCPU[s], keys, o)
			if err != nil {
				return fmt.Errorf("%s replay: %w", s, err)
			}
			if got := effects.Load() - before; got != int64(o.n) {
				return fmt.Errorf("%s: %d handler runs for %d keys sent twice, want %d", s, got, o.n, o.n)
			}
			r := results[s]
			r[0], r[1] = append(r[0], first), append(r[1], replay)
			results[s] = r
		}
		if o.only == "" {
			for ph := range ratios {
				ratios[ph] = append(ratios[ph], results[idemRedis][ph][round].rate/results[idemHand][ph][round].rate)
			}
		}
	}
	if o.only != "" {
		f, r := results[o.only][0], results[o.only][1]
		for i := range f {
			fmt.Printf("%s round %d: first %.0f/s p99 %s CPU %s; replay %.0f/s p99 %s CPU %s\n", o.only, i, f[i].rate, f[i].p99, f[i].cpu, r[i].rate, r[i].p99, r[i].cpu)
		}
		return nil
	}

	med := func(s string, phase int) idemPhase {
		ph := slices.Clone(results[s][phase])
		slices.SortFunc(ph, func(a, b idemPhase) int { return cmp.Compare(a.rate, b.rate) })
		p99s, cpus := make([]time.Duration, len(ph)), make([]time.Duration, len(ph))
		for i, x := range ph {
			p99s[i], cpus[i] = x.p99, x.cpu
		}
		slices.Sort(p99s)
		slices.Sort(cpus)
		return idemPhase{rate: ph[len(ph)/2].rate, p99: p99s[len(p99s)/2], cpu: cpus[len(cpus)/2]}
	}
	fmt.Printf("\n%-10s %12s %10s %10s %13s %10s %10s %12s %12s\n", "store", "first req/s", "first p99", "first CPU", "replay req/s", "replay p99", "replay CPU", "first ×hand", "replay ×hand")
	hand := [2]idemPhase{med(idemHand, 0), med(idemHand, 1)}
	for _, s := range stores {
		f, r := med(s, 0), med(s, 1)
		fmt.Printf("%-10s %12.0f %10s %10s %13.0f %10s %10s %12.2f %12.2f\n", s,
			f.rate, f.p99.Round(10*time.Microsecond), f.cpu.Round(time.Microsecond),
			r.rate, r.p99.Round(10*time.Microsecond), r.cpu.Round(time.Microsecond),
			f.rate/hand[0].rate, r.rate/hand[1].rate)
	}
	fmt.Println("(CPU: per request, this process plus the store's server processes: Redis, or the pool's Postgres backends)")
	fmt.Println()
	for ph, name := range []string{"first requests", "replays"} {
		slices.Sort(ratios[ph])
		ratio := ratios[ph][len(ratios[ph])/2]
		verdict := "met"
		if ratio < 1 {
			verdict = "NOT met"
		}
		fmt.Printf("target: Redis store %s ≥ 1× the hand-written version (median of the rounds' ratios %.2f): %.2f× (%s)\n", name, ratios[ph], ratio, verdict)
	}
	return nil
}

// idemRun sends o.n keyed POSTs (keys prefix0 .. prefix<n-1>) from
// o.concurrency goroutines and times them; server returns the CPU time of
// the store's server processes so far.
func idemRun(ctx context.Context, h http.Handler, server func() time.Duration, prefix string, o idemOptions) (idemPhase, error) {
	cpu0 := selfCPU() + server()
	lat := make([]time.Duration, o.n)
	var next atomic.Int64
	var failed atomic.Value
	var wg sync.WaitGroup
	start := time.Now()
	for range o.concurrency {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= o.n {
					return
				}
				req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/orders", strings.NewReader(`{"sku":"A-1","qty":1}`))
				req.Header.Set("Idempotency-Key", prefix+strconv.Itoa(i))
				req = req.WithContext(idempotency.WithClient(req.Context(), "bench"))
				w := httptest.NewRecorder()
				t0 := time.Now()
				h.ServeHTTP(w, req)
				lat[i] = time.Since(t0)
				if w.Code != http.StatusCreated {
					failed.Store(fmt.Sprintf("key %d: status %d: %s", i, w.Code, w.Body))
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	cpu := selfCPU() + server() - cpu0
	if f := failed.Load(); f != nil {
		return idemPhase{}, errors.New(f.(string))
	}
	slices.Sort(lat)
	return idemPhase{rate: float64(o.n) / elapsed.Seconds(), p99: lat[len(lat)*99/100], cpu: cpu / time.Duration(o.n)}, nil
}

func deleteRedisPrefix(ctx context.Context, rdb *redis.Client, prefix string) {
	iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	var batch []string
	for iter.Next(ctx) {
		if batch = append(batch, iter.Val()); len(batch) == 1000 {
			rdb.Del(ctx, batch...)
			batch = batch[:0]
		}
	}
	if len(batch) > 0 {
		rdb.Del(ctx, batch...)
	}
}
