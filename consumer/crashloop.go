package consumer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/sqlident"
)

// A record that kills the process (os.Exit, running out of memory, a panic
// in a goroutine its handler started) leaves no error to count: the next
// owner of its partition receives it again, and would die again, for ever.
// The partition_owners table (migration 0006) carries what survives the
// process:
//
//   - A worker writes its partition's row when it starts, before it
//     processes a record (ownerQueries.start), and deletes it when the
//     partition leaves the member cleanly, after the final offset commit
//     (run.forget). A worker starts as soon as its partition is assigned,
//     whether or not it has records: a member that holds a partition with
//     nothing to do on it owns its row all the same, and its clean exit
//     leaves none. A row that is already there when a worker starts says
//     that the previous owner died: it did not let the partition go.
//   - Such a partition starts in probe (worker.loopProbe): the records it
//     holds when it starts (up to the high watermark of its first fetch,
//     which bounds every record its previous owner can have been running)
//     run one at a time, each in its own transaction, in every mode, and
//     one at a time across all the member's probing partitions. Before any
//     user code runs for one (its KeyFunc, then its handler), its offset is
//     written to the row (ownerQueries.mark); its id is added once KeyFunc
//     has returned it (ownerQueries.markID). If the process dies then, the
//     mark names the record it was running, and only that one.
//   - In batch mode and with key parallelism, without a KeyFunc, a first
//     death is replayed instead (Consumer.replays, worker.replay): when the
//     dead owner ran records the ordinary way (it was not probing or
//     replaying itself) and no death is counted against a record still to
//     run, the records it could have been running (in_flight of them from
//     the first the inbox says did not finish: records it cannot be asked
//     about are probed alone on the way) run again as the mode runs records (one batch; on the
//     lanes, loopKeys ending the replay once they finished), with
//     replay_end (migration 0009) set in the row meanwhile. A death then
//     counts against no record (none is marked), and the next start,
//     finding replay_end, probes those records one at a time, and carries
//     that on (replay_end -1) until a probe ends. A kill from
//     outside (a deploy, a node lost) costs its successor one batch, or the
//     lanes' time; a record that kills every process costs one death more.
//   - Most records a probe meets finished before the owner died (after its
//     last offset commit). Without a KeyFunc, the probe asks the inbox once
//     which of the records buffered ahead of it finished
//     (ownerQueries.finishedAmong, up to probeLookAhead at a time), and
//     those pass as duplicates without a mark, a transaction, or their turn
//     in the member (worker.knownFinished): they run no user code, so no
//     death can be theirs, and a mark on them would count for nothing (see
//     below). The suspect and redrives are always probed one at a time.
//   - The next start counts the death against the marked record if it did
//     not finish: its id is not known (the process died in KeyFunc), or the
//     inbox does not hold it (processed, or dead-lettered with no redrive
//     grant pending: a redriven record is dead-lettered in the inbox until
//     it has run). A mark left on a record that finished counts for
//     nothing, and the probe clears its mark when it ends. The record
//     that did not finish becomes the suspect, and
//     suspect_kills counts the deaths while it ran. A death while no record
//     was running (idle, between records, waiting for another partition's
//     turn) counts against none. A probe that meets the suspect again, not
//     yet in the inbox, with CrashLoopLimit deaths counted, dead-letters it
//     (class crash_loop) through the ordinary dead-letter path instead of
//     running it, and without calling its KeyFunc: by the id the dead
//     owner's mark gave it, else (the process died in KeyFunc) by
//     topic/partition/offset, as an undecodable record. A probe that ends
//     past the suspect clears it: the suspect finished (ran, or was
//     dead-lettered), and a later death owes it nothing.
//
// Nothing of this runs on the hot path: one statement when a partition is
// assigned and one when it is revoked; only while probing, one per record
// that had not finished (its mark with its id; with a KeyFunc, and for
// every record, two: its mark, then its id), one per look-ahead over
// the buffered records, and one at the end; a replay, two in all.

// ownerQueries are the statements on the partition_owners table, built once.
type ownerQueries struct {
	table, start, mark, markID, markWithID, replay, end, finishedAmong, forget string
}

