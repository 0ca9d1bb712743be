package oncely

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/oncely/oncely/migrations"
)

// Run starts the HTTP servers, migrates if asked, checks the schema and the
// topics, runs every component until ctx is done or one of them fails, and
// then shuts down in order (see the package documentation). It returns nil
// after a shutdown asked for through ctx, including one during start-up.
// Run may be called once.
func (r *Runner) Run(ctx context.Context) error {
	r.mu.Lock()
	if r.ran {
		r.mu.Unlock()
		return errors.New("oncely: Run called more than once")
	}
	r.ran = true
	r.mu.Unlock()
	defer r.setPhase(&phaseStopped)
	if err := r.listen(ctx); err != nil {
		return err
	}

	s := &supervisor{stopping: make(chan struct{})}
	defer context.AfterFunc(ctx, func() { s.stop("", nil) })()
	// Components run on contexts without ctx's cancellation (its values,
	// such as test hooks, stay): each is stopped at its turn.
	base := context.WithoutCancel(ctx)

	var httpWG sync.WaitGroup
	for _, srv := range r.servers {
		goWG(&httpWG, func() {
			if err := srv.srv.Serve(srv.ln); !errors.Is(err, http.ErrServerClosed) {
				s.stop("http server", err)
			}
		})
	}

	startCtx, cancelStart := context.WithCancel(ctx)
	stopStart := context.AfterFunc(s.ctx(base), cancelStart)
	err := r.start(startCtx)
	stopStart()
	cancelStart()
	switch {
	case err != nil && ctx.Err() == nil && !s.isStopping():
		s.stop("start", err)
	case err != nil: // asked to stop while starting: nothing to report
		s.stop("", nil)
	}

	var consumers sync.WaitGroup
	consumerCtx, stopConsumers := context.WithCancel(base)
	defer stopConsumers()
	relayDone := make(chan struct{})
	relayCtx, stopRelay := context.WithCancel(base)
	defer stopRelay()
	var loops sync.WaitGroup
	loopCtx, stopLoops := context.WithCancel(base)
	defer stopLoops()
	if !s.isStopping() {
		r.startComponents(s, consumerCtx, &consumers, relayCtx, relayDone, loopCtx, &loops)
	} else {
		close(relayDone)
	}

	<-s.stopping
	r.setPhase(&phaseStopping)
	deadline := time.Now().Add(r.cfg.ShutdownTimeout)
	stopLoops()
	httpDone := r.stopServers(deadline.Add(-r.cfg.RelayFlushTimeout))
	stopConsumers()
	consumers.Wait()
	<-httpDone
	r.flush(relayDone, deadline)
	stopRelay()
	<-relayDone
	loops.Wait()
	httpWG.Wait()
	if r.ownMeter != nil {
		fctx, cancel := context.WithTimeout(base, time.Second)
		defer cancel()
		if err := r.ownMeter.Shutdown(fctx); err != nil {
			r.cfg.Logger.Warn("oncely: meter provider shutdown", "err", err)
		}
	}
	return s.err()
}

// supervisor collects the components' failures; the first failure, or the
// end of Run's context, starts the shutdown.
type supervisor struct {
	stopping chan struct{}
	once     sync.Once
	mu       sync.Mutex
	errs     []error
}

// stop starts the shutdown; a non-nil err is one of Run's errors.
func (s *supervisor) stop(name string, err error) {
	if err != nil {
		s.mu.Lock()
		s.errs = append(s.errs, fmt.Errorf("oncely: %s: %w", name, err))
		s.mu.Unlock()
	}
	s.once.Do(func() { close(s.stopping) })
}

func (s *supervisor) isStopping() bool {
	select {
	case <-s.stopping:
		return true
	default:
		return false
	}
}

// ctx returns a context, derived from parent, that ends when the shutdown
// begins.
func (s *supervisor) ctx(parent context.Context) context.Context {
	ctx, cancel := context.WithCancel(parent)
	go func() {
		defer cancel()
		select {
		case <-s.stopping:
		case <-ctx.Done():
		}
	}()
	return ctx
}

func (s *supervisor) err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return errors.Join(s.errs...)
}

// exited is how a component's end is reported: an error, or an end before
// the shutdown asked for it, stops the runner.
func (s *supervisor) exited(name string, err error) {
	if err == nil && !s.isStopping() {
		err = errors.New("stopped before the shutdown")
	}
	if err != nil {
		s.stop(name, err)
	}
}

func (r *Runner) setPhase(p *string) { r.phase.Store(p) }

