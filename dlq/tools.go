package dlq

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/internal/topicread"
)

// Entry is a dead-letter record read back from a dead-letter topic.
type Entry struct {
	// Record is the dead-letter record; its Topic, Partition and Offset are
	// its place in the dead-letter topic.
	Record *kgo.Record
	// Info is decoded from its headers; nil when Err is set.
	Info *Info
	// Err is set for a record that is not a valid dead-letter record. Such
	// records are listed, never redriven.
	Err error
	// Copies counts the dead-letter records with the same group, dedup id
	// and source coordinates (more than 1 after a crash between the
	// dead-letter produce and the inbox commit). Only the first is listed.
	Copies int
}

// Ref names the entry's dead-letter record as topic/partition/offset.
func (e *Entry) Ref() string {
	return fmt.Sprintf("%s/%d/%d", e.Record.Topic, e.Record.Partition, e.Record.Offset)
}

// Filter selects entries. Zero fields match everything.
type Filter struct {
	SourceTopic string    // source topic
	Group       string    // consumer group
	Class       Class     // error class
	MessageID   string    // dedup id
	Since       time.Time // last failure at or after
	Until       time.Time // last failure before
	// Refs selects dead-letter records by partition/offset ("0/17") or
	// topic/partition/offset.
	Refs []string
	// RefuseInvalid makes List fail with an *InvalidRecordError at the
	// first record it reads that is not a valid dead-letter record,
	// whatever the other fields select, and stop reading: the topic is most
	// likely not a dead-letter topic. Default false: such records are listed, with Err set, when no
	// other field selects.
	RefuseInvalid bool
}

// InvalidRecordError is List's refusal of a topic that holds a record that
// is not a valid dead-letter record (Filter.RefuseInvalid).
type InvalidRecordError struct {
	Ref string // topic/partition/offset of the record
	Err error  // why it is not one; wraps ErrNotDeadLetter
}

func (e *InvalidRecordError) Error() string {
	return fmt.Sprintf("dlq: %s is not a valid dead-letter record: %v", e.Ref, e.Err)
}

func (e *InvalidRecordError) Unwrap() error { return e.Err }

// Match reports whether f selects e. List applies it to the first copy of
// each dead-lettering (see Entry.Copies); later copies follow the first.
func (f *Filter) Match(e *Entry) bool {
	if len(f.Refs) > 0 {
		ok := false
		short := fmt.Sprintf("%d/%d", e.Record.Partition, e.Record.Offset)
		for _, r := range f.Refs {
			ok = ok || r == short || r == e.Ref()
		}
		if !ok {
			return false
		}
	}
	if e.Info == nil {
		return f.SourceTopic == "" && f.Group == "" && f.Class == "" && f.MessageID == "" && f.Since.IsZero() && f.Until.IsZero()
	}
	i := e.Info
	return (f.SourceTopic == "" || i.Topic == f.SourceTopic) &&
		(f.Group == "" || i.Group == f.Group) &&
		(f.Class == "" || i.Class == f.Class) &&
		(f.MessageID == "" || i.MessageID == f.MessageID) &&
		(f.Since.IsZero() || !i.LastFailure.Before(f.Since)) &&
		(f.Until.IsZero() || i.LastFailure.Before(f.Until))
}

// List reads the dead-letter topic from its start to its current end and
// returns the entries that match f, in partition and offset order. It
// creates its own client from opts (seed brokers, TLS, SASL).
func List(ctx context.Context, opts []kgo.Opt, topic string, f Filter) ([]Entry, error) {
	if topic == "" {
		return nil, errors.New("dlq: list: topic is empty")
	}
	// With RefuseInvalid the read stops at the first record that is not a
	// dead letter: a source topic given by mistake is not read to its end.
	var recs []*kgo.Record
	err := topicread.Each(ctx, opts, topic, func(r *kgo.Record) error {
		if f.RefuseInvalid {
			if _, err := Decode(r.Headers); err != nil {
				return &InvalidRecordError{Ref: fmt.Sprintf("%s/%d/%d", r.Topic, r.Partition, r.Offset), Err: err}
			}
		}
		recs = append(recs, r)
		return nil
	})
	if ie, ok := errors.AsType[*InvalidRecordError](err); ok {
		return nil, ie
	}
	if err != nil {
		return nil, fmt.Errorf("dlq: list: %w", err)
	}
	topicread.Sort(recs)
	return Entries(recs, f)
}