func newOwnerQueries(schema string) *ownerQueries {
	t := sqlident.Table(schema, "partition_owners")
	// The record marked running when the owner died, and not finished
	// since: the one the process was running. A mark without an id is a
	// record whose id was being worked out (KeyFunc, user code, ran): it
	// did not finish. A record finished when the inbox holds it, processed
	// or dead-lettered, unless its redrive grant is still there: a redriven
	// record is dead-lettered in the inbox before it runs, and takes its
	// grant (in its transaction) only when it finishes. A mark the probe
	// left on a finished record therefore counts for nothing.
	finished := func(group, id string) string {
		return `EXISTS (SELECT 1 FROM ` + sqlident.Table(schema, "inbox") +
			` i WHERE i.consumer_group = ` + group + ` AND i.message_id = ` + id + ` AND (i.outcome = 'processed' OR NOT EXISTS (SELECT 1 FROM ` +
			sqlident.Table(schema, "redrive_grants") + ` g WHERE g.consumer_group = i.consumer_group AND g.message_id = i.message_id)))`
	}
	died := `p.running_offset IS NOT NULL AND (p.running_id IS NULL OR NOT ` + finished("p.consumer_group", "p.running_id") + `)`
	key := `consumer_group = $1 AND topic = $2 AND partition = $3`
	mark := `UPDATE ` + t + ` SET running_offset = $5, running_id = $6
			WHERE ` + key + ` AND owner = $4`
	return &ownerQueries{
		table: t,
		// A row already there: its owner died. The death counts against
		// the record it was running, if any. The dead owner's mark (prev,
		// read before the row is overwritten) gives the suspect's id when
		// the process died running it with its id known: a suspect
		// dead-lettered by that id needs no KeyFunc call, which may be
		// what kills the process. So does the dead owner's in_flight: how
		// many of the partition's unfinished records the probe must run.
		// The INSERT reads prev first: read only by RETURNING, after the
		// row was updated, its FOR UPDATE would skip the row this very
		// statement changed, and find nothing.
		//
		// The last column says whether the dead owner was itself probing
		// (a record marked) or replaying a batch (replay_end): its death
		// may then be a record's doing, and the probe runs its records
		// one at a time. So may the next owner's, should this one die
		// before it marks a record (another partition's replay, or a kill,
		// may come first): replay_end -1 carries the strictness forward
		// until the probe ends.
		start: `WITH prev AS (SELECT running_offset, running_id, in_flight, replay_end FROM ` + t + ` WHERE ` + key + ` FOR UPDATE)
			INSERT INTO ` + t + ` AS p (consumer_group, topic, partition, owner, in_flight)
			SELECT $1, $2, $3, $4, $5 FROM (SELECT count(*) FROM prev) AS read_first
			ON CONFLICT (consumer_group, topic, partition) DO UPDATE SET owner = excluded.owner, started_at = now(),
				in_flight = excluded.in_flight,
				deaths = p.deaths + 1,
				suspect_kills = CASE WHEN NOT (` + died + `) THEN p.suspect_kills
					WHEN p.suspect_offset = p.running_offset THEN p.suspect_kills + 1 ELSE 1 END,
				suspect_offset = CASE WHEN ` + died + ` THEN p.running_offset ELSE p.suspect_offset END,
				running_offset = NULL, running_id = NULL,
				replay_end = CASE WHEN p.running_offset IS NOT NULL OR p.replay_end IS NOT NULL THEN -1 END
			RETURNING p.deaths, p.suspect_offset, p.suspect_kills,
				(SELECT prev.running_id FROM prev WHERE prev.running_offset = p.suspect_offset),
				(SELECT prev.in_flight FROM prev),
				coalesce((SELECT prev.running_offset IS NOT NULL OR prev.replay_end IS NOT NULL FROM prev), false)`,
		mark: mark,
		// markID also says whether the record finished before (it will
		// not run again): a probe counts only the records that had not.
		markID: `UPDATE ` + t + ` SET running_id = $6
			WHERE ` + key + ` AND owner = $4 AND running_offset = $5
			RETURNING ` + finished("$1", "$6"),
		// markWithID marks a record and its id at once, where working out
		// the id runs no user code.
		markWithID: mark + ` RETURNING ` + finished("$1", "$6"),
		// replay marks a batch replay running, up to offset $5; a death
		// then counts against no record (running_offset is NULL).
		replay: `UPDATE ` + t + ` SET replay_end = $5, running_offset = NULL, running_id = NULL
			WHERE ` + key + ` AND owner = $4`,
		// end ends a probe at offset $5: no record runs marked from now
		// on, and a suspect at or before $5 has finished (the probe ran
		// it, or dead-lettered it): a later death owes it nothing.
		end: `UPDATE ` + t + ` SET running_offset = NULL, running_id = NULL, replay_end = NULL,
				suspect_kills = CASE WHEN suspect_offset <= $5 THEN 0 ELSE suspect_kills END,
				suspect_offset = CASE WHEN suspect_offset <= $5 THEN NULL ELSE suspect_offset END
			WHERE ` + key + ` AND owner = $4`,
		// finishedAmong returns the ids, of those given, that finished:
		// the probe's look-ahead, one statement for the records buffered.
		finishedAmong: `SELECT u.id FROM unnest($2::text[]) AS u(id) WHERE ` + finished("$1", "u.id"),
		forget:        `DELETE FROM ` + t + ` WHERE consumer_group = $1 AND owner = ANY($2)`,
	}
}