// start migrates if asked, runs BeforeStart and checks the schema and the
// topics.
func (r *Runner) start(ctx context.Context) error {
	m, err := migrations.New(r.cfg.Pool, migrations.Config{Schema: r.cfg.Schema, Logger: r.cfg.Logger})
	if err != nil {
		return err
	}
	if r.cfg.Migrate {
		r.setPhase(&phaseMigrating)
		if _, err := m.Up(ctx); err != nil {
			return err
		}
	}
	if r.cfg.BeforeStart != nil {
		r.setPhase(&phaseSetup)
		if err := r.cfg.BeforeStart(ctx); err != nil {
			return fmt.Errorf("BeforeStart: %w", err)
		}
	}
	r.setPhase(&phaseChecking)
	pending, err := m.Pending(ctx)
	if err != nil {
		return err
	}
	if len(pending) > 0 {
		names := make([]string, len(pending))
		for i, p := range pending {
			names[i] = fmt.Sprintf("%04d_%s", p.Version, p.Name)
		}
		return fmt.Errorf("%w: schema %q lacks %s: set Config.Migrate, or apply them (package migrations, `oncely migrate up --schema %s`)",
			ErrNotMigrated, r.cfg.Schema, strings.Join(names, ", "), r.cfg.Schema)
	}
	// A missing topic is a configuration error; brokers that do not answer
	// are waited for, as the components would.
	for {
		missing, err := r.checkTopics(ctx, nil)
		switch {
		case len(missing) > 0:
			return fmt.Errorf("%w: %s", ErrMissingTopic, reasonList(missing))
		case err == nil:
			return nil
		case errors.Is(err, ErrInvalidConfig):
			return err
		case ctx.Err() != nil:
			return ctx.Err()
		}
		r.cfg.Logger.Warn("oncely: cannot check the topics yet; retrying", "err", err)
		waiting := "starting: waiting for the brokers to list the topics: " + err.Error()
		r.setPhase(&waiting)
		t := time.NewTimer(r.cfg.HealthInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// ErrNotMigrated is wrapped by Run's error when the schema lacks a migration.
var ErrNotMigrated = errors.New("oncely: the schema is not migrated")

// ErrMissingTopic is wrapped by Run's error when a consumed topic or its
// dead-letter topic does not exist.
var ErrMissingTopic = errors.New("oncely: missing topic")

func (r *Runner) startComponents(s *supervisor, consumerCtx context.Context, consumers *sync.WaitGroup,
	relayCtx context.Context, relayDone chan struct{}, loopCtx context.Context, loops *sync.WaitGroup) {
	for _, e := range r.consumers {
		goWG(consumers, func() { s.exited(fmt.Sprintf("consumer group %q", e.group), e.c.Run(consumerCtx)) })
	}
	for _, e := range r.workers {
		goWG(consumers, func() { s.exited(e.name, e.w.Run(consumerCtx)) })
	}
	if r.relay != nil {
		go func() {
			defer close(relayDone)
			s.exited("outbox relay", r.relay.Run(relayCtx))
		}()
	} else {
		close(relayDone)
	}
	for _, l := range r.loops {
		goWG(loops, func() { s.exited(l.name, l.run(loopCtx)) })
	}
	goWG(loops, func() { r.watch(loopCtx) })
	r.started.Store(true)
	r.setPhase(&phaseRunning)
	r.cfg.Logger.Info("oncely runner started", "schema", r.cfg.Schema, "consumers", len(r.consumers), "workers", len(r.workers), "relay", r.relay != nil)
}

// stopServers shuts the HTTP servers down, giving their requests until
// deadline, and returns once every listener is closed; the channel it
// returns is closed once the servers have stopped.
func (r *Runner) stopServers(deadline time.Time) <-chan struct{} {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for _, s := range r.servers {
		goWG(&wg, func() {
			ctx, cancel := context.WithDeadline(context.Background(), deadline)
			defer cancel()
			if err := s.srv.Shutdown(ctx); err != nil {
				// Cancels the requests still running: those not committed
				// yet roll back, and their clients' retries run afresh.
				_ = s.srv.Close()
			}
		})
	}
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	for _, s := range r.servers {
		select {
		case <-s.ln.closed:
		case <-t.C:
		}
	}
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}

// flush waits, up to RelayFlushTimeout and no later than deadline, until
// the outbox has no pending row or the relay stopped.
func (r *Runner) flush(relayDone <-chan struct{}, deadline time.Time) {
	if r.relay == nil {
		return
	}
	by := time.Now().Add(r.cfg.RelayFlushTimeout)
	if deadline.Before(by) {
		by = deadline
	}
	ctx, cancel := context.WithDeadline(context.Background(), by)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		st, err := r.outbox.Status(ctx, r.cfg.Pool)
		if err == nil && st.Pending == 0 {
			return
		}
		select {
		case <-relayDone:
			return
		case <-ctx.Done():
			r.cfg.Logger.Warn("oncely: rows left in the outbox at shutdown; the next relay to run publishes them", "pending", st.Pending, "err", err)
			return
		case <-tick.C:
		}
	}
}

// goWG runs f in a goroutine that wg waits for.
func goWG(wg *sync.WaitGroup, f func()) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		f()
	}()
}
