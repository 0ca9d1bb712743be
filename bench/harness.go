package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"
)

// result is one mode's line in the table.
type result struct {
	mode    string
	records int           // records in the throughput phase
	elapsed time.Duration // throughput phase
	// latencies of the latency phase's records (see kafkaMode), or of the
	// ceiling's transactions.
	latencies []time.Duration
	perTx     float64 // records per committed transaction in the throughput phase
	cpu       cpuUse  // CPU time of the throughput phase
	note      string
	rss       *rssReport
	err       error
}

func (r result) rate() float64 {
	if r.elapsed <= 0 {
		return 0
	}
	return float64(r.records) / r.elapsed.Seconds()
}

// kafkaRun is what a consumer under test is given.
type kafkaRun struct {
	env   *env
	db    *db
	topic string
	group string
	w     workload
}

// kafkaMode is a consumer measured against a pre-produced backlog, then
// against records produced at a steady rate.
type kafkaMode struct {
	name  string
	w     workload
	conns int32 // the pool's connections
	inbox bool  // the mode writes inbox rows: verify them
	// latencyRecords records are produced at latencyRate per second after
	// the backlog has drained; their commit latencies are the p50 and p99.
	latencyRecords int
	latencyRate    float64
	// run consumes the topic until ctx is cancelled.
	run func(ctx context.Context, k kafkaRun) error
	// sample, when set, runs alongside the throughput phase (RSS sampling).
	sample func(ctx context.Context) func() *rssReport
}

// runKafka measures one Kafka mode on a fresh schema and topic:
//
//  1. records [0, n) are produced before the consumer starts;
//  2. throughput is n over the time from the first statement of the first
//     transaction to the commit of the n-th record (the group join is not
//     counted);
//  3. then latencyRecords more are produced at latencyRate per second, and
//     each one's latency is its commit time minus its produce time;
//  4. the consumer stops and the database is verified.
func (e *env) runKafka(ctx context.Context, m kafkaMode) (res result) {
	res = result{mode: m.name, records: m.w.records}
	d, err := e.newDB(ctx, m.name, m.conns)
	if err != nil {
		res.err = err
		return res
	}
	defer d.close(ctx, e.admin)
	topic, err := e.newTopic(ctx, m.name, m.w.partitions)
	if err != nil {
		res.err = err
		return res
	}
	defer e.deleteTopic(ctx, topic)
	p, err := e.newProducer(topic, m.w)
	if err != nil {
		res.err = err
		return res
	}
	defer p.close()
	if err := p.backlog(ctx, 0, m.w.records); err != nil {
		res.err = err
		return res
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	k := kafkaRun{env: e, db: d, topic: topic, group: uniqueName("bench"), w: m.w}
	var sampled func() *rssReport
	if m.sample != nil {
		sampled = m.sample(runCtx)
	}
	var runErr error
	done := make(chan struct{})
	meter := e.cpuMeter(d)
	cpuStart := meter.read()
	d.rec.arm()
	go func() {
		defer close(done)
		runErr = m.run(runCtx, k)
	}()
	stopRun := func() error {
		stop()
		<-done
		return runErr
	}

	if e.opts.progress {
		go func() {
			t := time.NewTicker(time.Second)
			defer t.Stop()
			for {
				select {
				case <-runCtx.Done():
					return
				case <-t.C:
					fmt.Fprintf(os.Stderr, " %d", d.rec.done.Load())
				}
			}
		}()
	}
	if err := waitCommitted(d.rec.expect(int64(m.w.records)), done, e.opts.timeout); err != nil {
		res.err = fmt.Errorf("throughput phase: %w", errors.Join(err, stopRun()))
		return res
	}
	res.cpu = meter.read().since(cpuStart)
	res.elapsed = time.Duration(d.rec.lastDone.Load() - d.rec.firstTx.Load())
	res.perTx = float64(m.w.records) / float64(max(d.rec.txs.Load(), 1))
	if sampled != nil {
		res.rss = sampled()
	}

	total := m.w.records + m.latencyRecords
	reached := d.rec.expectLatencies(int64(total))
	if err := p.paced(ctx, m.w.records, total, m.latencyRate); err != nil {
		res.err = fmt.Errorf("latency phase: %w", errors.Join(err, stopRun()))
		return res
	}
	if err := waitCommitted(reached, done, e.opts.timeout); err != nil {
		res.err = fmt.Errorf("latency phase: %w", errors.Join(err, stopRun()))
		return res
	}
	res.latencies = d.rec.latencies()
	if err := stopRun(); err != nil && !errors.Is(err, context.Canceled) {
		res.err = fmt.Errorf("consumer: %w", err)
		return res
	}
	if _, err := d.verify(ctx, int64(total), m.inbox, true); err != nil {
		res.err = err
	}
	return res
}

// waitCommitted waits for reached, failing early if the consumer stopped.
func waitCommitted(reached, stopped <-chan struct{}, timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-reached:
		return nil
	case <-stopped:
		return errors.New("consumer stopped early")
	case <-t.C:
		return fmt.Errorf("records not committed within %s", timeout)
	}
}
