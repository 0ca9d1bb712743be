package console

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/topicread"
)

// dlqIndex holds, for each dead-letter topic, what the pages filter and
// count on: every record's place, key and decoded oncely headers, without
// its value or other headers. A topic is read from its start once, at its
// first use; every later use (each page view, each tick of Console.Run)
// asks the brokers for the partitions' start and end offsets and reads only
// the records appended since, and forgets those that retention deleted. A
// record's value is fetched from Kafka, by its offset, only when a page
// shows it or a redrive produces it.
//
// What it selects is what dlq.List selects on a topic read whole: copies of
// one dead-lettering are listed once, as the copy first in partition and
// offset order, and a filter decides on that copy.
type dlqIndex struct {
	opts []kgo.Opt
	ix   indexes
}

// indexes holds a source's index of each place, made at its first use.
type indexes struct {
	mu     sync.Mutex
	topics map[string]*topicIndex
}

type topicIndex struct {
	refresh sync.Mutex // one reader of Kafka at a time
	bg      background // the refresh that views start (viewIndex)
	// created is when a JetStream stream was created, held by its
	// refresh: another time means it was deleted and made again.
	created time.Time

	mu    sync.RWMutex // guards what follows
	parts map[int32]*partIndex
	ids   map[idKey]*identity
}

type partIndex struct {
	next int64      // the offset after the last one read
	recs []*indexed // in offset order
}

// indexed is one record of a dead-letter topic.
type indexed struct {
	rec  *kgo.Record // without its value, and with no header but dlq.HeaderStub
	info *dlq.Info   // nil when err is set
	err  error       // not a dead-letter record
	id   *identity   // nil when err is set
}

// identity is one dead-lettering: its copies in partition and offset
// order, the first of which is listed.
type identity struct {
	key    idKey
	copies []*indexed
}

// idKey names a dead-lettering: its group, dedup id and source record.
type idKey struct {
	group, messageID, topic string
	partition               int32
	offset                  int64
}

func (ix *indexes) get(name string) *topicIndex {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.topics == nil {
		ix.topics = map[string]*topicIndex{}
	}
	t := ix.topics[name]
	if t == nil {
		t = &topicIndex{parts: map[int32]*partIndex{}, ids: map[idKey]*identity{}}
		ix.topics[name] = t
	}
	return t
}