// ownership is what a worker learned when it wrote its partition's row.
type ownership struct {
	deaths    int    // consecutive previous owners that died; 0: a clean start
	suspect   int64  // the offset of the record that was running when owners died; -1: none
	suspectID string // the suspect's id, if the last owner that died knew it; "": unknown
	kills     int    // deaths while the suspect ran
	inFlight  int    // the most unfinished records the dead owner could have started; 0: unknown
	// strict: the dead owner was probing or replaying when it died, so its
	// death may be a record's doing; the probe runs records one at a time.
	strict bool
	replay bool // the probe runs the dead owner's window again as this consumer runs records (worker.replay)
}

// inFlight is the most records of a partition this consumer can have
// started and not finished at once, written to the partition's row: the
// next owner, should this one die, probes that many of the partition's
// unfinished records. A batch's records are consecutive and the next batch
// starts when it finished; with key parallelism, a record starts only
// within the partition's buffer.
func (c *Consumer) inFlight() int {
	switch {
	case c.cfg.KeyParallelism > 1:
		return c.cfg.MaxBufferedRecords
	case c.cfg.BatchSize > 1:
		return c.cfg.BatchSize
	}
	return 1
}

// DefaultCrashLoopLimit is Config.CrashLoopLimit's default.
const DefaultCrashLoopLimit = 3

func (c *Consumer) crashLoopOn() bool { return c.owners != nil }

// newOwnerToken names one worker's ownership of its partition.
func newOwnerToken() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// startOwnership writes the partition's row and, if its previous owner
// died, runs the probe. It reports false when the worker was stopped first.
func (w *worker) startOwnership() bool {
	c := w.r.c
	if !c.crashLoopOn() {
		return true
	}
	o := ownership{suspect: -1}
	if !w.untilDone(func(ctx context.Context) error {
		var suspect *int64
		var suspectID *string
		var inFlight *int32
		err := c.cfg.Pool.QueryRow(ctx, c.owners.start, c.cfg.Group, w.tp.topic, w.tp.partition, w.owner, c.inFlight()).
			Scan(&o.deaths, &suspect, &o.kills, &suspectID, &inFlight, &o.strict)
		if err == nil && inFlight != nil {
			o.inFlight = int(*inFlight)
		}
		if err == nil && suspect != nil {
			o.suspect = *suspect
		}
		if err == nil && suspectID != nil {
			o.suspectID = *suspectID
		}
		return err
	}) {
		return false
	}
	if o.deaths == 0 {
		return true
	}
	c.crashProbes.Add(1)
	c.metrics.crashProbes.Add(w.ctx, 1, c.metricAttrs(attrKey{topic: w.tp.topic}))
	o.replay = c.replays(o)
	how := "the records it may have been running run one at a time"
	if o.replay {
		how = "the records it may have been running run again, as a replay"
	}
	c.cfg.Logger.Warn("oncely partition starts in probe: its previous owner died without letting it go; "+how,
		"topic", w.tp.topic, "partition", w.tp.partition, "deaths", o.deaths, "suspect_offset", o.suspect,
		"suspect_kills", o.kills, "crash_loop_limit", c.cfg.CrashLoopLimit, "unfinished_to_probe", o.inFlight)
	return w.loopProbe(o)
}

