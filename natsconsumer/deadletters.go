package natsconsumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
)

// DeadLetters reads the dead-letter stream from its first message to the
// last one stored when it starts (ReadStream), and returns the entries that
// match f (dlq.Entries; with f.RefuseInvalid, an *dlq.InvalidRecordError
// for a message that is not a dead letter): the tools of package dlq, and
// `oncely dlq --stream`, on a JetStream dead-letter stream. An entry's
// Record is its dead-letter message: Topic its subject, Partition 0, Offset
// its stream sequence, so its Ref is subject/0/sequence and f.Refs may name
// it as 0/sequence.
func DeadLetters(ctx context.Context, js jetstream.JetStream, stream string, f dlq.Filter) ([]dlq.Entry, error) {
	recs, err := ReadStream(ctx, js, stream)
	if err != nil {
		return nil, err
	}
	return dlq.Entries(recs, f)
}

// ReadStream returns the messages of stream from its first to the last one
// stored when it starts, as records (see ReadRange).
func ReadStream(ctx context.Context, js jetstream.JetStream, stream string) ([]*kgo.Record, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("natsconsumer: stream %q: %w", stream, err)
	}
	state := s.CachedInfo().State
	var recs []*kgo.Record
	err = ReadRange(ctx, s, StreamRange{From: state.FirstSeq, To: state.LastSeq + 1}, func(r *kgo.Record) error {
		recs = append(recs, r)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return recs, nil
}

// StreamRange is the part of a stream that ReadRange reads.
type StreamRange struct {
	// From and To bound the stream sequences read: From included, To not.
	From, To uint64
	// HeadersOnly leaves the messages' data out (the server sends their
	// headers only, plus Nats-Msg-Size): for an index of the headers.
	HeadersOnly bool
}

// fetchBatch is the number of messages ReadRange asks for at once.
const fetchBatch = 500

// ReadRange calls fn with each message of s whose sequence is in r, in
// sequence order, as a record: Topic the subject, Partition 0, Offset the
// stream sequence, Timestamp when it was stored, the headers in key order,
// and Key the HeaderKey header's value (JetStreamPublisher's key); until
// the last one of r stored, or fn's first error, which it returns.
// Messages deleted from r meanwhile are skipped. It reads through an
// ordered consumer, which acknowledges nothing and leaves the stream as it
// was.
func ReadRange(ctx context.Context, s jetstream.Stream, r StreamRange, fn func(*kgo.Record) error) error {
	next := max(r.From, 1)
	if next >= r.To {
		return nil
	}
	stream := s.CachedInfo().Config.Name
	oc, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: next, HeadersOnly: r.HeadersOnly})
	if err != nil {
		return fmt.Errorf("natsconsumer: read %q: %w", stream, err)
	}
	for {
		// No more than the range holds: the server then answers the fetch
		// as soon as they are sent, rather than at its expiry.
		batch, err := oc.Fetch(int(min(fetchBatch, r.To-next)), jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return fmt.Errorf("natsconsumer: read %q: %w", stream, err)
		}
		got := 0
		for m := range batch.Messages() {
			got++
			md, err := m.Metadata()
			if err != nil {
				return fmt.Errorf("natsconsumer: read %q: %w", stream, err)
			}
			seq := md.Sequence.Stream
			if seq >= r.To {
				return nil
			}
			rec := record(m, md)
			if k := m.Headers().Get(HeaderKey); k != "" {
				rec.Key = []byte(k)
			}
			if err := fn(rec); err != nil {
				return err
			}
			next = seq + 1
			if next >= r.To || md.NumPending == 0 {
				return nil
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			return fmt.Errorf("natsconsumer: read %q: %w", stream, err)
		}
		if got == 0 { // the messages up to To were deleted meanwhile?
			if ci, err := oc.Info(ctx); err == nil && ci.NumPending == 0 {
				return nil
			}
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("natsconsumer: read %q: %w", stream, err)
		}
	}
}

// Redrive publishes entries (of DeadLetters) back to their source subjects
// (or opts.ToTopic) as dlq.RedriveWith does: each after recording its
// redrive grant in opts.Inbox, each waiting for its PubAck. A redriven
// message carries its dedup id in the opts.IDHeader header (default
// "message-id": set it to the consumer's Config.MessageIDHeader) and no
// Nats-Msg-Id, so JetStream's duplicate window, which still holds the
// original's id for a while, does not drop it; its Offset in the results is
// the stream sequence it was stored at.
func Redrive(ctx context.Context, js jetstream.JetStream, entries []dlq.Entry, opts dlq.RedriveOptions) ([]dlq.Result, error) {
	return dlq.RedriveWith(ctx, func(ctx context.Context, rec *kgo.Record) error {
		m := message(rec)
		m.Header.Del(nats.MsgIdHdr) // the dead-letter copy's own
		ack, err := js.PublishMsg(ctx, m)
		if err != nil {
			return fmt.Errorf("natsconsumer: publish to %s: %w", rec.Topic, err)
		}
		rec.Offset = int64(ack.Sequence)
		return nil
	}, entries, opts)
}