// sync brings the index of topic up to the partitions' current end
// offsets and returns it.
func (ix *dlqIndex) sync(ctx context.Context, topic string) (*topicIndex, error) {
	if topic == "" {
		return nil, badRequest{"topic: choose a dead-letter topic"}
	}
	if len(ix.opts) == 0 {
		return nil, errNoKafka
	}
	t := ix.ix.get(topic)
	t.refresh.Lock()
	defer t.refresh.Unlock()
	cl, err := kgo.NewClient(ix.opts...)
	if err != nil {
		return nil, fmt.Errorf("dead letters: client: %w", err)
	}
	starts, ends, err := topicread.Offsets(ctx, kadm.NewClient(cl), topic)
	cl.Close()
	if err != nil {
		return nil, fmt.Errorf("dead letters: %w", err)
	}
	from := t.trim(starts, ends)
	// Indexed a chunk at a time: a view that does not wait for the whole
	// read (viewIndex) shows what was read so far, and a read that fails
	// is taken up after the last chunk by the next one.
	var recs []*kgo.Record
	err = topicread.Range(ctx, ix.opts, topic, from, ends, func(r *kgo.Record) error {
		r.Value = nil
		recs = append(recs, r)
		if len(recs) == indexChunk {
			topicread.Sort(recs)
			t.add(recs, nil)
			recs = nil
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("dead letters: %w", err)
	}
	topicread.Sort(recs)
	t.add(recs, ends)
	return t, nil
}

// indexChunk is the number of records a read of a place indexes at once.
const indexChunk = 5000

// background is the refresh of a place that views start: one at a time,
// run on a context of its own (bounded by Config.Timeout), so that a view
// that stops waiting for it does not cancel it.
type background struct {
	mu   sync.Mutex
	done chan struct{} // closed when the running refresh ends; nil: none runs
	err  error         // of the refresh that ended last
}

// wait starts refresh unless one runs, and waits for the running one up to
// budget (0: until it ends or ctx is done). It reports whether it ended,
// and its error.
func (b *background) wait(ctx context.Context, budget, timeout time.Duration, refresh func(context.Context) error) (bool, error) {
	b.mu.Lock()
	done := b.done
	if done == nil {
		done = make(chan struct{})
		b.done = done
		go func() {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
			err := refresh(rctx)
			cancel()
			b.mu.Lock()
			b.err, b.done = err, nil
			b.mu.Unlock()
			close(done)
		}()
	}
	b.mu.Unlock()
	var expired <-chan time.Time
	if budget > 0 {
		t := time.NewTimer(budget)
		defer t.Stop()
		expired = t.C
	}
	select {
	case <-done:
		b.mu.Lock()
		defer b.mu.Unlock()
		return true, b.err
	case <-expired:
		return false, nil
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

// viewIndex brings the index t of src's place up to date by src.sync, in
// the background (t.bg), waiting up to budget (0: until it is): past it,
// it returns t as it stands and a note that says so.
func viewIndex(ctx context.Context, src deadLetterSource, t *topicIndex, place string, budget, timeout time.Duration) (*topicIndex, string, error) {
	ended, err := t.bg.wait(ctx, budget, timeout, func(ctx context.Context) error {
		_, err := src.sync(ctx, place)
		return err
	})
	if err != nil {
		return nil, "", err
	}
	if ended {
		return t, "", nil
	}
	k := src.kind()
	return t, fmt.Sprintf("Still reading %s %s %s: shown and counted are the %d records read so far. Reload to see the rest.",
		k.Broker, k.Noun, place, t.size()), nil
}

// trim forgets the records below each partition's start offset (deleted
// by retention), and everything when a partition's end offset went back
// (the topic was deleted and created again). It returns where to read from.
func (t *topicIndex) trim(starts, ends map[int32]int64) map[int32]int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	for p, pi := range t.parts {
		if end, ok := ends[p]; !ok || end < pi.next {
			t.clear()
			break
		}
	}
	from := map[int32]int64{}
	for p, start := range starts {
		pi := t.parts[p]
		if pi == nil {
			from[p] = start
			continue
		}
		n := 0
		for n < len(pi.recs) && pi.recs[n].rec.Offset < start {
			t.forget(pi.recs[n])
			n++
		}
		pi.recs = slices.Delete(pi.recs, 0, n)
		from[p] = max(pi.next, start)
	}
	return from
}

// clear forgets every record; t.mu is held.
func (t *topicIndex) clear() {
	t.parts, t.ids = map[int32]*partIndex{}, map[idKey]*identity{}
}

// reset forgets every record: the next sync reads the place whole.
func (t *topicIndex) reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.clear()
}

// size is the number of records indexed (copies and records that are not
// dead letters included).
func (t *topicIndex) size() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	n := 0
	for _, pi := range t.parts {
		n += len(pi.recs)
	}
	return n
}

func (t *topicIndex) forget(x *indexed) {
	if x.id == nil {
		return
	}
	x.id.copies = slices.DeleteFunc(x.id.copies, func(c *indexed) bool { return c == x })
	if len(x.id.copies) == 0 {
		delete(t.ids, x.id.key)
	}
}

// add indexes recs, sorted by partition and offset, read up to ends (and
// at least to the record after each one).
func (t *topicIndex) add(recs []*kgo.Record, ends map[int32]int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range recs {
		x := &indexed{rec: r}
		x.info, x.err = dlq.Decode(r.Headers)
		var stub []kgo.RecordHeader
		for _, h := range r.Headers {
			if h.Key == dlq.HeaderStub {
				stub = append(stub, h)
			}
		}
		r.Headers = stub
		if x.info != nil {
			i := x.info
			key := idKey{i.Group, i.MessageID, i.Topic, i.Partition, i.Offset}
			id := t.ids[key]
			if id == nil {
				id = &identity{key: key}
				t.ids[key] = id
			}
			x.id = id
			n, _ := slices.BinarySearchFunc(id.copies, x, func(c, x *indexed) int {
				return cmp.Or(cmp.Compare(c.rec.Partition, x.rec.Partition), cmp.Compare(c.rec.Offset, x.rec.Offset))
			})
			id.copies = slices.Insert(id.copies, n, x)
		}
		pi := t.parts[r.Partition]
		if pi == nil {
			pi = &partIndex{}
			t.parts[r.Partition] = pi
		}
		pi.recs = append(pi.recs, x)
		pi.next = max(pi.next, r.Offset+1)
	}
	for p, end := range ends {
		pi := t.parts[p]
		if pi == nil {
			pi = &partIndex{}
			t.parts[p] = pi
		}
		pi.next = max(pi.next, end)
	}
}

// each calls fn with the entry of every listed record (the first copy of
// each dead-lettering, and every record that is not one) in partition and
// offset order, until fn returns false. The entries' records have no value.
func (t *topicIndex) each(fn func(e dlq.Entry) bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	ps := make([]int32, 0, len(t.parts))
	for p := range t.parts {
		ps = append(ps, p)
	}
	slices.Sort(ps)
	for _, p := range ps {
		for _, x := range t.parts[p].recs {
			e := dlq.Entry{Record: x.rec, Info: x.info, Err: x.err, Copies: 1}
			if x.id != nil {
				if x.id.copies[0] != x {
					continue
				}
				e.Copies = len(x.id.copies)
			}
			if !fn(e) {
				return
			}
		}
	}
}

// withValues returns entries with their records read whole from Kafka (by
// offset: only the partitions' ranges that hold them are read). It fails if
// one of them is no longer in the topic.
func (ix *dlqIndex) withValues(ctx context.Context, topic string, entries []dlq.Entry) ([]dlq.Entry, error) {
	if len(entries) == 0 {
		return entries, nil
	}
	from, to := map[int32]int64{}, map[int32]int64{}
	want := map[int32]map[int64]int{}
	for i, e := range entries {
		p, o := e.Record.Partition, e.Record.Offset
		if want[p] == nil {
			want[p] = map[int64]int{}
			from[p], to[p] = o, o+1
		}
		want[p][o] = i
		from[p], to[p] = min(from[p], o), max(to[p], o+1)
	}
	opts := ix.opts
	if span := func() (n int64) {
		for p := range to {
			n += to[p] - from[p]
		}
		return n
	}(); span <= pageSize {
		// A few records: a fetch of 1 byte a partition still returns the
		// whole batch that holds the first offset asked for, and no more
		// (by default a fetch brings a MiB of each partition: ten times
		// slower for one record).
		opts = append(slices.Clone(opts), kgo.FetchMaxPartitionBytes(1))
	}
	out := slices.Clone(entries)
	got := make([]bool, len(entries))
	err := topicread.Range(ctx, opts, topic, from, to, func(r *kgo.Record) error {
		if i, ok := want[r.Partition][r.Offset]; ok {
			out[i].Record, got[i] = r, true
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("dead letters: read records: %w", err)
	}
	for i, ok := range got {
		if !ok {
			return nil, fmt.Errorf("dead letters: %s is no longer in the topic (deleted by retention)", entries[i].Ref())
		}
	}
	return out, nil
}

// addEntries indexes the entries of a listing that counted the copies of
// each dead-lettering itself (dlq.Entries): each entry is its first copy,
// and its other copies are counted, not held.
func (t *topicIndex) addEntries(entries []dlq.Entry, ends map[int32]int64) {
	recs := make([]*kgo.Record, len(entries))
	for i, e := range entries {
		recs[i] = e.Record
	}
	t.add(recs, ends)
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range entries {
		if e.Info == nil || e.Copies < 2 {
			continue
		}
		i := e.Info
		id := t.ids[idKey{i.Group, i.MessageID, i.Topic, i.Partition, i.Offset}]
		for range e.Copies - 1 {
			id.copies = append(id.copies, &indexed{id: id}) // counted only: no record
		}
	}
}
