package console

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/rabbitconsumer"
	"github.com/oncely/oncely/webhook/outbound"
)

var rabbitKind = sourceKind{Param: "queue", Noun: "queue", Broker: "RabbitMQ", Origin: "queue"}

// rabbitSource is RabbitMQ's dead-letter queues, read through
// rabbitconsumer.OpenDeadLetters. A queue is not a log: it cannot be read
// from an offset on, and a listing delivers every message to the console,
// which holds them (invisible to any other consumer of the queue) until it
// closes the listing. So no listing is kept open between requests: each
// listing is closed before the request (or the round of Console.Run) that
// made it ends, and the pages are served from a snapshot, the index of the
// last listing (see view). An action lists the queue itself: a confirmed
// redrive selects from a listing of its own (and redrives from another,
// as rabbitconsumer.DeadLetterQueue.Redrive must), never from the
// snapshot.
//
// A listing's positions are not stable (a redrive, or another reader,
// shifts them), so the console numbers the dead letters itself: a message
// gets the next number of its queue the first time a listing shows it,
// and keeps it in every later listing of this console process, recognised
// by a hash of its body and headers (which carry the group, dedup id,
// source queue and times of its dead-lettering; the queue's delivery
// counts, which a listing changes, are left out). Identical messages are
// told apart by their order. The numbers are the offsets of partition 0:
// refs ("0/17"), pages and the dry run's upper bound ("upto") use them as
// they use a Kafka topic's, and a message dead-lettered after a dry run
// has a higher number than any the dry run showed. Numbers are those of
// one process: a confirmation carries the process's numbering (see
// numbering) and is refused by another, or after a restart.
type rabbitSource struct {
	url     string
	queues  []string
	epoch   string        // this process's numbering
	timeout time.Duration // Config.Timeout: a listing's in the background

	mu sync.Mutex
	qs map[string]*rabbitQueue
}

// rabbitQueue is the console's numbering of one queue's dead letters.
type rabbitQueue struct {
	list sync.Mutex // one listing of the queue at a time in this process

	mu   sync.Mutex // guards what follows
	next int64
	seen map[[sha256.Size]byte]*seenMessage
	// whole is the last listing's records, with value and headers, by
	// number (withValues).
	whole map[int64]*kgo.Record
	// snap is the index of the last listing, taken at at, which held
	// held messages (copies included): the pages' snapshot (view).
	snap *topicIndex
	at   time.Time
	held int

	bg background // the listing that views start
}

// seenMessage is the numbers of the messages with one hash, in listing
// order, and when a listing last showed one.
type seenMessage struct {
	nums []int64
	at   time.Time
}

// forgetAfter is how long the numbers of messages no listing shows are
// kept: a message held by another reader meanwhile keeps its number.
const forgetAfter = 10 * time.Minute

func newRabbitSource(url string, queues []string, timeout time.Duration) *rabbitSource {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	queues = slices.Clone(queues)
	slices.Sort(queues)
	return &rabbitSource{url: url, queues: slices.Compact(queues), epoch: hex.EncodeToString(b), qs: map[string]*rabbitQueue{}, timeout: timeout}
}

func (*rabbitSource) kind() sourceKind { return rabbitKind }

// places returns the configured queues: RabbitMQ cannot list queues over
// AMQP (only its management plugin can), so they are named.
func (r *rabbitSource) places(context.Context) ([]string, error) { return r.queues, nil }

func (r *rabbitSource) numbering() string { return r.epoch }