// loopProbe runs the partition's records one at a time, marking each before
// it runs, until it has run as many records that had not finished as the
// dead owner could have been running (o.inFlight: the one that killed it is
// among them, since the owner started records in offset order within that
// bound), or passed the high watermark of its first fetch, whichever comes
// first (only the latter when the dead owner's bound is unknown). Records
// that had finished go by as duplicates and do not count: without a
// KeyFunc, those the inbox is known to hold finished pass without a mark
// (knownFinished, passFinished). It reports false when the worker was
// stopped first.
func (w *worker) loopProbe(o ownership) bool {
	c := w.r.c
	until := int64(-1)
	ran := 0 // probed records that had not finished
	ahead := lookAhead{}
	for {
		rec, ok := w.next()
		if !ok {
			return false
		}
		if until < 0 {
			until = w.hwm.Load() // set before the records were pushed
		}
		id, known, unfinished, ok := w.knownFinished(ahead, rec, o, until)
		if ok && unfinished && o.replay {
			// The first record the inbox says did not finish: the dead
			// owner's batch (or buffer) began at or before it. Records it
			// could not be asked about (the suspect, redrives, oversized
			// ones, undecodable ids) were probed alone on the way.
			return w.replay(rec, o, until) // counts rec as consumed with its window
		}
		c.metrics.consumed.Add(w.ctx, 1, c.topicAttrs(rec))
		fresh := false
		switch {
		case !ok:
		case known:
			ok = w.passFinished(rec, id)
		default:
			ok, fresh = w.probe(rec, o)
		}
		if !ok {
			return false
		}
		w.markDone(rec)
		if fresh {
			ran++
		}
		if rec.Offset+1 >= until || (o.inFlight > 0 && ran >= o.inFlight) {
			if !w.endProbe(rec.Offset) {
				return false
			}
			c.cfg.Logger.Info("oncely partition probe done", "topic", w.tp.topic, "partition", w.tp.partition, "offset", rec.Offset)
			return true
		}
	}
}

// replays reports whether a probe runs the dead owner's window again as
// this consumer runs records rather than one at a time: without a KeyFunc
// (the inbox says where the window begins), when the window fits in one of
// this consumer's batches (in_flight up to BatchSize) or, with key
// parallelism, in its buffer (up to MaxBufferedRecords), the dead owner
// died outside a probe and a replay (a death there is put down to no
// record: it may have been any of the window's), and no death is counted
// against a record that has not run since. A record that kills every
// process then kills the replay too, and the next probe, strict, finds it
// one record at a time: one death more before it is dead-lettered, against
// a restart that costs one batch (or the lanes' time) instead of a
// transaction (and a mark) per record of it.
func (c *Consumer) replays(o ownership) bool {
	if o.strict || o.suspect >= 0 || o.inFlight <= 1 || c.cfg.KeyFunc != nil {
		return false
	}
	if c.cfg.KeyParallelism > 1 {
		return o.inFlight <= c.cfg.MaxBufferedRecords
	}
	return c.cfg.BatchSize > 1 && o.inFlight <= c.cfg.BatchSize
}

