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
	var recs []*kgo.Record
	err = topicread.Range(ctx, ix.opts, topic, from, ends, func(r *kgo.Record) error {
		r.Value = nil
		recs = append(recs, r)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("dead letters: %w", err)
	}
	topicread.Sort(recs)
	t.add(recs, ends)
	return t, nil
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

// add indexes recs, sorted by partition and offset, read up to ends.
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
