package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/natsconsumer"
	"github.com/oncely/oncely/rabbitconsumer"
	"github.com/oncely/oncely/webhook/outbound"
)

// refs collects repeated --ref flags.
type refs []string

func (r *refs) String() string     { return strings.Join(*r, ",") }
func (r *refs) Set(v string) error { *r = append(*r, v); return nil }

// dlqFlags are the flags shared by the dlq subcommands.
type dlqFlags struct {
	kafka        kafkaFlags
	topic        string
	natsURL      string // with stream: a JetStream dead-letter stream instead of a topic
	stream       string
	amqpURL      string // with queue: a RabbitMQ dead-letter queue instead of a topic
	queue        string
	source       string
	group        string
	class        string
	messageID    string
	since, until string
	refs         refs
	skipInvalid  bool
	asJSON       *bool
	stderr       io.Writer
}

func (d *dlqFlags) register(fs *flag.FlagSet) {
	d.kafka.register(fs)
	fs.StringVar(&d.topic, "topic", "", "dead-letter topic to read (this, --stream or --queue is required), e.g. orders.dlq")
	fs.StringVar(&d.stream, "stream", "", "JetStream dead-letter stream to read instead of a Kafka topic (with --nats)")
	fs.StringVar(&d.natsURL, "nats", cmp.Or(os.Getenv("NATS_URL"), nats.DefaultURL), "NATS server of --stream (env NATS_URL)")
	fs.StringVar(&d.queue, "queue", "", "RabbitMQ dead-letter queue to read instead of a Kafka topic (with --amqp), e.g. orders.dlq")
	fs.StringVar(&d.amqpURL, "amqp", cmp.Or(os.Getenv("AMQP_URL"), defaultAMQPURL), "RabbitMQ of --queue (env AMQP_URL)")
	fs.StringVar(&d.source, "source-topic", "", "only records dead-lettered from this topic")
	fs.StringVar(&d.group, "group", "", "only records dead-lettered by this consumer group")
	fs.StringVar(&d.class, "class", "", "only this error class: undecodable, permanent, max_attempts, panic, oversized, crash_loop")
	fs.StringVar(&d.messageID, "message-id", "", "only this dedup id")
	fs.StringVar(&d.since, "since", "", "only last failures at or after this time (RFC 3339, or a duration ago such as 24h)")
	fs.StringVar(&d.until, "until", "", "only last failures before this time (RFC 3339, or a duration ago)")
	fs.Var(&d.refs, "ref", "only this dead-letter record, as partition/offset (repeatable; a queue's: 0/position in the listing)")
	fs.BoolVar(&d.skipInvalid, "skip-invalid", false, "skip records that are not dead-letter records (default: refuse the topic at the first one)")
	d.asJSON = jsonFlag(fs)
}

func parseWhen(flagName, v string, now time.Time) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, usageErr("%s: %q is neither an RFC 3339 time nor a non-negative duration", flagName, v)
}

func (d *dlqFlags) filter() (dlq.Filter, error) {
	f := dlq.Filter{SourceTopic: d.source, Group: d.group, Class: dlq.Class(d.class), MessageID: d.messageID, Refs: d.refs,
		RefuseInvalid: !d.skipInvalid}
	switch given := btoi(d.topic != "") + btoi(d.stream != "") + btoi(d.queue != ""); {
	case given == 0:
		return f, usageErr("--topic: the dead-letter topic (or --stream, a JetStream dead-letter stream, or --queue, a RabbitMQ dead-letter queue) is required")
	case given > 1:
		return f, usageErr("--topic, --stream and --queue: give one, a Kafka topic, a JetStream stream or a RabbitMQ queue")
	}
	if d.class != "" && !f.Class.Valid() {
		return f, usageErr("--class: unknown class %q", d.class)
	}
	for _, r := range d.refs {
		var p int32
		var o int64
		if n, err := fmt.Sscanf(r, "%d/%d", &p, &o); err != nil || n != 2 || p < 0 || o < 0 || fmt.Sprintf("%d/%d", p, o) != r {
			return f, usageErr("--ref: %q is not partition/offset (for a JetStream stream: 0/sequence; for a RabbitMQ queue: 0/position)", r)
		}
	}
	now := time.Now()
	var err error
	if f.Since, err = parseWhen("--since", d.since, now); err != nil {
		return f, err
	}
	if f.Until, err = parseWhen("--until", d.until, now); err != nil {
		return f, err
	}
	return f, nil
}

// defaultAMQPURL is --amqp without AMQP_URL: a local RabbitMQ's guest.
const defaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (d *dlqFlags) selective() bool {
	return d.source != "" || d.group != "" || d.class != "" || d.messageID != "" || d.since != "" || d.until != "" || len(d.refs) > 0
}