// replay runs first, the partition's first record not known finished, and
// the records after it, o.inFlight in all (what the dead owner can have
// been running: its batch, or with key parallelism its buffer, from its
// first unfinished record on), as this consumer runs records, with the
// replay marked in the partition's row: should the process die meanwhile,
// the next owner probes those records one at a time. It takes the probe
// slot, as a probed record does, so that a death is never blamed on another
// probing partition's marked record while it runs. In batch mode the
// window is one batch, run here; with key parallelism, loopKeys runs it
// (w.replaying), ends the replay and gives the slot back once the window's
// records finished. It reports false when the worker was stopped first.
func (w *worker) replay(first *kgo.Record, o ownership, until int64) bool {
	c := w.r.c
	select {
	case w.r.probeSlot <- struct{}{}:
	case <-w.stop:
		return false
	case <-w.ctx.Done():
		return false
	}
	release := sync.OnceFunc(func() { <-w.r.probeSlot })
	markReplay := func(end int64) bool {
		return w.untilDone(func(ctx context.Context) error {
			_, err := c.cfg.Pool.Exec(ctx, c.owners.replay, c.cfg.Group, w.tp.topic, w.tp.partition, w.owner, end)
			return err
		})
	}
	if c.cfg.KeyParallelism > 1 {
		// The window's last offset is known once its records are taken;
		// the row says where it can end at the most.
		if !markReplay(first.Offset + int64(o.inFlight) - 1) {
			release()
			return false
		}
		w.replaying = &keyReplay{first: first, size: o.inFlight, last: -1, release: release}
		return true
	}
	defer release()
	// Unlike a batch, the window waits for the records on their way rather
	// than BatchMaxWait: cut short, it could leave the record that killed
	// the dead owner to run unmarked. None past until (the high watermark
	// when the probe began): the dead owner saw nothing past it.
	batch, ok := w.fill([]*kgo.Record{first}, o.inFlight, until, replayWait)
	if !ok {
		return false
	}
	last := batch[len(batch)-1].Offset
	if !markReplay(last) {
		return false
	}
	c.metrics.consumed.Add(w.ctx, int64(len(batch)), c.topicAttrs(first))
	if _, ok := w.runBatch(w.batchPath(), batch, nil); !ok || !w.endProbe(last) {
		return false
	}
	c.cfg.Logger.Info("oncely partition probe done", "topic", w.tp.topic, "partition", w.tp.partition, "offset", last, "replayed", len(batch))
	return true
}

// replayWait bounds how long a batch replay waits for the rest of its
// window to be fetched.
const replayWait = 2 * time.Second

// keyReplay is a replay that loopKeys runs: the dead owner's window, from
// first on, size records long.
type keyReplay struct {
	first     *kgo.Record
	size      int
	taken     int   // window records taken by loopKeys
	lastTaken int64 // the offset of the last of them
	last      int64 // the window's last offset, once known; -1 before
	release   func()
}

// took counts rec, taken by loopKeys, into the window until it is full.
func (kr *keyReplay) took(rec *kgo.Record) {
	if kr.last >= 0 {
		return
	}
	kr.taken++
	kr.lastTaken = rec.Offset
	if kr.taken == kr.size {
		kr.last = rec.Offset
	}
}

// closeAt ends the window at the last record taken when the partition has
// nothing more to fetch (hwm, its high watermark): every record the dead
// owner can have been running is in it.
func (kr *keyReplay) closeAt(hwm int64) {
	if kr.last < 0 && kr.lastTaken+1 >= hwm {
		kr.last = kr.lastTaken
	}
}

// finishedReplay ends the replay once every record up to done (the
// partition's contiguous finished offset; -1: none yet) finished and the
// window is within it: the mark cleared, the probe slot given back. It
// reports false when the worker was stopped first.
func (w *worker) finishedReplay(kr *keyReplay, done int64) (ended, ok bool) {
	if kr.last < 0 || done < kr.last {
		return false, true
	}
	if !w.endProbe(kr.last) {
		return false, false
	}
	kr.release()
	w.r.c.cfg.Logger.Info("oncely partition probe done", "topic", w.tp.topic, "partition", w.tp.partition, "offset", kr.last, "replayed", kr.taken)
	return true, true
}

// endProbe ends the partition's probe at offset: no record runs marked from
// now on, so a later death (idle, or outside a probe) finds no mark to
// count against, and a suspect at or before offset, which finished, is
// forgotten. It reports false when the worker was stopped first.
func (w *worker) endProbe(offset int64) bool {
	c := w.r.c
	return w.untilDone(func(ctx context.Context) error {
		_, err := c.cfg.Pool.Exec(ctx, c.owners.end, c.cfg.Group, w.tp.topic, w.tp.partition, w.owner, offset)
		return err
	})
}

// probeLookAhead bounds how many buffered records a probe asks the inbox
// about in one statement.
const probeLookAhead = 1000