func (r *rabbitSource) queue(name string) (*rabbitQueue, error) {
	if name == "" {
		return nil, badRequest{"queue: choose a dead-letter queue"}
	}
	if !slices.Contains(r.queues, name) {
		return nil, badRequest{fmt.Sprintf("queue: %q is not a dead-letter queue of the console (Config.DeadLetterQueues)", name)}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	q := r.qs[name]
	if q == nil {
		q = &rabbitQueue{seen: map[[sha256.Size]byte]*seenMessage{}}
		r.qs[name] = q
	}
	return q, nil
}

// open lists the queue: the caller holds q.list and closes the listing.
// Its entries are numbered (Record.Offset is still the listing's
// position); nums[i] is entries[i]'s number.
func (r *rabbitSource) open(ctx context.Context, name string, q *rabbitQueue) (*rabbitconsumer.DeadLetterQueue, []dlq.Entry, []int64, error) {
	dl, err := rabbitconsumer.OpenDeadLetters(ctx, r.url, name)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("dead letters: RabbitMQ at %s: %w", outbound.RedactURL(r.url), err)
	}
	entries, err := dl.Entries(ctx, dlq.Filter{})
	if err != nil {
		_ = dl.Close()
		return nil, nil, nil, fmt.Errorf("dead letters: %w", err)
	}
	return dl, entries, q.number(entries), nil
}

// number returns the numbers of a listing's entries, giving the next ones
// to messages not seen before, and forgets those not seen for forgetAfter.
func (q *rabbitQueue) number(entries []dlq.Entry) []int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	now := time.Now()
	nums := make([]int64, len(entries))
	occurrence := map[[sha256.Size]byte]int{}
	for i, e := range entries {
		h := messageHash(e.Record)
		k := occurrence[h]
		occurrence[h]++
		s := q.seen[h]
		if s == nil {
			s = &seenMessage{}
			q.seen[h] = s
		}
		if k == len(s.nums) {
			s.nums = append(s.nums, q.next)
			q.next++
		}
		s.at, nums[i] = now, s.nums[k]
	}
	for h, s := range q.seen {
		if now.Sub(s.at) > forgetAfter {
			delete(q.seen, h)
		}
	}
	return nums
}

// messageHash identifies a dead letter across listings: its body and
// headers, without the delivery counts that each listing changes.
func messageHash(rec *kgo.Record) [sha256.Size]byte {
	h := sha256.New()
	field := func(b []byte) {
		_ = binary.Write(h, binary.BigEndian, uint64(len(b)))
		h.Write(b)
	}
	field(rec.Value)
	for _, hd := range rec.Headers { // sorted by name (rabbitconsumer's records)
		if hd.Key == rabbitconsumer.DeliveryCountHeader || hd.Key == rabbitconsumer.AcquiredCountHeader {
			continue
		}
		field([]byte(hd.Key))
		field(hd.Value)
	}
	var out [sha256.Size]byte
	h.Sum(out[:0])
	return out
}

// sync lists the queue (and closes the listing), indexes what it listed
// by number, and keeps the index as the queue's snapshot.
func (r *rabbitSource) sync(ctx context.Context, name string) (*topicIndex, error) {
	q, err := r.queue(name)
	if err != nil {
		return nil, err
	}
	q.list.Lock()
	defer q.list.Unlock()
	dl, entries, nums, err := r.open(ctx, name, q)
	if err != nil {
		return nil, err
	}
	r.close(ctx, name, dl, held(entries))
	return q.store(name, entries, nums), nil
}

// store indexes a listing's entries (nums their numbers) and keeps the
// index as the queue's snapshot, and their records whole for withValues.
func (q *rabbitQueue) store(name string, entries []dlq.Entry, nums []int64) *topicIndex {
	order := make([]int, len(entries))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return cmp.Compare(nums[a], nums[b]) })
	whole := make(map[int64]*kgo.Record, len(entries))
	listed := make([]dlq.Entry, len(entries))
	var next int64
	for i, k := range order {
		e := entries[k]
		whole[nums[k]] = &kgo.Record{Topic: name, Offset: nums[k], Key: e.Record.Key, Value: e.Record.Value,
			Headers: e.Record.Headers, Timestamp: e.Record.Timestamp}
		rec := *whole[nums[k]]
		rec.Value, rec.Headers = nil, slices.Clone(rec.Headers) // the index keeps neither
		e.Record = &rec
		listed[i] = e
		next = max(next, nums[k]+1)
	}
	ix := &topicIndex{parts: map[int32]*partIndex{}, ids: map[idKey]*identity{}}
	ix.addEntries(listed, map[int32]int64{0: next})
	q.mu.Lock()
	defer q.mu.Unlock()
	q.whole, q.snap, q.at, q.held = whole, ix, time.Now(), held(entries)
	return ix
}