// deadLetters is what the dlq subcommands work on: the entries read, and
// how to redrive them to the broker they came from.
type deadLetters struct {
	entries []dlq.Entry
	redrive func(context.Context, []dlq.Entry, dlq.RedriveOptions) ([]dlq.Result, error)
	close   func()
}

// list reads the matching entries from the Kafka topic, the JetStream
// stream or the RabbitMQ queue, with the broker's errors phrased for
// operators. A queue's listing holds its messages until close, which gives
// back those not redriven.
func (d *dlqFlags) list(ctx context.Context, f dlq.Filter) (*deadLetters, error) {
	lctx, cancel := context.WithTimeout(ctx, d.kafka.timeout)
	defer cancel()
	var (
		dl          = &deadLetters{close: func() {}}
		err         error
		where, kind = d.topic, "topic"
	)
	switch {
	case d.queue != "":
		where, kind = "queue "+d.queue, "queue"
		if _, perr := amqp.ParseURI(d.amqpURL); perr != nil {
			return nil, usageErr("--amqp: %v", perr)
		}
		q, oerr := rabbitconsumer.OpenDeadLetters(lctx, d.amqpURL, d.queue)
		if oerr != nil {
			return nil, fmt.Errorf("RabbitMQ at %s: %w", outbound.RedactURL(d.amqpURL), oerr)
		}
		dl.close = func() { _ = q.Close() }
		dl.redrive = q.Redrive
		dl.entries, err = q.Entries(lctx, f)
	case d.stream != "":
		where, kind = "stream "+d.stream, "stream"
		nc, cerr := nats.Connect(d.natsURL, nats.Timeout(d.kafka.timeout), nats.Name("oncely dlq"))
		if cerr != nil {
			return nil, fmt.Errorf("cannot connect to NATS at %s: %w", d.natsURL, cerr)
		}
		js, jerr := jetstream.New(nc)
		if jerr != nil {
			nc.Close()
			return nil, jerr
		}
		dl.close = nc.Close
		dl.redrive = func(ctx context.Context, e []dlq.Entry, o dlq.RedriveOptions) ([]dlq.Result, error) {
			return natsconsumer.Redrive(ctx, js, e, o)
		}
		dl.entries, err = natsconsumer.DeadLetters(lctx, js, d.stream, f)
	default:
		opts, oerr := d.kafka.opts()
		if oerr != nil {
			return nil, usageErr("%v", oerr)
		}
		dl.redrive = func(ctx context.Context, e []dlq.Entry, o dlq.RedriveOptions) ([]dlq.Result, error) {
			producer, err := kgo.NewClient(append(opts, kgo.RecordDeliveryTimeout(d.kafka.timeout))...)
			if err != nil {
				return nil, err
			}
			defer producer.Close()
			return dlq.Redrive(ctx, producer, e, o)
		}
		dl.entries, err = dlq.List(lctx, opts, d.topic, f)
		if err != nil && !errors.As(err, new(*dlq.InvalidRecordError)) {
			err = fmt.Errorf("cannot read %s from Kafka at %s (timeout %s): %w", d.topic, d.kafka.brokers, d.kafka.timeout,
				d.kafka.security.Explain(err))
		}
	}
	if ie, ok := errors.AsType[*dlq.InvalidRecordError](err); ok {
		dl.close()
		return nil, fmt.Errorf("%s is not a dead-letter %s: record %s has no valid dead-letter headers (%v); "+
			"dead-letter topics are usually named %s, streams capture %s, queues are named %s "+
			"(a queue's messages are given back unchanged); --skip-invalid skips such records", where, kind,
			ie.Ref, ie.Err, dlq.DefaultTopic("<source>"), natsconsumer.DefaultDeadLetterSubject("<subject>"),
			rabbitconsumer.DefaultDeadLetterRoutingKey("<queue>"))
	}
	if err != nil {
		dl.close()
		return nil, err
	}
	if d.skipInvalid {
		valid := dl.entries[:0]
		for _, e := range dl.entries {
			if e.Err == nil {
				valid = append(valid, e)
			}
		}
		if n := len(dl.entries) - len(valid); n > 0 {
			fmt.Fprintf(d.stderr, "oncely: skipped %d records of %s that are not dead-letter records\n", n, where)
		}
		dl.entries = valid
	}
	return dl, nil
}