// Entries returns the entries of dead-letter records recs (in the order
// given) that match f, as List does for a topic it read: each record's
// Info decoded from its headers, and copies of one dead-lettering listed
// once, counted in Copies; with f.RefuseInvalid, an *InvalidRecordError
// for the first record that is not a dead letter. Adapters of other brokers
// (package natsconsumer) read their dead-letter streams into records and
// list them with it.
func Entries(recs []*kgo.Record, f Filter) ([]Entry, error) {
	var out []Entry
	seen := map[string]int{} // identity -> index in out
	// Copies of one dead-lettering (a crash between the produce and the
	// inbox record writes one more) are listed once, counted in Copies.
	for _, r := range recs {
		e := Entry{Record: r, Copies: 1}
		e.Info, e.Err = Decode(r.Headers)
		if e.Err != nil && f.RefuseInvalid {
			return nil, &InvalidRecordError{Ref: e.Ref(), Err: e.Err}
		}
		if e.Info != nil {
			id := fmt.Sprintf("%s\x00%s\x00%s/%d/%d", e.Info.Group, e.Info.MessageID, e.Info.Topic, e.Info.Partition, e.Info.Offset)
			if i, dup := seen[id]; dup {
				if i >= 0 { // -1: a copy of an entry the filter left out
					out[i].Copies++
				}
				continue
			}
			if !f.Match(&e) {
				seen[id] = -1 // remember, so later copies are not listed either
				continue
			}
			seen[id] = len(out)
		} else if !f.Match(&e) {
			continue
		}
		out = append(out, e)
	}
	return out, nil
}

// RedriveOptions configures Redrive.
type RedriveOptions struct {
	// ToTopic sends every record to this topic instead of its source topic.
	ToTopic string
	// DryRun reports what would be produced without producing.
	DryRun bool
	// IDHeader is the dedup id header on the redriven record.
	// Default "message-id".
	IDHeader string
	// Inbox and DB are the consumers' inbox (its schema) and database.
	// Required, except for a dry run. Before producing a record, Redrive
	// records a redrive grant for its group and dedup id
	// (dedup.Inbox.GrantRedrive): the consumer runs a redriven record
	// whose id it holds as dead-lettered only by consuming that grant, in
	// the transaction of its claim, so each redrive runs the message once
	// more, and a record that merely carries HeaderRedrive (any producer
	// can write it) runs nothing again. Records whose id the inbox holds as
	// processed are skipped (SkipProcessed).
	Inbox *dedup.Inbox
	DB    dedup.DBTX
}

// ErrNoInbox is returned by Redrive when RedriveOptions.Inbox or DB is
// missing outside a dry run.
var ErrNoInbox = errors.New("dlq: redrive: RedriveOptions.Inbox and DB are required: a redriven record runs again only against a grant recorded in the consumers' database")

// Action is what Redrive did with an entry.
type Action string

// Redrive actions.
const (
	Redriven       Action = "redriven"
	WouldRedrive   Action = "would-redrive"
	SkipProcessed  Action = "skipped-processed" // the inbox holds the id as processed
	SkipNotDecoded Action = "skipped-invalid"   // not a valid dead-letter record
	SkipStub       Action = "skipped-stub"      // a stub: its value was left out (HeaderStub)
)

// Result is the outcome of redriving one entry.
type Result struct {
	Entry  *Entry
	Action Action
	Topic  string // destination topic
	// Partition and Offset of the produced record (Redriven only).
	Partition int32
	Offset    int64
}

// Redrive produces entries back to their source topic (or opts.ToTopic) with
// their key and value, the dedup id, the trace context and a HeaderRedrive
// header, each after recording its redrive grant (see RedriveOptions). It
// stops at the first error and returns the results so far.
func Redrive(ctx context.Context, producer *kgo.Client, entries []Entry, opts RedriveOptions) ([]Result, error) {
	return RedriveWith(ctx, func(ctx context.Context, rec *kgo.Record) error {
		return producer.ProduceSync(ctx, rec).FirstErr()
	}, entries, opts)
}

