package consumer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/internal/pending"
)

// pop takes the next buffered record without waiting, resuming the
// partition's fetches once the buffer has drained to half.
func (w *worker) pop() (*kgo.Record, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.queue) == 0 {
		return nil, false
	}
	rec := w.queue[0]
	w.queue[0] = nil
	w.queue = w.queue[1:]
	if w.since.IsZero() {
		w.since, w.at = time.Now(), rec.Offset
	}
	if w.full && len(w.queue) <= w.r.c.cfg.MaxBufferedRecords/2 {
		w.full = false
		w.syncPause()
	}
	return rec, true
}

// ---- batch mode ----

// loopBatches processes the partition's records in batches of up to size
// records, a transaction per batch.
func (w *worker) loopBatches(size int) {
	batch := make([]*kgo.Record, 0, size)
	srcs := make([]Source, 0, size)
	p := w.batchPath()
	for {
		rec, ok := w.next()
		if !ok {
			return
		}
		if batch, ok = w.fill(append(batch[:0], rec), size, math.MaxInt64, w.r.c.cfg.BatchMaxWait); !ok {
			return
		}
		w.r.c.metrics.consumed.Add(w.ctx, int64(len(batch)), w.r.c.topicAttrs(batch[0]))
		if srcs, ok = w.runBatch(p, batch, srcs); !ok {
			return
		}
	}
}

// batchPath is the Kafka worker's batch path: records that cannot join a
// batch run alone on the record path, and each finished record marks its
// offset.
func (w *worker) batchPath() *batchPath {
	return &batchPath{ctx: w.ctx, alone: func(rec *kgo.Record, _ Source) bool { return w.process(rec) }, done: w.markDone}
}

// runBatch runs batch, already counted as consumed, on p; srcs is scratch
// space for the records' sources, returned for reuse. It reports false when
// the worker stopped first.
func (w *worker) runBatch(p *batchPath, batch []*kgo.Record, srcs []Source) ([]Source, bool) {
	srcs = srcs[:0]
	for _, rec := range batch {
		w.r.c.checkID(w.ctx, rec)
		srcs = append(srcs, kafkaSource{w})
	}
	return srcs, w.r.c.processBatch(p, batch, srcs)
}

// fill gathers records after those in batch, up to size in all and none
// from offset until on, waiting up to wait for more unless the partition has
// nothing more to fetch. It reports false when the worker is stopped first.
func (w *worker) fill(batch []*kgo.Record, size int, until int64, wait time.Duration) ([]*kgo.Record, bool) {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for len(batch) < size && batch[len(batch)-1].Offset+1 < until {
		if rec, ok := w.pop(); ok {
			batch = append(batch, rec)
			continue
		}
		if batch[len(batch)-1].Offset+1 >= w.hwm.Load() {
			return batch, true // caught up: nothing more to wait for
		}
		if timer == nil {
			timer = time.NewTimer(wait)
		}
		select {
		case <-w.wake:
		case <-timer.C:
			return batch, true
		case <-w.stop:
			return nil, false
		}
	}
	return batch, true
}

// batchPath is what the batch code needs of whoever fetched the records:
// the Kafka partition worker (loopBatches), or a broker adapter handing
// over messages, each with its Source (DeliverBatch).
type batchPath struct {
	ctx context.Context
	// alone runs rec on the record path, in a transaction of its own.
	alone func(rec *kgo.Record, src Source) bool
	// done, when set, is told that every record up to rec finished (the
	// Kafka worker marks its offset).
	done func(rec *kgo.Record)
	// unordered: the records keep no order (a broker that hands a failed
	// message back for redelivery, JetStream's Nak). A failed record
	// holds back no later record with its key, and a record handed back
	// or stopped stops only itself, not the records after it.
	unordered bool
}

// next reports whether the batch goes on after a record whose path
// reported ok.
func (p *batchPath) next(ok bool) bool {
	return ok || p.unordered && p.ctx.Err() == nil
}