func dlqCmd(ctx context.Context, sub string, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("dlq "+sub, flag.ContinueOnError)
	d := dlqFlags{stderr: stderr}
	d.register(fs)
	switch sub {
	case "list":
		if err := parse(fs, args, stderr); err != nil {
			return err
		}
		f, err := d.filter()
		if err != nil {
			return err
		}
		dl, err := d.list(ctx, f)
		if err != nil {
			return err
		}
		defer dl.close()
		if *d.asJSON {
			return printEntriesJSON(stdout, dl.entries)
		}
		return printTable(stdout, dl.entries)
	case "show":
		pos, err := parseArgs(fs, args, stderr)
		if err != nil {
			return err
		}
		d.refs = append(d.refs, pos...)
		if len(d.refs) == 0 {
			return usageErr("dlq show: name at least one record as partition/offset")
		}
		f, err := d.filter()
		if err != nil {
			return err
		}
		dl, err := d.list(ctx, f)
		if err != nil {
			return err
		}
		defer dl.close()
		entries := dl.entries
		if len(entries) == 0 {
			return fmt.Errorf("dlq show: no record %s in %s", strings.Join(d.refs, ", "), d.where())
		}
		if *d.asJSON {
			return printEntriesJSON(stdout, entries)
		}
		for i := range entries {
			show(stdout, &entries[i])
		}
		return nil
	case "redrive":
		var db dbFlags
		db.register(fs)
		toTopic := fs.String("to-topic", "", "produce to this topic (with --queue: publish to this queue) instead of each record's source")
		dryRun := fs.Bool("dry-run", false, "print what would be redriven, produce nothing")
		all := fs.Bool("all", false, "redrive every record in the topic (required when no filter or --ref is given)")
		if err := parse(fs, args, stderr); err != nil {
			return err
		}
		f, err := d.filter()
		if err != nil {
			return err
		}
		if !d.selective() && !*all {
			return usageErr("dlq redrive: select records with --ref or a filter, or pass --all")
		}
		opts := dlq.RedriveOptions{ToTopic: *toTopic, DryRun: *dryRun}
		// The consumers' database holds the redrive grants: without them a
		// redriven record is skipped as already dead-lettered. A dry run
		// uses it, when given, to tell the records already processed.
		if !*dryRun || db.url != "" {
			pool, err := db.connect(ctx, d.kafka.timeout)
			if err != nil {
				return err
			}
			defer pool.Close()
			inbox, err := dedup.New(dedup.Config{Schema: db.schema})
			if err != nil {
				return usageErr("--schema: %v", err)
			}
			opts.Inbox, opts.DB = inbox, pool
		}
		dl, err := d.list(ctx, f)
		if err != nil {
			return err
		}
		defer dl.close()
		entries := dl.entries
		results, err := dl.redrive(ctx, entries, opts)
		if *d.asJSON {
			return cmp.Or(printRedriveJSON(stdout, results), err)
		}
		counts := map[dlq.Action]int{}
		for _, r := range results {
			counts[r.Action]++
			switch r.Action {
			case dlq.Redriven:
				if r.Offset < 0 { // a queue: no position
					fmt.Fprintf(stdout, "%s\t%s -> %s\n", r.Action, r.Entry.Ref(), r.Topic)
					continue
				}
				fmt.Fprintf(stdout, "%s\t%s -> %s/%d/%d\n", r.Action, r.Entry.Ref(), r.Topic, r.Partition, r.Offset)
			case dlq.WouldRedrive:
				fmt.Fprintf(stdout, "%s\t%s -> %s (message id %s)\n", r.Action, r.Entry.Ref(), r.Topic, r.Entry.Info.MessageID)
			default:
				fmt.Fprintf(stdout, "%s\t%s\n", r.Action, r.Entry.Ref())
			}
		}
		fmt.Fprintf(stdout, "%d selected: %d redriven, %d would be redriven, %d skipped (processed), %d skipped (invalid)\n",
			len(entries), counts[dlq.Redriven], counts[dlq.WouldRedrive], counts[dlq.SkipProcessed], counts[dlq.SkipNotDecoded])
		return err
	}
	return usageErr("dlq: unknown subcommand %q (want list, show or redrive)", sub)
}

// where names the dead-letter topic, stream or queue read.
func (d *dlqFlags) where() string {
	switch {
	case d.stream != "":
		return "stream " + d.stream
	case d.queue != "":
		return "queue " + d.queue
	}
	return d.topic
}

