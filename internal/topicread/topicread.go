// Package topicread reads a whole topic, as it stands, with franz-go: the
// dead-letter tools and the example's history check both need every record
// from each partition's start to its end at the time of the call.
package topicread

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// All returns every record of topic from the start of each partition to its
// end offset when All was called, in partition order and, within a
// partition, in offset order. opts configure the clients it creates (seed
// brokers, TLS, SASL, the isolation level); records produced meanwhile are
// not waited for. Transaction markers are not returned, but count as read: a
// partition that ends with one (or, read committed, with an aborted
// transaction) is read to its end all the same.
func All(ctx context.Context, opts []kgo.Opt, topic string) ([]*kgo.Record, error) {
	var recs []*kgo.Record
	if err := Each(ctx, opts, topic, func(r *kgo.Record) error {
		recs = append(recs, r)
		return nil
	}); err != nil {
		return nil, err
	}
	Sort(recs)
	return recs, nil
}

// Sort orders records by partition and, within a partition, by offset.
func Sort(recs []*kgo.Record) {
	slices.SortStableFunc(recs, func(a, b *kgo.Record) int {
		return cmp.Or(cmp.Compare(a.Partition, b.Partition), cmp.Compare(a.Offset, b.Offset))
	})
}

// Each calls fn with every record of topic from the start of each partition
// to its end offset when Each was called: in offset order within a
// partition, partitions interleaved as they are fetched. Transaction markers
// are not passed to fn, but count as read (see All). It stops at the first
// error of fn and returns it.
func Each(ctx context.Context, opts []kgo.Opt, topic string, fn func(*kgo.Record) error) error {
	admin, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	defer admin.Close()
	starts, ends, err := Offsets(ctx, kadm.NewClient(admin), topic)
	if err != nil {
		return err
	}
	return Range(ctx, opts, topic, starts, ends, fn)
}

// Offsets returns each partition's start and end offset.
func Offsets(ctx context.Context, adm *kadm.Client, topic string) (starts, ends map[int32]int64, err error) {
	ls, err := adm.ListStartOffsets(ctx, topic)
	if err == nil {
		err = ls.Error()
	}
	if err != nil {
		return nil, nil, fmt.Errorf("list start offsets of %s: %w", topic, err)
	}
	le, err := adm.ListEndOffsets(ctx, topic)
	if err == nil {
		err = le.Error()
	}
	if err != nil {
		return nil, nil, fmt.Errorf("list end offsets of %s: %w", topic, err)
	}
	starts, ends = map[int32]int64{}, map[int32]int64{}
	ls.Each(func(o kadm.ListedOffset) { starts[o.Partition] = o.Offset })
	le.Each(func(o kadm.ListedOffset) { ends[o.Partition] = o.Offset })
	return starts, ends, nil
}

// Range calls fn with every record of topic from offset from[p] up to, not
// including, to[p], for each partition p of to (from a missing from[p]: the
// partition's start), in offset order within a partition. Offsets missing
// from the log (compacted, or a transaction marker) count as read: a
// partition is done at its first record at or beyond to[p]. It stops at the
// first error of fn and returns it.
func Range(ctx context.Context, opts []kgo.Opt, topic string, from, to map[int32]int64, fn func(*kgo.Record) error) error {
	at := map[int32]kgo.Offset{}
	remaining := map[int32]int64{} // partition -> end offset still to reach
	for p, end := range to {
		start := from[p]
		if end > start {
			at[p] = kgo.NewOffset().At(start)
			remaining[p] = end
		}
	}
	if len(remaining) == 0 {
		return nil
	}
	cl, err := kgo.NewClient(append(slices.Clone(opts), kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: at}),
		kgo.KeepControlRecords())...)
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	defer cl.Close()
	for len(remaining) > 0 {
		fetches := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("read %s: %w", topic, err)
		}
		var ferr error
		fetches.EachError(func(_ string, p int32, err error) { ferr = fmt.Errorf("read %s, partition %d: %w", topic, p, err) })
		if ferr != nil {
			return ferr
		}
		var stop error
		fetches.EachRecord(func(r *kgo.Record) {
			end, ok := remaining[r.Partition]
			if stop != nil || !ok {
				return
			}
			if r.Offset >= end {
				delete(remaining, r.Partition)
				return
			}
			if !r.Attrs.IsControl() {
				stop = fn(r)
			}
			if r.Offset+1 >= end {
				delete(remaining, r.Partition)
			}
		})
		if stop != nil {
			return stop
		}
	}
	return nil
}