// processBatch processes recs, each with its Source in srcs, in offset
// order, and tells p.done as they finish. Records that cannot join a batch
// (oversized, an undecodable id, a redrive, conflict keys that panicked)
// take the record path in their place; the others share transactions. It
// reports false when the path stopped (for an unordered path: when its
// context ended, or any record was not settled here).
func (c *Consumer) processBatch(p *batchPath, recs []*kgo.Record, srcs []Source) bool {
	var b batch
	all := true
	flush := func() bool {
		if len(b.recs) == 0 {
			return true
		}
		ok := c.runBatch(p, &b)
		all = all && ok
		if !p.next(ok) {
			return false
		}
		if p.done != nil {
			p.done(b.recs[len(b.recs)-1])
		}
		b.reset()
		return true
	}
	for i, rec := range recs {
		id, err := c.messageID(rec)
		// A record the broker delivered MaxAttempts times already is
		// settled by the record path without running (deliveredOut).
		spent := srcs[i].Spent()
		alone := err != nil || isRedrive(rec) || c.oversized(rec) ||
			spent >= c.cfg.MaxAttempts
		if !alone {
			msg := newMessage(rec, id, spent+1)
			if locks, err := c.conflictKeys(b.locks, msg); err == nil {
				b.recs, b.srcs, b.ids, b.msgs, b.locks = append(b.recs, rec), append(b.srcs, srcs[i]), append(b.ids, id), append(b.msgs, msg), locks
				continue
			}
		}
		if !flush() {
			return false
		}
		ok := p.alone(rec, srcs[i])
		all = all && ok
		if !p.next(ok) {
			return false
		}
		if p.done != nil {
			p.done(rec)
		}
	}
	return flush() && all
}

// batch is the records of one batch transaction, their sources, ids and
// messages, and the lock ids of their conflict keys.
type batch struct {
	recs  []*kgo.Record
	srcs  []Source
	ids   []string
	msgs  []*Message
	locks []int64
}

func (b *batch) reset() {
	b.recs, b.srcs, b.ids, b.msgs, b.locks = b.recs[:0], b.srcs[:0], b.ids[:0], b.msgs[:0], b.locks[:0]
}

// databaseDown tells each distinct source of b whether the database
// answered the batch's transaction.
func (b *batch) databaseDown(down bool) {
	for i, s := range b.srcs {
		if i == 0 || s != b.srcs[0] {
			s.DatabaseDown(down)
		}
	}
}

