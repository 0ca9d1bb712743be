package orderload

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
)

// HandConfig configures the hand-written worker.
type HandConfig struct {
	Brokers    []string
	Topic      string
	Group      string
	InstanceID string // static membership when set
	// SessionTimeout and RebalanceTimeout: franz-go's defaults when zero.
	SessionTimeout, RebalanceTimeout time.Duration
	Pool                             *pgxpool.Pool
	Store                            *Store
	// Applied, when set, is called inside each record's transaction after
	// its effects, before the commit (the benchmark notes the record there).
	Applied func(tx pgx.Tx, o Order)
	// Committed, when set, is called after each record's transaction
	// committed (the chaos worker logs its first).
	Committed func()
	// Assigned, when set, is called with the partitions the group assigns
	// (the chaos worker logs when they arrive).
	Assigned func(map[string][]int32)
	// Opts are extra franz-go options.
	Opts []kgo.Opt
}

// Hand is the hand-written baseline: franz-go and pgx without oncely's
// consumer, written the way franz-go's examples consume a partition per
// goroutine. Per record one transaction: the inbox insert (ON CONFLICT DO
// NOTHING; a duplicate commits nothing else), the order row, the balance
// upsert, the event through oncely's outbox (what a user of the outbox
// writes), commit, then MarkCommitRecords; marked offsets are committed
// every second and on shutdown. A deadlock, a serialization failure or a
// lock timeout rolls the transaction back and runs it again, as a plain
// user would; any other error stops the worker.
type Hand struct {
	cfg     HandConfig
	retries atomic.Int64
}

// NewHand returns a hand-written worker.
func NewHand(cfg HandConfig) *Hand { return &Hand{cfg: cfg} }

// Retries is how many transactions were run again after contention.
func (h *Hand) Retries() int64 { return h.retries.Load() }

// Run consumes until ctx is cancelled.
func (h *Hand) Run(ctx context.Context) error {
	opts := []kgo.Opt{
		kgo.SeedBrokers(h.cfg.Brokers...),
		kgo.ConsumerGroup(h.cfg.Group),
		kgo.ConsumeTopics(h.cfg.Topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(time.Second),
		kgo.BlockRebalanceOnPoll(),
		kgo.FetchMaxWait(500 * time.Millisecond),
	}
	if h.cfg.InstanceID != "" {
		opts = append(opts, kgo.InstanceID(h.cfg.InstanceID))
	}
	if h.cfg.SessionTimeout > 0 {
		opts = append(opts, kgo.SessionTimeout(h.cfg.SessionTimeout))
	}
	if h.cfg.RebalanceTimeout > 0 {
		opts = append(opts, kgo.RebalanceTimeout(h.cfg.RebalanceTimeout))
	}
	if h.cfg.Assigned != nil {
		opts = append(opts, kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, m map[string][]int32) { h.cfg.Assigned(m) }))
	}
	cl, err := kgo.NewClient(append(opts, h.cfg.Opts...)...)
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
							if err := h.record(workCtx, rec); err != nil {
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

// record runs one record's transaction, again after contention.
func (h *Hand) record(ctx context.Context, rec *kgo.Record) error {
	o, err := Decode(rec.Value)
	if err != nil {
		return err
	}
	src := Source{Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset}
	for _, hd := range rec.Headers {
		if hd.Key == "message-id" {
			src.MessageID = string(hd.Value)
		}
	}
	for {
		err := pgx.BeginFunc(ctx, h.cfg.Pool, func(tx pgx.Tx) error {
			if fresh, err := h.cfg.Store.HandClaim(ctx, tx, h.cfg.Group, src); err != nil || !fresh {
				return err // a duplicate commits nothing new
			}
			if err := h.cfg.Store.Apply(ctx, tx, o, src); err != nil {
				return err
			}
			if h.cfg.Applied != nil {
				h.cfg.Applied(tx, o)
			}
			return nil
		})
		if err == nil {
			if h.cfg.Committed != nil {
				h.cfg.Committed()
			}
			return nil
		}
		if !Retryable(err) || ctx.Err() != nil {
			return err
		}
		h.retries.Add(1)
	}
}