// lookAhead is what a probe learned, in one statement, of the records it
// will take next (the very records the worker pops, in the order it pops
// them): for each, its id if it may pass without a mark (knownFinished),
// and whether the inbox was asked about it at all (not the suspect, a
// redrive, an oversized record or one whose id does not decode).
type lookAhead map[*kgo.Record]aheadEntry

type aheadEntry struct {
	id    string // "": not known finished
	asked bool
}

// knownFinished reports whether rec may pass the probe as a duplicate
// without a mark, a transaction or the probe slot, and by which id: the
// consumer has no KeyFunc (its id comes from a header: no user code works
// it out), rec is not the suspect (whose mark counts deaths, and which may
// have to be dead-lettered), not a redrive (which runs again once an
// operator granted it), not oversized (dead-lettered without a claim, by
// its own path), its id decodes, and the inbox holds that id finished:
// processed, or dead-lettered with no redrive grant pending, the predicate
// a death is judged by.
//
// Passing it unmarked is safe because a mark is there to count a death
// against the record that was running, and a finished record runs no user
// code: its claim would find it a duplicate and skip its handler. A death
// while it passes is none of its doing, and a mark on it would count for
// nothing at the next start anyway. The mark left meanwhile is the last
// probed record's, which finished before this one was taken: it counts for
// nothing too, as it does while a record waits for the probe slot. A
// record not known finished takes the per-record probe.
//
// The first time it meets a record it did not ask about, it asks about rec
// and the records buffered after it (probeLookAhead at the most, none at or
// past until, where the probe ends) at once. ok is false when the worker
// was stopped first.
func (w *worker) knownFinished(ahead lookAhead, rec *kgo.Record, o ownership, until int64) (id string, known, unfinished, ok bool) {
	if w.r.c.cfg.KeyFunc != nil {
		return "", false, false, true // the id is user code's, which may be what kills the process
	}
	e, seen := ahead[rec]
	if !seen {
		if !w.lookAhead(ahead, rec, o, until) {
			return "", false, false, false
		}
		e = ahead[rec]
	}
	delete(ahead, rec)
	return e.id, e.id != "", e.asked && e.id == "", true
}

// lookAhead fills ahead for rec and the records buffered after it, read
// under w.mu without taking them: one statement (finishedAmong) for all.
func (w *worker) lookAhead(ahead lookAhead, rec *kgo.Record, o ownership, until int64) bool {
	c := w.r.c
	clear(ahead)
	recs := []*kgo.Record{rec}
	w.mu.Lock()
	for _, r := range w.queue {
		if len(recs) == probeLookAhead || r.Offset >= until {
			break
		}
		recs = append(recs, r)
	}
	w.mu.Unlock()
	byID := make(map[string][]*kgo.Record, len(recs))
	ids := make([]string, 0, len(recs))
	for _, r := range recs {
		ahead[r] = aheadEntry{}
		if r.Offset == o.suspect || isRedrive(r) || c.oversized(r) {
			continue
		}
		id, err := c.messageID(r)
		if err != nil {
			continue
		}
		ahead[r] = aheadEntry{asked: true}
		if _, dup := byID[id]; !dup {
			ids = append(ids, id)
		}
		byID[id] = append(byID[id], r)
	}
	if len(ids) == 0 {
		return true
	}
	var finished []string
	if !w.untilDone(func(ctx context.Context) error {
		rows, err := c.cfg.Pool.Query(ctx, c.owners.finishedAmong, c.cfg.Group, ids)
		if err != nil {
			return err
		}
		finished, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	}) {
		return false
	}
	for _, id := range finished {
		for _, r := range byID[id] {
			ahead[r] = aheadEntry{id: id, asked: true}
		}
	}
	return true
}

// passFinished passes rec, which the inbox holds finished, as the record
// path passes a duplicate (deliver), without its transaction: its
// "process" span (the first attempt's, outcome duplicate), the duplicate
// counted, the record settled (the caller marks its offset).
func (w *worker) passFinished(rec *kgo.Record, id string) bool {
	c := w.r.c
	start := time.Now()
	ctx, span := c.startProcessSpan(w.ctx, rec, id, 1)
	c.endProcessSpan(ctx, span, rec, start, result{id: id, duplicate: true})
	c.countDuplicate(w.ctx, rec)
	return kafkaSource{w}.Settle(w.ctx, rec, false)
}

