package console

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/natsconsumer"
)

// deadLetterSource is one broker's dead letters: the places that hold them
// (Kafka's dead-letter topics, JetStream's dead-letter streams) and the
// four things the pages do with a place. The list, record, dry-run and
// redrive pages are the same for every source: they filter and count on
// the place's topicIndex, read the records they show or redrive whole
// through withValues, and redrive through redrive.
//
// A place's records are addressed as a Kafka topic's are, by partition and
// offset (a JetStream stream's: partition 0 and the stream sequence), as
// the dlq.Entries of the broker's own dead-letter tools address them. A
// broker whose dead letters cannot be read from an offset on (a RabbitMQ
// queue) is a source too: its sync reads the place whole into an index of
// the request's own, its offsets numbers the console gives (see
// rabbitSource and numbering).
type deadLetterSource interface {
	kind() sourceKind
	// places returns the dead-letter places shown, sorted.
	places(ctx context.Context) ([]string, error)
	// sync brings the index of place up to date and returns it: what an
	// action selects from.
	sync(ctx context.Context, place string) (*topicIndex, error)
	// view returns the index of place for a page, brought up to date
	// within budget (0: no limit but ctx's), or as it stands with a note
	// that says what it misses.
	view(ctx context.Context, place string, budget time.Duration) (*topicIndex, string, error)
	// withValues returns entries (of place's index) with their records read
	// whole, or an error naming one that is no longer there.
	withValues(ctx context.Context, place string, entries []dlq.Entry) ([]dlq.Entry, error)
	// redrive sends entries (read whole) back to their source, as
	// dlq.RedriveWith does: each after its redrive grant.
	redrive(ctx context.Context, entries []dlq.Entry, opts dlq.RedriveOptions) ([]dlq.Result, error)
	// origin describes where e's message came from, for the record page;
	// nil: the Kafka form (topic, partition, offset).
	origin(e *dlq.Entry) []header
	// numbering names the numbering of the offsets: "" when they are the
	// broker's (Kafka's offsets, JetStream's sequences), and otherwise the
	// console process's own (a RabbitMQ queue's numbers), which a
	// confirmation must have been dry-run under.
	numbering() string
}

// sourceKind names a source and its places in the pages.
type sourceKind struct {
	// Param is the query parameter that names a place of the source
	// ("topic", "stream"): dlq?stream=ORDERS_DLQ.
	Param string
	// Noun is what a place is ("topic", "stream") and Broker whose it is.
	Noun, Broker string
	// Origin is what a dead letter's source is called ("topic", "subject").
	Origin string
}

// kafkaKind is the Kafka source's; it is the default of a query that names
// no place by another parameter.
var kafkaKind = sourceKind{Param: "topic", Noun: "topic", Broker: "Kafka", Origin: "topic"}

// sources returns the sources the console shows, Kafka first: Kafka unless
// only JetStream or RabbitMQ is configured (without any, the Kafka source
// answers errNoKafka, as the pages always did).
func (s *server) sources() []deadLetterSource {
	var out []deadLetterSource
	if len(s.cfg.KafkaOpts) > 0 || !s.otherBrokers() {
		out = append(out, kafkaSource{s})
	}
	if s.jetstream != nil {
		out = append(out, s.jetstream)
	}
	if s.rabbit != nil {
		out = append(out, s.rabbit)
	}
	return out
}

// otherBrokers reports whether a broker other than Kafka is configured.
func (s *server) otherBrokers() bool { return s.jetstream != nil || s.rabbit != nil }

// source returns the source whose places param names.
func (s *server) source(param string) (deadLetterSource, error) {
	for _, src := range s.sources() {
		if src.kind().Param == param {
			return src, nil
		}
	}
	if param == kafkaKind.Param {
		return nil, errNoKafka
	}
	return nil, badRequest{fmt.Sprintf("%s: no such dead-letter source is configured", param)}
}

// placeParams are the query parameters that name a place, in the order a
// query is read by (a query that has several is read by the first).
var placeParams = []string{kafkaKind.Param, jetStreamKind.Param, rabbitKind.Param}

// ---- Kafka ----

// kafkaSource is Kafka's dead-letter topics, indexed by server.dlq.
type kafkaSource struct{ s *server }