// runBatch processes b in one transaction, retrying it while the database
// is unreachable or the transaction lost to contention (waiting in the
// first record's Source). Each record is settled by its Source after the
// commit. Records whose handler failed in it (and, unless the path is
// unordered, records after them with the same key) are then processed on
// the record path, in order.
func (c *Consumer) runBatch(p *batchPath, b *batch) bool {
	recs, srcs := b.recs, b.srcs
	lead := srcs[0]
	for n, contended := 1, 0; ; n++ {
		outs, err, infra := c.attemptBatch(p.ctx, lead, recs, b.ids, b.msgs, b.locks, p.unordered)
		switch {
		case errors.Is(err, errStopped):
			return false
		case err == nil:
		case p.ctx.Err() != nil:
			return false // abandoned: the transaction rolled back
		case isContention(err):
			// The batch lost to another transaction as a whole (its batch
			// handler or its commit): run it again, soon, attempts unspent.
			b.databaseDown(false)
			contended++
			c.contended(p.ctx, recs[0], len(recs))
			delay := contentionBackoff.Delay(contended)
			c.cfg.Logger.Debug("oncely batch lost to contention; retrying", "topic", recs[0].Topic,
				"partition", recs[0].Partition, "first_offset", recs[0].Offset, "records", len(recs), "delay", delay, "err", err)
			if !lead.Pause(delay) {
				return false
			}
			continue
		case infra:
			b.databaseDown(true)
			c.retries.Add(1)
			c.metrics.retries.Add(p.ctx, 1, c.topicAttrs(recs[0]))
			delay := c.backoff.Delay(n)
			c.outage.Warn(p.ctx, "oncely batch failed on the database; retrying", "topic", recs[0].Topic,
				"partition", recs[0].Partition, "first_offset", recs[0].Offset, "records", len(recs), "delay", delay, "err", err)
			if !lead.Pause(delay) {
				return false
			}
			continue
		default:
			// The batch handler (or the commit) failed as a whole: which
			// record caused it is unknown, so each one runs alone.
			b.databaseDown(false)
			c.cfg.Logger.Warn("oncely batch failed; processing its records one by one", "topic", recs[0].Topic,
				"partition", recs[0].Partition, "first_offset", recs[0].Offset, "records", len(recs), "err", err)
			all := true
			for i, rec := range recs {
				ok := p.alone(rec, srcs[i])
				all = all && ok
				if !p.next(ok) {
					return false
				}
			}
			return all
		}
		b.databaseDown(false)
		c.batches.Add(1)
		committed := false
		all := true
		for i, rec := range recs {
			switch o := &outs[i]; {
			case o.deferred || o.err != nil:
				continue
			case o.duplicate:
				c.countDuplicate(p.ctx, rec)
			default:
				c.processed.Add(1)
				committed = true
			}
			ok := srcs[i].Settle(p.ctx, rec, false)
			all = all && ok
			if !p.next(ok) {
				return false
			}
		}
		if committed {
			c.firstCommit()
		}
		for i, rec := range recs {
			o := &outs[i]
			if o.err == nil && !o.deferred {
				continue
			}
			if i > 0 && p.done != nil {
				p.done(recs[i-1]) // all before rec finished
			}
			ok := true
			if o.err != nil {
				ok = c.deliver(p.ctx, rec, srcs[i], o)
			} else {
				ok = p.alone(rec, srcs[i])
			}
			all = all && ok
			if !p.next(ok) {
				return false
			}
		}
		return all
	}
}

// errStopped is attemptBatch's error when ctx ended, or the worker stopped,
// before the batch had its turn and a slot: nothing ran.
var errStopped = errors.New("consumer: worker stopped")