// probe runs one record of a probing partition: alone in the member, marked
// in the partition's row; or, when it is the record the previous owners
// died running CrashLoopLimit times, dead-lettered.
//
// The suspect check comes first and calls no user code: a KeyFunc that
// kills the process on the record must not run again once the record has
// reached the limit. Any other record is marked with its id before it runs;
// with a KeyFunc, its offset first and its id once known, so that a death
// in KeyFunc counts against it as a death in its handler does. fresh
// reports whether the record had not finished before (it ran, or was
// dead-lettered, now).
func (w *worker) probe(rec *kgo.Record, o ownership) (ok, fresh bool) {
	c := w.r.c
	select {
	case w.r.probeSlot <- struct{}{}:
	case <-w.stop:
		return false, false
	case <-w.ctx.Done():
		return false, false
	}
	defer func() { <-w.r.probeSlot }()
	if rec.Offset == o.suspect && o.kills >= c.cfg.CrashLoopLimit {
		id := c.suspectID(rec, o.suspectID)
		// A death while it is dead-lettered counts against it again, by
		// the same id.
		if !w.markRunning(rec.Offset, &id) {
			return false, false
		}
		return w.crashLooped(rec, id, o.kills), true
	}
	// With a KeyFunc, working out the id is user code, which may be what
	// kills the process: the record is marked first, its id added after.
	// Without one, the id comes from a header, and one statement marks both.
	mark := c.owners.markWithID
	if c.cfg.KeyFunc != nil {
		if !w.markRunning(rec.Offset, nil) {
			return false, false
		}
		mark = c.owners.markID
	}
	id, idErr := c.messageID(rec)
	if idErr != nil {
		id = c.fallbackID(rec) // dead-lettered as undecodable at once, never run
	}
	var finished bool
	if !w.untilDone(func(ctx context.Context) error {
		err := c.cfg.Pool.QueryRow(ctx, mark, c.cfg.Group, w.tp.topic, w.tp.partition, w.owner, rec.Offset, id).Scan(&finished)
		if errors.Is(err, pgx.ErrNoRows) {
			// The row is another owner's now: this worker is a zombie,
			// whose record goes no further than the inbox lets it.
			finished, err = false, nil
		}
		return err
	}) {
		return false, false
	}
	// A finished record (processed, or dead-lettered and not redriven,
	// before the owner died) is not what killed it; it runs as any
	// duplicate does (its claim finds it, with its span and metrics), and
	// does not count.
	return w.process(rec), !finished
}

// markRunning writes offset, and id when not nil, to the partition's row as
// the record running now (endProbe clears the mark). It reports false when
// the worker was stopped first.
func (w *worker) markRunning(offset int64, id *string) bool {
	c := w.r.c
	return w.untilDone(func(ctx context.Context) error {
		_, err := c.cfg.Pool.Exec(ctx, c.owners.mark, c.cfg.Group, w.tp.topic, w.tp.partition, w.owner, offset, id)
		return err
	})
}

// suspectID is the id to dead-letter a crash-looping record by, found
// without running user code: the id the dead owner marked it with; else,
// without a KeyFunc, its header id; else (its KeyFunc may be what kills the
// process) topic/partition/offset, as an undecodable record's.
func (c *Consumer) suspectID(rec *kgo.Record, recorded string) string {
	if recorded != "" {
		return recorded
	}
	if c.cfg.KeyFunc == nil {
		if id, err := c.messageID(rec); err == nil {
			return id
		}
	}
	return c.fallbackID(rec)
}