func (kafkaSource) kind() sourceKind { return kafkaKind }

func (k kafkaSource) places(ctx context.Context) ([]string, error) { return k.s.dlqTopics(ctx) }

func (k kafkaSource) sync(ctx context.Context, topic string) (*topicIndex, error) {
	return k.s.dlq.sync(ctx, topic)
}

func (k kafkaSource) view(ctx context.Context, topic string, budget time.Duration) (*topicIndex, string, error) {
	if topic == "" {
		return nil, "", badRequest{"topic: choose a dead-letter topic"}
	}
	if len(k.s.dlq.opts) == 0 {
		return nil, "", errNoKafka
	}
	return viewIndex(ctx, k, k.s.dlq.ix.get(topic), topic, budget, k.s.cfg.Timeout)
}

func (k kafkaSource) withValues(ctx context.Context, topic string, entries []dlq.Entry) ([]dlq.Entry, error) {
	return k.s.dlq.withValues(ctx, topic, entries)
}

func (k kafkaSource) redrive(ctx context.Context, entries []dlq.Entry, opts dlq.RedriveOptions) ([]dlq.Result, error) {
	cl, err := k.s.kafka()
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	return dlq.Redrive(ctx, cl, entries, opts)
}

func (kafkaSource) origin(*dlq.Entry) []header { return nil }

func (kafkaSource) numbering() string { return "" }

// ---- JetStream ----

var jetStreamKind = sourceKind{Param: "stream", Noun: "stream", Broker: "JetStream", Origin: "subject"}

// deadLetterSubjectPrefix is what every subject of a dead-letter stream
// starts with when the consumers dead-letter to
// natsconsumer.DefaultDeadLetterSubject.
const deadLetterSubjectPrefix = "dlq."

// jetStreamSource is JetStream's dead-letter streams. Each stream is
// indexed as a Kafka topic of one partition whose offsets are the stream
// sequences (natsconsumer.ReadRange's records): read whole at its first
// use, headers only, and then from the sequence after the last one read.
// JetStream can delete a message inside a stream (a limit per subject, an
// operator's delete); the index then holds more messages than the stream
// says it does, and is read whole again. A stream deleted and made again
// (its creation time changed) is read whole again too.
type jetStreamSource struct {
	js      jetstream.JetStream
	streams []string // configured; none: discovered
	ix      indexes
	timeout time.Duration // Config.Timeout: a refresh's in the background
}

func (*jetStreamSource) kind() sourceKind { return jetStreamKind }

// places returns the configured streams, or every stream whose subjects
// all start with "dlq.": the consumers' default dead-letter subjects
// (natsconsumer.DefaultDeadLetterSubject). A stream that also captures
// other subjects is not a dead-letter stream of theirs.
func (j *jetStreamSource) places(ctx context.Context) ([]string, error) {
	if err := j.connected(); err != nil {
		return nil, err
	}
	if len(j.streams) > 0 {
		return j.streams, nil
	}
	l := j.js.ListStreams(ctx)
	var out []string
	for info := range l.Info() {
		if subj := info.Config.Subjects; len(subj) > 0 && !slices.ContainsFunc(subj, func(s string) bool {
			return !strings.HasPrefix(s, deadLetterSubjectPrefix)
		}) {
			out = append(out, info.Config.Name)
		}
	}
	if err := l.Err(); err != nil {
		return nil, fmt.Errorf("list JetStream streams: %w", err)
	}
	slices.Sort(out)
	return out, nil
}