// RedriveWith is Redrive through publish, which writes one record durably
// to another broker (Record.Topic is the destination) and sets its
// Partition and Offset to where it was stored, or returns an error.
func RedriveWith(ctx context.Context, publish func(context.Context, *kgo.Record) error, entries []Entry, opts RedriveOptions) ([]Result, error) {
	if !opts.DryRun && (opts.Inbox == nil || opts.DB == nil) {
		return nil, ErrNoInbox
	}
	idHeader := cmp.Or(opts.IDHeader, HeaderMessageIDDefault)
	lookup := func(e *Entry) (dedup.Outcome, error) {
		return opts.Inbox.Lookup(ctx, opts.DB, e.Info.Group, e.Info.MessageID)
	}
	if opts.DryRun && opts.Inbox != nil && opts.DB != nil {
		// A dry run changes nothing between lookups: the outcomes are read
		// in a query per group and batch, not one per entry.
		known, err := lookupAll(ctx, opts, entries)
		if err != nil {
			return nil, err
		}
		lookup = func(e *Entry) (dedup.Outcome, error) {
			if o, ok := known[e.Info.Group][e.Info.MessageID]; ok {
				return o, nil
			}
			return "", dedup.ErrNotClaimed
		}
	}
	results := make([]Result, 0, len(entries))
	for i := range entries {
		e := &entries[i]
		res := Result{Entry: e}
		if e.Info == nil {
			res.Action = SkipNotDecoded
			results = append(results, res)
			continue
		}
		if isStub(e.Record) {
			res.Action = SkipStub
			results = append(results, res)
			continue
		}
		res.Topic = cmp.Or(opts.ToTopic, e.Info.Topic)
		if opts.Inbox != nil && opts.DB != nil {
			o, err := lookup(e)
			switch {
			case err == nil && o == dedup.Processed:
				res.Action = SkipProcessed
				results = append(results, res)
				continue
			case err != nil && !errors.Is(err, dedup.ErrNotClaimed):
				return results, fmt.Errorf("dlq: redrive %s: %w", e.Ref(), err)
			}
		}
		if opts.DryRun {
			res.Action = WouldRedrive
			results = append(results, res)
			continue
		}
		// The grant first: a consumer that saw the record before its grant
		// would skip it as a duplicate.
		if err := opts.Inbox.GrantRedrive(ctx, opts.DB, e.Info.Group, e.Info.MessageID, e.Ref()); err != nil {
			return results, fmt.Errorf("dlq: redrive %s: %w", e.Ref(), err)
		}
		rec := RedriveRecord(e, res.Topic, idHeader)
		if err := publish(ctx, rec); err != nil {
			// Best effort: a grant left behind lets the next redriven copy of
			// this id run, which is what the operator asked for anyway.
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_ = opts.Inbox.RevokeRedrive(rctx, opts.DB, e.Info.Group, e.Info.MessageID)
			cancel()
			return results, fmt.Errorf("dlq: redrive %s to %s: %w", e.Ref(), res.Topic, err)
		}
		res.Action, res.Partition, res.Offset = Redriven, rec.Partition, rec.Offset
		results = append(results, res)
	}
	return results, nil
}

// lookupBatch is the number of ids lookupAll asks the inbox for at once.
const lookupBatch = 10_000

// lookupAll returns the inbox outcomes of the entries' ids, by group.
func lookupAll(ctx context.Context, opts RedriveOptions, entries []Entry) (map[string]map[string]dedup.Outcome, error) {
	ids := map[string][]string{}
	for i := range entries {
		if e := &entries[i]; e.Info != nil && !isStub(e.Record) {
			ids[e.Info.Group] = append(ids[e.Info.Group], e.Info.MessageID)
		}
	}
	out := make(map[string]map[string]dedup.Outcome, len(ids))
	for group, all := range ids {
		out[group] = map[string]dedup.Outcome{}
		for batch := range slices.Chunk(all, lookupBatch) {
			got, err := opts.Inbox.LookupMany(ctx, opts.DB, group, batch)
			if err != nil {
				return nil, fmt.Errorf("dlq: redrive: %w", err)
			}
			maps.Copy(out[group], got)
		}
	}
	return out, nil
}

func isStub(rec *kgo.Record) bool {
	for _, h := range rec.Headers {
		if h.Key == HeaderStub {
			return true
		}
	}
	return false
}

// RedriveRecord builds the record Redrive produces for e.
func RedriveRecord(e *Entry, topic, idHeader string) *kgo.Record {
	headers := make([]kgo.RecordHeader, 0, len(e.Record.Headers))
	var original []byte
	for _, h := range e.Record.Headers {
		if h.Key == HeaderOriginalTraceParent {
			original = h.Value
		}
	}
	for _, h := range e.Record.Headers {
		switch {
		case strings.HasPrefix(h.Key, Prefix) || h.Key == HeaderRedrive || h.Key == idHeader:
			continue
		case h.Key == "traceparent" && original != nil:
			// Back to the message's creation context: the redriven record
			// continues the original trace, not the dead-letter send.
			h.Value = original
		}
		headers = append(headers, h)
	}
	headers = append(headers,
		kgo.RecordHeader{Key: idHeader, Value: []byte(e.Info.MessageID)},
		kgo.RecordHeader{Key: HeaderRedrive, Value: []byte(e.Ref())},
	)
	return &kgo.Record{Topic: topic, Key: e.Record.Key, Value: e.Record.Value, Headers: headers}
}