// attemptBatch runs one batch transaction: a multi-row inbox claim first,
// with the conflict-key locks of the batch's records in the same round trip,
// then the handler for each new record under a savepoint of its own (or the
// batch handler once), then commit. outs, aligned with recs, tell each
// record's fate: a duplicate; deferred (not run, because an earlier record
// with its key failed; never when unordered); failed (err set: its effects and claim were rolled
// back to its savepoint); or committed. A non-nil err means the whole
// transaction rolled back; infra tells a database failure from a handler's.
func (c *Consumer) attemptBatch(ctx context.Context, lead Source, recs []*kgo.Record, ids []string, msgs []*Message, locks []int64, unordered bool) (outs []result, err error, infra bool) {
	outs = make([]result, len(recs))
	// The batch's turn among the member's transactions that share its
	// keys, then a transaction slot of its lead Source's.
	held, stmts := c.batchLocking(locks)
	leave, ok := c.enterTx(ctx, held, recs[0], lead)
	if !ok {
		return outs, errStopped, false
	}
	defer leave()
	start := time.Now()
	type span struct {
		i    int
		ctx  context.Context
		span trace.Span
	}
	var spans []span
	defer func() {
		for _, s := range spans {
			res := outs[s.i]
			if err != nil && res.err == nil {
				res.err, res.infra, res.contention = err, infra, isContention(err)
			}
			c.endProcessSpan(s.ctx, s.span, recs[s.i], start, res)
		}
	}()
	startSpan := func(i int) context.Context {
		sctx, sp := c.startProcessSpan(ctx, recs[i], ids[i], msgs[i].Attempt)
		spans = append(spans, span{i, sctx, sp})
		outs[i].spanContext = sp.SpanContext()
		msgs[i].ctx = sctx
		return sctx
	}

	entries := make([]dedup.Entry, len(recs))
	for i, rec := range recs {
		outs[i].id = ids[i]
		entries[i] = dedup.Entry{Group: c.cfg.Group, MessageID: ids[i], Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset}
	}
	// BEGIN, the batch's claim and its conflict locks travel in one round trip.
	ctx, woke := c.wakes(ctx)
	tx, claimed, err := c.inbox.BeginClaimMany(ctx, c.cfg.Pool, c.cfg.Group, entries, stmts...)
	if err != nil {
		return outs, err, databaseFailed(err)
	}
	committing := false
	defer func() {
		if !committing {
			rollback(ctx, tx)
		}
	}()

	var batch []*Message // for the batch handler
	var batchIdx []int   // their indexes in recs
	failedKeys := make(map[string]bool)
	rtx := &recordTx{Tx: tx}
	// What the handlers enqueue to the outbox is written once, before
	// the commit (package pending): a round trip a record less.
	var queue pending.Queue
	for i, rec := range recs {
		switch {
		case !claimed[i]:
			outs[i].duplicate = true
			startSpan(i)
			continue
		case !unordered && failedKeys[string(rec.Key)]:
			outs[i].deferred = true
			if err := c.inbox.Release(ctx, tx, c.cfg.Group, ids[i]); err != nil {
				return outs, err, databaseFailed(err)
			}
			continue
		}
		sctx := startSpan(i)
		if c.cfg.BatchHandler != nil {
			msgs[i].failed = nil
			batch, batchIdx = append(batch, msgs[i]), append(batchIdx, i)
			continue
		}
		rtx.next()
		mark := queue.Len()
		herr := callHandler(pending.With(sctx, &queue), c.handler, rtx, msgs[i])
		if rtx.err != nil {
			// The savepoint failed: the database went away, or the
			// transaction was aborted by a statement an earlier handler
			// let fail and then returned nil (25P02). That record is
			// unknown: the batch's records run one by one.
			// A savepoint that ran out of the handler's own time is the
			// handler's failure too.
			return outs, rtx.err, databaseFailed(rtx.err) && !(rtx.ctxDone && ctx.Err() == nil)
		}
		if herr == nil {
			continue
		}
		if tx.Conn().IsClosed() {
			// The transaction is gone with its connection: the database
			// went away, or the handler's own deadline cancelled a
			// statement (the record's doing: the records run one by one).
			return outs, herr, handlerDatabaseFailed(sctx, herr, tx)
		}
		if c.cfg.ConflictKeys == nil && isContention(herr) {
			// The batch is in a lock cycle, or waits on one: the records
			// after this one would time out too. It runs again whole, in
			// the serial window this loss opens.
			return outs, herr, false
		}
		if rtx.taken {
			if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+savepoint); err != nil {
				err = fmt.Errorf("consumer: rollback to savepoint: %w", err)
				return outs, err, databaseFailed(err)
			}
		}
		rtx.done()
		queue.Truncate(mark)
		if err := c.inbox.Release(ctx, tx, c.cfg.Group, ids[i]); err != nil {
			return outs, err, databaseFailed(err)
		}
		outs[i].err, outs[i].contention = herr, isContention(herr)
		failedKeys[string(rec.Key)] = true
	}
	if len(batch) > 0 {
		if err := callBatchHandler(ctx, c.cfg.BatchHandler, tx, batch); err != nil {
			return outs, err, handlerDatabaseFailed(ctx, err, tx)
		}
		// Messages the batch handler failed leave the batch: their claims
		// are released, and they go on to the record path.
		for j, msg := range batch {
			if msg.failed == nil {
				continue
			}
			i := batchIdx[j]
			if err := c.inbox.Release(ctx, tx, c.cfg.Group, ids[i]); err != nil {
				return outs, err, databaseFailed(err)
			}
			outs[i].err, outs[i].contention = msg.failed, isContention(msg.failed)
		}
	}
	if err := queue.Write(ctx, tx); err != nil {
		return outs, err, databaseFailed(err)
	}
	committing = true // a failed Commit ends the transaction too
	if err := tx.Commit(ctx); err != nil {
		return outs, fmt.Errorf("consumer: commit: %w", err), databaseFailed(err)
	}
	woke()
	return outs, nil, false
}