// sync brings the index of stream up to its last sequence.
func (j *jetStreamSource) sync(ctx context.Context, stream string) (*topicIndex, error) {
	if stream == "" {
		return nil, badRequest{"stream: choose a dead-letter stream"}
	}
	if err := j.connected(); err != nil {
		return nil, err
	}
	t := j.ix.get(stream)
	t.refresh.Lock()
	defer t.refresh.Unlock()
	for try := 0; ; try++ {
		s, err := j.js.Stream(ctx, stream)
		if err != nil {
			return nil, fmt.Errorf("dead letters: stream %q: %w", stream, err)
		}
		info := s.CachedInfo()
		st := info.State
		if !info.Created.Equal(t.created) {
			// Deleted and made again (or not read yet): its sequences name
			// other messages.
			t.reset()
			t.created = info.Created
		}
		// The stream as partition 0 from FirstSeq to LastSeq: trim forgets
		// what limits or a purge removed from its start.
		ends := map[int32]int64{0: int64(st.LastSeq) + 1}
		from := t.trim(map[int32]int64{0: int64(st.FirstSeq)}, ends)
		var recs []*kgo.Record
		err = natsconsumer.ReadRange(ctx, s, natsconsumer.StreamRange{From: uint64(from[0]), To: st.LastSeq + 1, HeadersOnly: true},
			func(r *kgo.Record) error {
				recs = append(recs, r)
				return nil
			})
		if err != nil {
			return nil, fmt.Errorf("dead letters: %w", err)
		}
		t.add(recs, ends)
		if uint64(t.size()) == st.Msgs || try == 1 {
			// A second mismatch: messages are being deleted as it reads;
			// the next sync looks again.
			return t, nil
		}
		t.reset() // a message was deleted inside what was read before
	}
}

func (j *jetStreamSource) view(ctx context.Context, stream string, budget time.Duration) (*topicIndex, string, error) {
	if stream == "" {
		return nil, "", badRequest{"stream: choose a dead-letter stream"}
	}
	if err := j.connected(); err != nil {
		return nil, "", err
	}
	return viewIndex(ctx, j, j.ix.get(stream), stream, budget, j.timeout)
}

// connected fails at once while the connection is down, rather than at
// the page's timeout (a connection that reconnects holds requests back).
func (j *jetStreamSource) connected() error {
	nc := j.js.Conn()
	if nc.IsConnected() {
		return nil
	}
	if err := nc.LastError(); err != nil {
		return fmt.Errorf("NATS: not connected (%s): %w", nc.Status(), err)
	}
	return fmt.Errorf("NATS: not connected (%s)", nc.Status())
}

// withValues reads the entries' messages whole: the sequences from the
// first entry's to the last's.
func (j *jetStreamSource) withValues(ctx context.Context, stream string, entries []dlq.Entry) ([]dlq.Entry, error) {
	if len(entries) == 0 {
		return entries, nil
	}
	want := map[int64]int{}
	lo, hi := entries[0].Record.Offset, entries[0].Record.Offset
	for i, e := range entries {
		want[e.Record.Offset] = i
		lo, hi = min(lo, e.Record.Offset), max(hi, e.Record.Offset)
	}
	s, err := j.js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("dead letters: stream %q: %w", stream, err)
	}
	out := slices.Clone(entries)
	got := make([]bool, len(entries))
	err = natsconsumer.ReadRange(ctx, s, natsconsumer.StreamRange{From: uint64(lo), To: uint64(hi) + 1}, func(r *kgo.Record) error {
		if i, ok := want[r.Offset]; ok {
			out[i].Record, got[i] = r, true
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("dead letters: read messages: %w", err)
	}
	for i, ok := range got {
		if !ok {
			return nil, fmt.Errorf("dead letters: %s is no longer in stream %s (deleted)", entries[i].Ref(), stream)
		}
	}
	return out, nil
}

func (*jetStreamSource) numbering() string { return "" }

func (j *jetStreamSource) redrive(ctx context.Context, entries []dlq.Entry, opts dlq.RedriveOptions) ([]dlq.Result, error) {
	return natsconsumer.Redrive(ctx, j.js, entries, opts)
}

// origin: the subject, and the stream, sequence and consumer of the
// natsconsumer provenance headers.
func (*jetStreamSource) origin(e *dlq.Entry) []header {
	if e.Info == nil {
		return nil
	}
	get := func(key string) string {
		for _, h := range e.Record.Headers {
			if h.Key == key {
				return string(h.Value)
			}
		}
		return ""
	}
	where := "subject " + e.Info.Topic
	if stream := get(natsconsumer.HeaderStream); stream != "" {
		where += ", stream " + stream + " sequence " + strconv.FormatInt(e.Info.Offset, 10)
	}
	out := []header{{"source", where + ", stored " + formatTime(e.Info.Timestamp)}}
	if c := get(natsconsumer.HeaderConsumer); c != "" {
		out = append(out, header{"JetStream consumer", c + ", delivery " + cmp.Or(get(natsconsumer.HeaderDeliveryCount), "?")})
	}
	return out
}