func printTable(w io.Writer, entries []dlq.Entry) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "REF\tSOURCE\tGROUP\tMESSAGE-ID\tCLASS\tATTEMPTS\tLAST-FAILURE\tCOPIES\tERROR")
	for i := range entries {
		e := &entries[i]
		ref := fmt.Sprintf("%d/%d", e.Record.Partition, e.Record.Offset)
		if e.Info == nil {
			fmt.Fprintf(tw, "%s\t-\t-\t-\tinvalid\t-\t-\t-\t%s\n", ref, clip(e.Err.Error(), 60))
			continue
		}
		i := e.Info
		fmt.Fprintf(tw, "%s\t%s/%d/%d\t%s\t%s\t%s\t%d\t%s\t%d\t%s\n", ref, i.Topic, i.Partition, i.Offset, i.Group,
			i.MessageID, i.Class, i.Attempts, i.LastFailure.UTC().Format(time.RFC3339), e.Copies, clip(i.Error, 60))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "%d records\n", len(entries))
	return err
}

func clip(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) <= n {
		return s
	}
	return dlq.Truncate(s, n-3) + "..."
}

// jsonEntry is a dead-letter record in --json output.
type jsonEntry struct {
	Ref     string            `json:"ref"`
	Copies  int               `json:"copies"`
	Info    *jsonInfo         `json:"info,omitempty"`
	Invalid string            `json:"invalid,omitempty"`
	Key     string            `json:"key"`
	Value   string            `json:"value"`
	Headers map[string]string `json:"headers"` // keys are the record's header names
}

// jsonInfo is dlq.Info in --json output.
type jsonInfo struct {
	Topic        string    `json:"topic"`
	Partition    int32     `json:"partition"`
	Offset       int64     `json:"offset"`
	Timestamp    time.Time `json:"timestamp"`
	Group        string    `json:"group"`
	MessageID    string    `json:"message_id"`
	Attempts     int       `json:"attempts"`
	FirstFailure time.Time `json:"first_failure"`
	LastFailure  time.Time `json:"last_failure"`
	Class        dlq.Class `json:"class"`
	Error        string    `json:"error"`
	TraceParent  string    `json:"trace_parent,omitempty"`
	TraceState   string    `json:"trace_state,omitempty"`
}

func printEntriesJSON(w io.Writer, entries []dlq.Entry) error {
	out := make([]jsonEntry, 0, len(entries))
	for i := range entries {
		e := &entries[i]
		je := jsonEntry{Ref: fmt.Sprintf("%d/%d", e.Record.Partition, e.Record.Offset), Copies: e.Copies,
			Key: printable(e.Record.Key), Value: printable(e.Record.Value), Headers: map[string]string{}}
		if i := e.Info; i != nil {
			je.Info = &jsonInfo{Topic: i.Topic, Partition: i.Partition, Offset: i.Offset, Timestamp: i.Timestamp.UTC(), Group: i.Group,
				MessageID: i.MessageID, Attempts: i.Attempts, FirstFailure: i.FirstFailure.UTC(), LastFailure: i.LastFailure.UTC(),
				Class: i.Class, Error: i.Error, TraceParent: i.TraceParent, TraceState: i.TraceState}
		}
		if e.Err != nil {
			je.Invalid = e.Err.Error()
		}
		for _, h := range e.Record.Headers {
			je.Headers[h.Key] = printable(h.Value)
		}
		out = append(out, je)
	}
	return printJSON(w, out...)
}

// jsonRedrive is one redrive result in --json output.
type jsonRedrive struct {
	Action    dlq.Action `json:"action"`
	Ref       string     `json:"ref"`
	MessageID string     `json:"message_id,omitempty"`
	Topic     string     `json:"topic,omitempty"`     // destination
	Partition *int32     `json:"partition,omitempty"` // of the produced record
	Offset    *int64     `json:"offset,omitempty"`
}

func printRedriveJSON(w io.Writer, results []dlq.Result) error {
	out := make([]jsonRedrive, 0, len(results))
	for _, r := range results {
		j := jsonRedrive{Action: r.Action, Ref: r.Entry.Ref(), Topic: r.Topic}
		if r.Entry.Info != nil {
			j.MessageID = r.Entry.Info.MessageID
		}
		if r.Action == dlq.Redriven && r.Offset >= 0 {
			j.Partition, j.Offset = &r.Partition, &r.Offset
		}
		out = append(out, j)
	}
	return printJSON(w, out...)
}

// printable returns b as text, or a hex dump marker for binary data.
func printable(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	return fmt.Sprintf("(binary, %d bytes) %x", len(b), b)
}

func show(w io.Writer, e *dlq.Entry) {
	fmt.Fprintf(w, "record %s (copies: %d)\n", e.Ref(), e.Copies)
	if e.Err != nil {
		fmt.Fprintf(w, "  invalid: %v\n", e.Err)
	}
	fmt.Fprintf(w, "  key:   %s\n  value: %s\n  headers:\n", printable(e.Record.Key), printable(e.Record.Value))
	for _, h := range e.Record.Headers {
		fmt.Fprintf(w, "    %s: %s\n", h.Key, printable(h.Value))
	}
}