// relistGap is the least time between two listings of a queue that views
// start: a queue whose count keeps changing is listed at most that often
// (besides the actions' and Console.Run's listings).
const relistGap = 2 * time.Second

// snapshotMaxAge is the age past which a view (or Console.Run) lists a
// queue again although its count did not change: one message taken and
// another dead-lettered leave the count as it was.
const snapshotMaxAge = time.Minute

// view serves the pages from the queue's snapshot, the index of its last
// listing, while the queue still holds as many messages ready as that
// listing did and the snapshot is younger than snapshotMaxAge (a passive
// declaration tells, without listing). Otherwise it lists the queue in the
// background (one listing at a time, and from views at most once in
// relistGap) and waits for it up to budget (0: until it is done); past
// that, the page shows the snapshot with a note that gives its time and
// the count now.
func (r *rabbitSource) view(ctx context.Context, name string, budget time.Duration) (*topicIndex, string, error) {
	q, err := r.queue(name)
	if err != nil {
		return nil, "", err
	}
	ready, err := r.ready(ctx, name)
	if err != nil {
		return nil, "", err
	}
	q.mu.Lock()
	snap, at, n := q.snap, q.at, q.held
	q.mu.Unlock()
	age := time.Since(at)
	if snap != nil && (ready == n && age < snapshotMaxAge || budget > 0 && age < relistGap) {
		return snap, stale(name, at, n, ready), nil
	}
	ended, err := q.bg.wait(ctx, budget, r.timeout, func(ctx context.Context) error {
		_, err := r.sync(ctx, name)
		return err
	})
	if err != nil {
		return nil, "", err
	}
	if ended {
		q.mu.Lock()
		defer q.mu.Unlock()
		return q.snap, "", nil
	}
	if snap == nil {
		empty := &topicIndex{parts: map[int32]*partIndex{}, ids: map[idKey]*identity{}}
		return empty, fmt.Sprintf("Listing queue %s (%d messages ready) in the background: reload in a moment to see them.", name, ready), nil
	}
	return snap, strings.TrimSpace(stale(name, at, n, ready) + " A new listing is under way: reload to see it."), nil
}

// stale is the note of a snapshot of n messages taken at at, of a queue
// that holds ready now: none when they are as many.
func stale(name string, at time.Time, n, ready int) string {
	if n == ready {
		return ""
	}
	return fmt.Sprintf("Shown is the listing of queue %s taken at %s, of %d messages; it holds %d ready now.", name, formatTime(at), n, ready)
}

// ready is the number of messages ready in queue, from a passive
// declaration.
func (r *rabbitSource) ready(ctx context.Context, queue string) (int, error) {
	ch, done, err := r.channel(ctx)
	if err != nil {
		return 0, fmt.Errorf("dead letters: RabbitMQ at %s: %w", outbound.RedactURL(r.url), err)
	}
	defer done()
	st, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if ae := (*amqp.Error)(nil); errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return 0, fmt.Errorf("dead letters: queue %s does not exist: %w", queue, err)
	}
	if err != nil {
		return 0, fmt.Errorf("dead letters: queue %s: %w", queue, err)
	}
	return st.Messages, nil
}

// dial opens a connection of the console's own, within returnWait (and
// ctx's deadline).
func (r *rabbitSource) dial(ctx context.Context) (*amqp.Connection, error) {
	timeout := returnWait
	if d, ok := ctx.Deadline(); ok {
		timeout = min(timeout, time.Until(d))
	}
	return amqp.DialConfig(r.url, amqp.Config{Dial: amqp.DefaultDial(timeout)})
}

// channel opens a connection of its own and a channel on it; done closes
// them.
func (r *rabbitSource) channel(ctx context.Context) (*amqp.Channel, func(), error) {
	conn, err := r.dial(ctx)
	if err != nil {
		return nil, nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return nil, nil, err
	}
	return ch, func() { _ = conn.Close() }, nil
}