// ---- per-key parallel mode ----

// keyTask is one record in per-key mode.
type keyTask struct {
	rec  *kgo.Record
	key  string
	ok   bool // processed (or dead-lettered)
	done bool
}

// loopKeys processes the partition's records with up to lanes at once:
// records with different keys concurrently, records with the same key in
// offset order. A record waits, off the buffer, while an earlier record
// with its key runs; at most MaxBufferedRecords records wait so. The marked
// offset is the low watermark: the first record not yet finished.
func (w *worker) loopKeys(lanes int) {
	tasks := make(chan *keyTask)
	results := make(chan *keyTask, lanes)
	laneDone := make(chan struct{})
	for range lanes {
		go func() {
			defer func() { laneDone <- struct{}{} }()
			for t := range tasks {
				w.r.c.metrics.consumed.Add(w.ctx, 1, w.r.c.topicAttrs(t.rec))
				w.r.c.checkID(w.ctx, t.rec)
				t.ok = w.process(t.rec)
				results <- t
			}
		}()
	}
	defer func() {
		close(tasks)
		for range lanes {
			<-laneDone
		}
	}()

	var (
		order    []*keyTask                // taken records in offset order, first unfinished first
		waiting  = map[string][]*keyTask{} // per busy key: its records not yet started
		runnable []*keyTask
		inflight int
		held     int // taken and not finished
		stop     = w.stop
	)
	take := func(rec *kgo.Record) {
		t := &keyTask{rec: rec, key: string(rec.Key)}
		order = append(order, t)
		held++
		if q, busy := waiting[t.key]; busy {
			waiting[t.key] = append(q, t)
		} else {
			waiting[t.key] = nil
			runnable = append(runnable, t)
		}
	}
	// A replay of the dead owner's window (worker.replay) runs in this
	// loop: its first record is taken already.
	kr := w.replaying
	w.replaying = nil
	doneTo := int64(-1) // the offset of the last record of the finished prefix
	endReplay := func() {
		switch ended, ok := w.finishedReplay(kr, doneTo); {
		case !ok:
			stop = nil
		case ended:
			kr = nil
		}
	}
	if kr != nil {
		defer kr.release() // stopped before the window finished
		take(kr.first)
		kr.took(kr.first)
	}
	limit := w.r.c.cfg.MaxBufferedRecords
	for {
		for stop != nil && held < limit {
			rec, ok := w.pop()
			if !ok {
				if kr != nil {
					kr.closeAt(w.hwm.Load())
					endReplay() // its records may all have finished
				}
				break
			}
			take(rec)
			if kr != nil {
				kr.took(rec)
			}
		}
		for stop != nil && inflight < lanes && len(runnable) > 0 {
			tasks <- runnable[0]
			runnable[0] = nil
			runnable = runnable[1:]
			inflight++
		}
		if stop == nil && inflight == 0 {
			return
		}
		if len(order) == 0 {
			w.idle()
		}
		select {
		case t := <-results:
			inflight--
			if !t.ok {
				stop = nil // stopped, abandoned or crashed: start nothing more
				continue
			}
			t.done = true
			held--
			if q := waiting[t.key]; len(q) > 0 {
				runnable = append(runnable, q[0])
				waiting[t.key] = q[1:]
			} else {
				delete(waiting, t.key)
			}
			var last *keyTask
			for len(order) > 0 && order[0].done {
				last = order[0]
				order[0] = nil
				order = order[1:]
			}
			if last != nil {
				w.markDone(last.rec)
				doneTo = last.rec.Offset
				if kr != nil {
					endReplay()
				}
			}
		case <-w.wake:
		case <-stop:
			stop = nil
		}
	}
}
