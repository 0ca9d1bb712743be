package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
)

// ceilingBatch is the raw-SQL ceiling's records per transaction.
const ceilingBatch = 500

// runCeiling writes the inbox rows and effect rows of w's records without
// Kafka: transactions of ceilingBatch records (one multi-row inbox claim, one
// multi-row effect insert), on every connection of the pool at once. Its
// latency is a transaction's, from BEGIN to the end of COMMIT.
func (e *env) runCeiling(ctx context.Context, w workload, conns int32) (res result) {
	res = result{mode: "raw-SQL ceiling", records: w.records, note: fmt.Sprintf("batches of %d, %d conns", ceilingBatch, conns)}
	d, err := e.newDB(ctx, "ceiling", conns)
	if err != nil {
		res.err = err
		return res
	}
	defer d.close(ctx, e.admin)
	inbox, err := dedup.New(dedup.Config{Schema: d.schema})
	if err != nil {
		res.err = err
		return res
	}
	group := uniqueName("bench")

	var (
		next    atomic.Int64
		mu      sync.Mutex
		samples []time.Duration
		errs    = make([]error, conns)
		wg      sync.WaitGroup
	)
	meter := e.cpuMeter(d)
	cpuStart := meter.read()
	start := time.Now()
	for c := range int(conns) {
		wg.Go(func() {
			for {
				from := int(next.Add(ceilingBatch)) - ceilingBatch
				if from >= w.records {
					return
				}
				t0 := time.Now()
				if err := pgx.BeginFunc(ctx, d.pool, func(tx pgx.Tx) error {
					return ceilingTx(ctx, tx, d, inbox, group, w, from, min(from+ceilingBatch, w.records))
				}); err != nil {
					errs[c] = err
					return
				}
				mu.Lock()
				samples = append(samples, time.Since(t0))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	res.elapsed = time.Since(start)
	res.cpu = meter.read().since(cpuStart)
	if res.err = errors.Join(errs...); res.err != nil {
		return res
	}
	res.latencies = samples
	res.perTx = float64(w.records) / float64(max(len(samples), 1))
	_, res.err = d.verify(ctx, int64(w.records), true, false)
	return res
}

// ceilingTx claims records [from, to) in the inbox and inserts their effects.
func ceilingTx(ctx context.Context, tx pgx.Tx, d *db, inbox *dedup.Inbox, group string, w workload, from, to int) error {
	items := make([]item, to-from)
	entries := make([]dedup.Entry, to-from)
	for j := range items {
		i := from + j
		id, key := w.record(i)
		items[j] = item{id: id, key: key, part: w.partition(i), off: int64(i), amount: amountOf(i)}
		entries[j] = dedup.Entry{MessageID: id, Topic: "ceiling", Partition: items[j].part, Offset: items[j].off}
	}
	if _, err := inbox.ClaimMany(ctx, tx, group, entries); err != nil {
		return err
	}
	return d.applyEffects(ctx, tx, items)
}

// runNaive is an at-least-once consumer without an inbox (see naiveConsumer).
func runNaive(ctx context.Context, k kafkaRun) error { return naiveConsumer(ctx, k, false) }

// runNaiveInbox is the naive consumer with the hand-written inbox insert of
// the Watermill mode first in each transaction: what the inbox itself costs
// the database, without oncely's machinery.
func runNaiveInbox(ctx context.Context, k kafkaRun) error { return naiveConsumer(ctx, k, true) }

// naiveConsumer is an at-least-once consumer, written the way
// franz-go's own examples consume a partition per goroutine: the poll loop
// hands each partition's slice of a fetch to that partition's goroutine
// (through a channel of five slices), which runs one transaction per record
// with only the effect insert and then marks the record; marked offsets are
// committed every second (AutoCommitMarks) and on shutdown. A crash between
// a transaction's commit and the offset commit applies the record again.
func naiveConsumer(ctx context.Context, k kafkaRun, inbox bool) error {
	claim := handClaim(k)
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(k.env.brokers...),
		kgo.ConsumerGroup(k.group),
		kgo.ConsumeTopics(k.topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(time.Second),
		kgo.BlockRebalanceOnPoll(),
		kgo.FetchMaxWait(500*time.Millisecond),
	)
	if err != nil {
		return err
	}
	defer cl.CloseAllowingRebalance()

	workCtx, stopWork := context.WithCancel(ctx)
	defer stopWork()
	var (
		wg      sync.WaitGroup
		workers = map[int32]chan []*kgo.Record{}
		failed  = make(chan error, 1)
	)
	stop := func() error {
		for _, ch := range workers {
			close(ch)
		}
		wg.Wait()
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		return cl.CommitMarkedOffsets(cctx)
	}
	for {
		fetches := cl.PollFetches(ctx)
		if ctx.Err() != nil || fetches.IsClientClosed() {
			return stop()
		}
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			ch := workers[p.Partition]
			if ch == nil {
				ch = make(chan []*kgo.Record, 5)
				workers[p.Partition] = ch
				wg.Go(func() {
					for recs := range ch {
						for _, rec := range recs {
							if workCtx.Err() != nil {
								break // stopping: leave the rest unmarked
							}
							if err := naiveRecord(workCtx, k.db, claim, inbox, rec); err != nil {
								select {
								case failed <- err:
								default:
								}
								stopWork()
								break
							}
							cl.MarkCommitRecords(rec)
						}
					}
				})
			}
			select {
			case ch <- p.Records:
			case <-workCtx.Done():
			}
		})
		cl.AllowRebalance()
		select {
		case err := <-failed:
			return errors.Join(err, stop())
		default:
		}
	}
}

func naiveRecord(ctx context.Context, d *db, claim func(context.Context, pgx.Tx, item) (bool, error), inbox bool, rec *kgo.Record) error {
	id, _ := headerValue(rec, consumer.DefaultMessageIDHeader)
	it, err := itemOf(id, rec)
	if err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, d.pool, func(tx pgx.Tx) error {
		if inbox {
			if fresh, err := claim(ctx, tx, it); err != nil || !fresh {
				return err // a duplicate commits nothing new
			}
		}
		return d.applyEffect(ctx, tx, it)
	})
}

func headerValue(rec *kgo.Record, key string) (string, bool) {
	for _, h := range rec.Headers {
		if h.Key == key {
			return string(h.Value), true
		}
	}
	return "", false
}

// oncelyConfig is the consumer configuration every oncely mode starts from.
func oncelyConfig(k kafkaRun) consumer.Config {
	return consumer.Config{
		Brokers: k.env.brokers,
		Topics:  []string{k.topic},
		Group:   k.group,
		Pool:    k.db.pool,
		Schema:  k.db.schema,
		// 0: the consumer's default.
		FetchMaxWait: k.env.opts.fetchMaxWait,
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			it, err := itemOf(msg.ID, msg.Record)
			if err != nil {
				return err
			}
			return k.db.applyEffect(ctx, tx, it)
		},
	}
}

// runOncely runs an oncely consumer with cfg until ctx is cancelled.
func runOncely(ctx context.Context, cfg consumer.Config) error {
	c, err := consumer.New(cfg)
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// runOncelyPerRecord is oncely's default: one transaction per record.
func runOncelyPerRecord(ctx context.Context, k kafkaRun) error {
	return runOncely(ctx, oncelyConfig(k))
}