// crashLooped dead-letters rec, which the process died running kills times,
// unless the inbox holds it already (it finished before the death that
// counted last): then it is a duplicate, skipped without running any user
// code. It reports false when the worker was stopped first.
func (w *worker) crashLooped(rec *kgo.Record, id string, kills int) bool {
	c := w.r.c
	claimed := false
	if !w.untilDone(func(ctx context.Context) error {
		o, err := c.inbox.Lookup(ctx, c.cfg.Pool, c.cfg.Group, id)
		switch {
		case err == nil:
			// A redrive of a dead-lettered record runs again: it may
			// crash-loop again.
			claimed = o == dedup.Processed || !isRedrive(rec)
		case errors.Is(err, dedup.ErrNotClaimed):
			err = nil
		}
		return err
	}) {
		return false
	}
	if claimed {
		c.countDuplicate(w.ctx, rec)
		return w.hook(w.r.hooks.AfterCommit, rec)
	}
	now := time.Now()
	if !w.deadLetter(rec, id, failure{
		class: dlq.ClassCrashLoop, attempts: kills, first: now, last: now,
		err: fmt.Errorf("consumer: the process died %d times while this record was being processed (CrashLoopLimit %d)", kills, c.cfg.CrashLoopLimit),
	}) {
		return false
	}
	c.crashLoops.Add(1)
	c.cfg.Logger.Error("oncely record killed the process repeatedly; dead-lettered as a crash loop", "topic", rec.Topic,
		"partition", rec.Partition, "offset", rec.Offset, "message_id", id, "deaths", kills, "dlq_topic", c.cfg.DeadLetterTopic(rec.Topic))
	return true
}

// untilDone runs a statement of the partition's own until the database
// answers it, waiting with backoff (as the partition does) meanwhile. It
// reports false when the worker was stopped first.
func (w *worker) untilDone(stmt func(ctx context.Context) error) bool {
	c := w.r.c
	for n := 1; ; n++ {
		err := stmt(w.ctx)
		if err == nil {
			w.databaseDown(false)
			return true
		}
		if w.ctx.Err() != nil {
			return false
		}
		w.databaseDown(true)
		c.outage.Warn(w.ctx, "oncely partition owner statement failed; retrying", "topic", w.tp.topic, "partition", w.tp.partition, "err", err)
		if !w.sleep(c.backoff.Delay(n)) {
			return false
		}
	}
}

// forgetTimeout bounds the deletion of a member's rows when its partitions
// leave it cleanly, retries included; a shutdown or a revoke that must end
// sooner bounds it sooner.
const forgetTimeout = 5 * time.Second

// forget deletes the rows of ws's partitions: they leave the member cleanly,
// so their next owner starts without a probe. A crashed run forgets nothing.
// A row of a partition that moved on already belongs to its next owner and
// is left alone (the owner token differs). A failed deletion is retried with
// backoff until ctx's deadline, forgetTimeout, or the shutdown's deadline,
// whichever comes first: a row left behind makes the next owner count a
// clean exit as a death (and, if a record was marked running, count it
// against that record).
//
// A member that lost its partitions while alive (onLost: its session
// expired, or it was fenced) deletes its rows too, but its next owner may
// have written the row first: that start counted the loss as a death, as
// nothing in the row tells a live former owner from a dead one. The
// partition then runs in probe, and if the lost member was running a probe
// record, a death is counted against it; with CrashLoopLimit at 2 or more,
// one such loss cannot dead-letter a record.
func (r *run) forget(ctx context.Context, ws []*worker) {
	c := r.c
	if !c.crashLoopOn() || r.crashed.Load() || len(ws) == 0 {
		return
	}
	owners := make([]string, 0, len(ws))
	for _, w := range ws {
		if !w.forgotten.Swap(true) { // a shutdown forgets, then leaving revokes
			owners = append(owners, w.owner)
		}
	}
	if len(owners) == 0 {
		return
	}
	by := time.Now().Add(forgetTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(by) {
		by = d
	}
	if s := r.stopBy.Load(); s != 0 && s < by.UnixNano() {
		by = time.Unix(0, max(s, time.Now().Add(time.Second).UnixNano()))
	}
	fctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), by)
	defer cancel()
	for n := 1; ; n++ {
		_, err := c.cfg.Pool.Exec(fctx, c.owners.forget, c.cfg.Group, owners)
		if err == nil {
			return
		}
		t := time.NewTimer(c.backoff.Delay(n))
		select {
		case <-t.C:
			continue
		case <-fctx.Done():
			t.Stop()
		}
		c.cfg.Logger.Warn("oncely could not record that partitions left cleanly; their next owner will probe them", "attempts", n, "err", err)
		return
	}
}
