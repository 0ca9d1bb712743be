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
	adm := kadm.NewClient(admin)
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err == nil {
		err = starts.Error()
	}
	if err != nil {
		return fmt.Errorf("list start offsets of %s: %w", topic, err)
	}
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return fmt.Errorf("list end offsets of %s: %w", topic, err)
	}
	from := map[int32]kgo.Offset{}
	remaining := map[int32]int64{} // partition -> end offset still to reach
	starts.Each(func(o kadm.ListedOffset) {
		if end, ok := ends.Lookup(topic, o.Partition); ok && end.Offset > o.Offset {
			from[o.Partition] = kgo.NewOffset().At(o.Offset)
			remaining[o.Partition] = end.Offset
		}
	})
	if len(remaining) == 0 {
		return nil
	}
	cl, err := kgo.NewClient(append(slices.Clone(opts), kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: from}),
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
			if stop != nil || !ok || r.Offset >= end {
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