// withValues returns the entries' messages whole, as the listing of the
// request's sync read them.
func (r *rabbitSource) withValues(_ context.Context, name string, entries []dlq.Entry) ([]dlq.Entry, error) {
	q, err := r.queue(name)
	if err != nil {
		return nil, err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	out := slices.Clone(entries)
	for i, e := range entries {
		rec := q.whole[e.Record.Offset]
		if rec == nil {
			return nil, fmt.Errorf("dead letters: %s is no longer in queue %s (redriven or taken)", e.Ref(), name)
		}
		out[i].Record = rec
	}
	return out, nil
}

// redrive lists the queue again and redrives, from that listing, the
// messages numbered as entries are: those still there (a message another
// reader took or holds meanwhile is not redriven, and reported). The
// listing is closed before it returns: what was not redriven goes back.
func (r *rabbitSource) redrive(ctx context.Context, entries []dlq.Entry, opts dlq.RedriveOptions) ([]dlq.Result, error) {
	if len(entries) == 0 {
		return nil, nil
	}
	name := entries[0].Record.Topic
	q, err := r.queue(name)
	if err != nil {
		return nil, err
	}
	want := make(map[int64]bool, len(entries))
	for _, e := range entries {
		want[e.Record.Offset] = true
	}
	q.list.Lock()
	defer q.list.Unlock()
	dl, listed, nums, err := r.open(ctx, name, q)
	if err != nil {
		return nil, err
	}
	var picked []dlq.Entry
	var pickedNums []int64
	for i, e := range listed {
		if want[nums[i]] {
			picked, pickedNums = append(picked, e), append(pickedNums, nums[i])
			delete(want, nums[i])
		}
	}
	results, err := dl.Redrive(ctx, picked, opts)
	// What the listing still holds is the queue's snapshot: the pages the
	// redrive leads to show it without the messages redriven.
	if rest, lerr := dl.Entries(ctx, dlq.Filter{}); lerr == nil {
		q.store(name, rest, q.number(rest))
	}
	removed := 0
	for _, res := range results {
		if res.Action == dlq.Redriven {
			removed += res.Entry.Copies
		}
	}
	r.close(ctx, name, dl, held(listed)-removed)
	// The results name the console's numbers, not the listing's positions.
	for i := range picked {
		rec := *picked[i].Record
		rec.Offset = pickedNums[i]
		picked[i].Record = &rec
	}
	if err == nil && len(want) > 0 {
		missing := make([]string, 0, len(want))
		for n := range want {
			missing = append(missing, fmt.Sprintf("%s/0/%d", name, n))
		}
		slices.Sort(missing)
		err = fmt.Errorf("dead letters: %d selected were no longer in queue %s (taken or held by another reader): %v", len(missing), name, missing)
	}
	return results, err
}

// held is the number of messages a listing of entries holds: copies
// included.
func held(entries []dlq.Entry) int {
	n := 0
	for _, e := range entries {
		n += e.Copies
	}
	return n
}

// returnWait bounds close's wait for the messages of a listing to be back
// in the queue.
const returnWait = 2 * time.Second

// close closes a listing of queue that held n messages (those it did not
// remove) and waits, while the caller still holds the queue's list lock,
// until the queue has at least n messages ready again: RabbitMQ requeues
// the messages of a closed channel asynchronously, and a listing that
// started before they were back would not see them (a view would show
// fewer dead letters, a confirmation find some "no longer in the queue").
// The wait ends after returnWait in any case (another reader may hold
// some).
func (r *rabbitSource) close(ctx context.Context, queue string, dl *rabbitconsumer.DeadLetterQueue, n int) {
	_ = dl.Close()
	if n == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, returnWait)
	defer cancel()
	ch, done, err := r.channel(ctx)
	if err != nil {
		return
	}
	defer done()
	poll := time.Millisecond
	for {
		st, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil || st.Messages >= n {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(poll): // the broker's count has no notification to wait on
		}
		poll = min(2*poll, 50*time.Millisecond)
	}
}

// origin: the source queue and the delivery that was dead-lettered.
func (*rabbitSource) origin(e *dlq.Entry) []header {
	if e.Info == nil {
		return nil
	}
	return []header{{"source", fmt.Sprintf("queue %s, delivery %d, published %s", e.Info.Topic, e.Info.Offset, formatTime(e.Info.Timestamp))}}
}
