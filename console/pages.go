package console

import (
	"bytes"
	"cmp"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook/outbound"
)

// formatTime is how the pages show a time: UTC to the second, "-" for none.
func formatTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

type navItem struct{ Key, Href, Label string }

var navItems = []navItem{{"overview", "./", "Overview"}, {"dlq", "dlq", "Dead letters"}, {"outbox", "outbox", "Outbox"},
	{"inbox", "inbox", "Inbox"}, {"webhooks", "webhooks", "Webhooks out"}}

var funcs = template.FuncMap{
	"navs": func() []navItem { return navItems },
	"ts":   formatTime,
	"age": func(d time.Duration) string {
		if d <= 0 {
			return "-"
		}
		return d.Round(time.Second).String()
	},
	"redact": outbound.RedactURL,
	"since":  time.Since,
	"dict": func(kv ...any) map[string]any {
		m := make(map[string]any, len(kv)/2)
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i].(string)] = kv[i+1]
		}
		return m
	},
	// link is page?query, query being url.Values.Encode's: html/template
	// would escape its = and & as data.
	"link": func(page, query string) template.URL {
		if query == "" {
			return template.URL(page) //nolint:gosec // a fixed page name
		}
		return template.URL(page + "?" + query) //nolint:gosec // url.Values.Encode escapes every value
	},
	"add": func(a int, bs ...int) int {
		for _, b := range bs {
			a += b
		}
		return a
	},
	"printable": printable,
	"clip": func(s string, n int) string {
		if len(s) <= n {
			return s
		}
		return dlq.Truncate(s, n-3) + "..."
	},
}

// ---- Kafka ----

var errNoKafka = errors.New("no Kafka configured (Config.KafkaOpts has no brokers)")

func (s *server) kafka() (*kgo.Client, error) {
	if len(s.cfg.KafkaOpts) == 0 {
		return nil, errNoKafka
	}
	return kgo.NewClient(s.cfg.KafkaOpts...)
}

// dlqTopics returns the configured dead-letter topics, or every topic
// named *.dlq.
func (s *server) dlqTopics(ctx context.Context) ([]string, error) {
	if len(s.cfg.DeadLetterTopics) > 0 {
		return s.cfg.DeadLetterTopics, nil
	}
	cl, err := s.kafka()
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	td, err := kadm.NewClient(cl).ListTopics(ctx)
	if err != nil {
		return nil, fmt.Errorf("list topics: %w", err)
	}
	var out []string
	for _, t := range td.Names() {
		if strings.HasSuffix(t, ".dlq") {
			out = append(out, t)
		}
	}
	slices.Sort(out)
	return out, nil
}

// ---- Dead letters ----

// dlqQuery is the dead-letter filter as the page shows it.
type dlqQuery struct {
	// Param is the query parameter that names the place, Topic (a Kafka
	// topic, a JetStream stream): the source's sourceKind.Param. Empty
	// means "topic".
	Param                                                           string
	Topic, Source, Group, Class, Text, Key, MessageID, Since, Until string
}

func readDLQQuery(f url.Values) dlqQuery {
	q := dlqQuery{Source: f.Get("source"), Group: f.Get("group"), Class: f.Get("class"),
		Text: f.Get("text"), Key: f.Get("key"), MessageID: f.Get("message_id"), Since: f.Get("since"), Until: f.Get("until")}
	for _, p := range placeParams {
		if f.Has(p) {
			q.Param, q.Topic = p, f.Get(p)
			break
		}
	}
	return q
}

// Where is the query parameter that names the place.
func (q dlqQuery) Where() string { return cmp.Or(q.Param, kafkaKind.Param) }

// Values returns the query as URL values, empty fields left out.
func (q dlqQuery) Values() url.Values {
	v := url.Values{}
	for k, s := range map[string]string{q.Where(): q.Topic, "source": q.Source, "group": q.Group, "class": q.Class,
		"text": q.Text, "key": q.Key, "message_id": q.MessageID, "since": q.Since, "until": q.Until} {
		if s != "" {
			v.Set(k, s)
		}
	}
	return v
}

// place names the place for a message: a topic by its name, any other
// place by its kind and name ("stream ORDERS_DLQ").
func (q dlqQuery) place() string {
	if q.Where() == kafkaKind.Param {
		return q.Topic
	}
	return q.Where() + " " + q.Topic
}

// Selective reports whether any field but the place narrows the selection.
func (q dlqQuery) Selective() bool {
	return q != dlqQuery{Param: q.Param, Topic: q.Topic}
}

func parseTime(field, v string) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04", "2006-01-02"} {
		if t, err := time.Parse(layout, v); err == nil {
			return t, nil
		}
	}
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return time.Now().Add(-d), nil
	}
	return time.Time{}, badRequest{fmt.Sprintf("%s: %q is neither a time (RFC 3339, or 2006-01-02T15:04 UTC) nor a duration ago such as 24h", field, v)}
}

// filter returns the dlq.Filter of q.
func (q dlqQuery) filter(refs []string) (dlq.Filter, error) {
	if q.Topic == "" {
		return dlq.Filter{}, badRequest{fmt.Sprintf("%s: choose a dead-letter %[1]s", q.Where())}
	}
	f := dlq.Filter{SourceTopic: q.Source, Group: q.Group, Class: dlq.Class(q.Class), MessageID: q.MessageID, Refs: refs}
	if q.Class != "" && !f.Class.Valid() {
		return f, badRequest{fmt.Sprintf("class: unknown class %q", q.Class)}
	}
	var err error
	if f.Since, err = parseTime("since", q.Since); err != nil {
		return f, err
	}
	f.Until, err = parseTime("until", q.Until)
	return f, err
}

// freshness is how current the index that list selects from must be.
type freshness int

const (
	// viewed: a page's view, brought up to date within Config.ViewWait, or as
	// it stands with a note.
	viewed freshness = iota
	// current: brought up to date, however long it takes (a dry run).
	current
	// live: read from the broker now (an action): a RabbitMQ queue listed.
	live
)

// list returns the entries that q selects (and refs, when given), in
// partition and offset order, as dlq.List would on the whole topic (or
// natsconsumer.DeadLetters on the whole stream), with the source of q's
// place, and the index's note when it misses some (viewed). Their records
// come from the index: they have no value (see withValues).
func (s *server) list(ctx context.Context, q dlqQuery, refs []string, fresh freshness) ([]dlq.Entry, deadLetterSource, string, error) {
	f, err := q.filter(refs)
	if err != nil {
		return nil, nil, "", err
	}
	src, err := s.source(q.Where())
	if err != nil {
		return nil, nil, "", err
	}
	var t *topicIndex
	var note string
	switch fresh {
	case live:
		t, err = src.sync(ctx, q.Topic)
	case current:
		t, note, err = src.view(ctx, q.Topic, 0)
	default:
		t, note, err = src.view(ctx, q.Topic, s.cfg.ViewWait)
	}
	if err != nil {
		return nil, nil, "", err
	}
	// Refs are looked up by partition and offset, not formatted for every
	// record (Filter.Match's way); a ref that names another topic (another
	// subject) or is not partition/offset selects nothing, as in
	// Filter.Match.
	var want map[[2]int64][]string // the topics a ref names; "" any
	if len(refs) > 0 {
		want = map[[2]int64][]string{}
		for _, ref := range refs {
			short, topic := ref, ""
			if i := strings.LastIndex(ref, "/"); i >= 0 {
				if j := strings.LastIndex(ref[:i], "/"); j >= 0 {
					short, topic = ref[j+1:], ref[:j]
				}
			}
			if p, o, err := parseRef("ref", short); err == nil && fmt.Sprintf("%d/%d", p, o) == short {
				k := [2]int64{int64(p), o}
				want[k] = append(want[k], topic)
			}
		}
		f.Refs = nil
	}
	named := func(e *dlq.Entry) bool {
		for _, topic := range want[[2]int64{int64(e.Record.Partition), e.Record.Offset}] {
			if topic == "" || topic == e.Record.Topic {
				return true
			}
		}
		return false
	}
	text := strings.ToLower(q.Text)
	var out []dlq.Entry
	t.each(func(e dlq.Entry) bool {
		if want != nil && !named(&e) ||
			!f.Match(&e) ||
			q.Key != "" && string(e.Record.Key) != q.Key ||
			q.Text != "" && (e.Info == nil || !strings.Contains(strings.ToLower(e.Info.Error), text)) {
			return true
		}
		out = append(out, e)
		return true
	})
	return out, src, note, nil
}

type dlqData struct {
	Kind    sourceKind // the source of the place shown
	Topics  []string   // its places
	Others  []placeList
	Classes []dlq.Class
	Q       dlqQuery
	Matches int         // entries the filter selects
	Entries []dlq.Entry // this page of them
	First   int         // the position of Entries[0] among the matches, from 1
	Next    string      // the query of the next page; empty on the last
	Query   string      // the filter as a URL query
	Note    string      // what the index shown misses (a read under way)
}

// placeList is a source's places, or why they are unknown.
type placeList struct {
	Kind  sourceKind
	Names []string
	Err   string
}

// pageSize is the number of rows a page lists; counts and actions cover
// all.
const pageSize = 100

// maxListed bounds the rows of the lists that have no pages.
const maxListed = 500

// parseRef reads a dead-letter record's partition/offset.
func parseRef(field, ref string) (int32, int64, error) {
	ps, os, ok := strings.Cut(ref, "/")
	p, err1 := strconv.ParseInt(ps, 10, 32)
	o, err2 := strconv.ParseInt(os, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return 0, 0, badRequest{fmt.Sprintf("%s: %q is not partition/offset", field, ref)}
	}
	return int32(p), o, nil
}

func (s *server) deadLetters(ctx context.Context, r *http.Request, v *view) (string, error) {
	v.Title, v.Nav = "Dead letters", "dlq"
	d := &dlqData{Classes: classes, Q: readDLQQuery(r.URL.Query())}
	v.Data = d
	// The place the query names, else the first place of the first source
	// that has one. The other sources' places are linked.
	var lists []placeList
	var errs []error
	cur := -1
	for i, src := range s.sources() {
		names, err := src.places(ctx)
		lists, errs = append(lists, placeList{Kind: src.kind(), Names: names, Err: errText(err)}), append(errs, err)
		if cur < 0 && (d.Q.Param == src.kind().Param || d.Q.Param == "" && len(names) > 0) {
			cur = i
		}
	}
	if cur < 0 {
		if d.Q.Param != "" { // a source not configured
			_, err := s.source(d.Q.Param)
			return "dlq.html", err
		}
		cur = 0
	}
	d.Kind, d.Topics = lists[cur].Kind, lists[cur].Names
	d.Others = slices.Delete(lists, cur, cur+1)
	if errs[cur] != nil {
		return "dlq.html", errs[cur]
	}
	if d.Q.Topic == "" && len(d.Topics) > 0 {
		d.Q.Param, d.Q.Topic = d.Kind.Param, d.Topics[0]
	}
	d.Query = d.Q.Values().Encode()
	if d.Q.Topic == "" {
		return "dlq.html", nil
	}
	// Keyset pages: ?after=partition/offset lists the matches after that
	// record, whatever was added or redriven before it since.
	ap, ao := int32(-1), int64(-1)
	if after := r.URL.Query().Get("after"); after != "" {
		var err error
		if ap, ao, err = parseRef("after", after); err != nil {
			return "dlq.html", err
		}
	}
	entries, _, note, err := s.list(ctx, d.Q, nil, viewed)
	d.Note = note
	if err != nil {
		return "dlq.html", err
	}
	d.Matches = len(entries)
	i, _ := slices.BinarySearchFunc(entries, [2]int64{int64(ap), ao}, func(e dlq.Entry, k [2]int64) int {
		return cmp.Or(cmp.Compare(int64(e.Record.Partition), k[0]), cmp.Compare(e.Record.Offset, k[1]))
	})
	if i < len(entries) && entries[i].Record.Partition == ap && entries[i].Record.Offset == ao {
		i++
	}
	d.First = i + 1
	d.Entries = entries[i:min(len(entries), i+pageSize)]
	if i+pageSize < len(entries) {
		last := d.Entries[len(d.Entries)-1].Record
		next := d.Q.Values()
		next.Set("after", fmt.Sprintf("%d/%d", last.Partition, last.Offset))
		d.Next = next.Encode()
	}
	return "dlq.html", nil
}

type recordData struct {
	Param   string // the query parameter that names the place, Topic
	Topic   string
	Origin  []header // where the message came from, when not a Kafka topic
	Entry   *dlq.Entry
	Headers []header
	Value   string
	Format  string // json, text or hex
	Key     string
	// Numbering is the source's numbering of the ref (confirmData's).
	Numbering string
}

type header struct{ Key, Value string }

// sensitive reports whether a header's name suggests a credential.
func sensitive(name string) bool {
	n := strings.ToLower(name)
	for _, w := range []string{"authorization", "cookie", "token", "secret", "password", "passwd", "api-key", "apikey", "api_key", "signature", "credential", "session"} {
		if strings.Contains(n, w) {
			return true
		}
	}
	return false
}

func printable(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	return "0x" + hex.EncodeToString(b)
}

func (s *server) record(ctx context.Context, r *http.Request, v *view) (string, error) {
	v.Title, v.Nav = "Dead letter", "dlq"
	q := readDLQQuery(r.URL.Query())
	ref := r.URL.Query().Get("ref")
	d := &recordData{Param: q.Where(), Topic: q.Topic}
	v.Data = d
	if ref == "" {
		return "record.html", badRequest{"ref: name a record as partition/offset"}
	}
	entries, src, note, err := s.list(ctx, dlqQuery{Param: q.Param, Topic: q.Topic}, []string{ref}, viewed)
	if err != nil {
		return "record.html", err
	}
	if len(entries) == 0 {
		return "record.html", badRequest{strings.TrimSpace(fmt.Sprintf("no record %s in %s. %s", ref, q.place(), note))}
	}
	if entries, err = src.withValues(ctx, q.Topic, entries[:1]); err != nil {
		return "record.html", err
	}
	e := &entries[0]
	d.Entry, d.Key, d.Origin, d.Numbering = e, printable(e.Record.Key), src.origin(e), src.numbering()
	for _, h := range e.Record.Headers {
		val := printable(h.Value)
		if sensitive(h.Key) {
			val = "[redacted]"
		}
		d.Headers = append(d.Headers, header{h.Key, val})
	}
	var pretty bytes.Buffer
	switch {
	case json.Valid(e.Record.Value) && json.Indent(&pretty, e.Record.Value, "", "  ") == nil:
		d.Value, d.Format = pretty.String(), "json"
	case utf8.Valid(e.Record.Value):
		d.Value, d.Format = string(e.Record.Value), "text"
	default:
		d.Value, d.Format = hex.Dump(e.Record.Value), "hex"
	}
	return "record.html", nil
}

type confirmData struct {
	Q       dlqQuery
	Query   string
	Refs    []string // a selection, when given
	Upto    string   // partition:offset of the last matching record, per partition
	Results []dlq.Result
	Shown   []dlq.Result // the first pageSize of them
	Count   int          // records that would be redriven
	Skipped int
	// Numbering is the source's numbering of Upto's offsets and of the
	// refs, when they are the console's own (deadLetterSource.numbering).
	Numbering string
}

// upto encodes the last offset of each partition among entries.
func upto(entries []dlq.Entry) string {
	last := map[int32]int64{}
	for _, e := range entries {
		last[e.Record.Partition] = max(last[e.Record.Partition], e.Record.Offset)
	}
	parts := make([]string, 0, len(last))
	for p, o := range last {
		parts = append(parts, fmt.Sprintf("%d:%d", p, o))
	}
	slices.Sort(parts)
	return strings.Join(parts, ",")
}

func parseUpto(s string) (map[int32]int64, error) {
	out := map[int32]int64{}
	if s == "" {
		return out, nil
	}
	for _, part := range strings.Split(s, ",") {
		ps, os, ok := strings.Cut(part, ":")
		p, err1 := strconv.ParseInt(ps, 10, 32)
		o, err2 := strconv.ParseInt(os, 10, 64)
		if !ok || err1 != nil || err2 != nil {
			return nil, badRequest{fmt.Sprintf("upto: %q is not partition:offset", part)}
		}
		out[int32(p)] = o
	}
	return out, nil
}

func (s *server) dryRun(ctx context.Context, entries []dlq.Entry) ([]dlq.Result, error) {
	return dlq.Redrive(ctx, nil, entries, dlq.RedriveOptions{DryRun: true, Inbox: s.inbox, DB: s.cfg.Pool, IDHeader: s.cfg.IDHeader})
}

// dlqConfirm is the dry run of a redrive: what the filter (or the
// selection) matches now, and the confirmation form.
func (s *server) dlqConfirm(ctx context.Context, r *http.Request, v *view) (string, error) {
	v.Title, v.Nav = "Confirm redrive", "dlq"
	q := r.URL.Query()
	d := &confirmData{Q: readDLQQuery(q), Refs: q["ref"]}
	if q.Get("all") == "1" { // "all matching" wins over boxes left checked
		d.Refs = nil
	}
	d.Query = d.Q.Values().Encode()
	v.Data = d
	if len(d.Refs) == 0 && q.Get("all") != "1" {
		return "confirm.html", badRequest{"select records, or redrive all that match the filter"}
	}
	entries, src, _, err := s.list(ctx, d.Q, d.Refs, current)
	if err != nil {
		return "confirm.html", err
	}
	d.Upto, d.Numbering = upto(entries), src.numbering()
	if d.Results, err = s.dryRun(ctx, entries); err != nil {
		return "confirm.html", err
	}
	d.Shown = d.Results[:min(len(d.Results), pageSize)]
	for _, res := range d.Results {
		if res.Action == dlq.WouldRedrive {
			d.Count++
		} else {
			d.Skipped++
		}
	}
	return "confirm.html", nil
}

// dlqRedrive redrives what the confirmed form names: the filter, limited to
// the records up to the dry run's offsets (and to the selection, if any).
func (s *server) dlqRedrive(ctx context.Context, r *http.Request) (string, url.Values, string, []any, error) {
	f := r.PostForm
	q := readDLQQuery(f)
	refs := f["ref"]
	if len(refs) == 0 && f.Get("all") != "1" {
		return "", nil, "", nil, badRequest{"select records, or confirm a redrive of all that match the filter"}
	}
	limit, err := parseUpto(f.Get("upto"))
	if err != nil {
		return "", nil, "", nil, err
	}
	src, err := s.source(q.Where())
	if err != nil {
		return "", nil, "", nil, err
	}
	if got, want := f.Get("numbering"), src.numbering(); got != want {
		// Offsets numbered by another console process (or before a
		// restart) name other messages here.
		return "", nil, "", nil, badRequest{fmt.Sprintf("the records of %s were numbered by another console process, or before this one restarted: run the dry run again", q.place())}
	}
	entries, _, _, err := s.list(ctx, q, refs, live)
	if err != nil {
		return "", nil, "", nil, err
	}
	if f.Has("upto") {
		kept := entries[:0]
		for _, e := range entries {
			if last, ok := limit[e.Record.Partition]; ok && e.Record.Offset <= last {
				kept = append(kept, e)
			}
		}
		entries = kept
	}
	args := []any{q.Where(), q.Topic, "filter", q.Values().Encode(), "refs", refs, "upto", f.Get("upto")}
	if entries, err = src.withValues(ctx, q.Topic, entries); err != nil {
		return "", nil, "", args, err
	}
	results, err := src.redrive(ctx, entries, dlq.RedriveOptions{Inbox: s.inbox, DB: s.cfg.Pool, IDHeader: s.cfg.IDHeader})
	n := 0
	var redriven []string
	for _, res := range results {
		if res.Action == dlq.Redriven {
			n++
			redriven = append(redriven, res.Entry.Ref())
		}
	}
	args = append(args, "redriven", redriven)
	if err != nil {
		return "", nil, "", args, fmt.Errorf("redrove %d, then: %w", n, err)
	}
	done := fmt.Sprintf("redrove %d of %d selected dead letters (%d skipped: already processed, stubs or invalid)", n, len(results), len(results)-n)
	return "dlq", q.Values(), done, args, nil
}

// ---- Outbox ----

type shardRow struct {
	Topic   string
	Shard   int32
	Pending int64
	Oldest  time.Duration
}

type outboxData struct {
	Status           outbox.Status
	ByTopic          []shardRow
	Parked           []outbox.ParkedRow
	After, NextAfter int64 // the page of parked rows: ids after After; the next page's
}

func (s *server) outboxPage(ctx context.Context, r *http.Request, v *view) (string, error) {
	v.Title, v.Nav = "Outbox", "outbox"
	d := &outboxData{}
	v.Data = d
	if a := r.URL.Query().Get("after"); a != "" {
		var err error
		if d.After, err = strconv.ParseInt(a, 10, 64); err != nil || d.After < 0 {
			return "outbox.html", badRequest{fmt.Sprintf("after: %q is not an outbox row id", a)}
		}
	}
	var err error
	if d.Status, err = s.outbox.Status(ctx, s.cfg.Pool); err != nil {
		return "outbox.html", err
	}
	rows, err := s.cfg.Pool.Query(ctx, `SELECT topic, shard, count(*), now() - min(created_at) FROM `+s.tables.outbox+`
		WHERE sent_at IS NULL AND parked_at IS NULL GROUP BY topic, shard ORDER BY topic, shard LIMIT 1000`)
	if err != nil {
		return "outbox.html", fmt.Errorf("outbox pending by topic and shard: %w", err)
	}
	if d.ByTopic, err = pgx.CollectRows(rows, pgx.RowToStructByPos[shardRow]); err != nil {
		return "outbox.html", fmt.Errorf("outbox pending by topic and shard: %w", err)
	}
	// One row more than the page tells whether there is a next one.
	if d.Parked, err = s.outbox.ParkedAfter(ctx, s.cfg.Pool, d.After, pageSize+1); err != nil {
		return "outbox.html", err
	}
	if len(d.Parked) > pageSize {
		d.Parked = d.Parked[:pageSize]
		d.NextAfter = d.Parked[pageSize-1].ID
	}
	return "outbox.html", nil
}

func formID(f url.Values) (int64, error) {
	id, err := strconv.ParseInt(f.Get("id"), 10, 64)
	if err != nil || id <= 0 {
		return 0, badRequest{fmt.Sprintf("id: %q is not an outbox row id", f.Get("id"))}
	}
	return id, nil
}

func (s *server) outboxRetry(ctx context.Context, r *http.Request) (string, url.Values, string, []any, error) {
	return s.outboxRow(ctx, r, s.outbox.Retry, "un-parked: a relay publishes it again")
}

func (s *server) outboxDiscard(ctx context.Context, r *http.Request) (string, url.Values, string, []any, error) {
	return s.outboxRow(ctx, r, s.outbox.Discard, "discarded")
}

// outboxRow applies one of Outbox's parked-row calls to the form's row.
func (s *server) outboxRow(ctx context.Context, r *http.Request, call func(context.Context, outbox.DBTX, int64) error, done string) (string, url.Values, string, []any, error) {
	id, err := formID(r.PostForm)
	if err != nil {
		return "", nil, "", nil, err
	}
	if err := call(ctx, s.cfg.Pool, id); err != nil {
		return "", nil, "", []any{"id", id}, err
	}
	return "outbox", nil, fmt.Sprintf("outbox row %d %s", id, done), []any{"id", id}, nil
}

// ---- Inbox ----

type groupCount struct {
	Group                          string
	Processed, DeadLettered, Total int64
}

// inboxCounts is the inbox's size: exact, or estimated (see inboxCounts).
type inboxCounts struct {
	Groups    []groupCount
	Total     int64
	Estimated bool  // Total is the planner's estimate and Groups a sample's split of it
	FromPages bool  // no statistics: Total is the sample's rows scaled by its share of the pages
	Sampled   int64 // rows in the sample
	Oldest    time.Time
	// Retention is the cleaner's (Config.InboxRetention); 0 when not told.
	Retention time.Duration
	// Overdue: the oldest row is older than the retention, by more than
	// the cleaner's hour of slack: is a cleaner running?
	Overdue bool
}

// exactInboxBelow is the inbox size up to which the pages count it
// exactly: a count(*) takes about 30 ms per 100,000 rows.
const exactInboxBelow = 100_000

// inboxSample is the number of rows the estimate's split samples.
const inboxSample = 20_000

// inboxRowsPerPage is a low guess of the inbox rows an 8 KiB page holds
// (some 70 of about 110 bytes), for a table the planner has no statistics
// of: the guess only sizes the sample.
const inboxRowsPerPage = 60

// inboxCounts returns the inbox's rows by group and outcome: counted when
// the table is small or exact is set, and otherwise estimated, at a cost
// that does not grow with the table: the planner's row count (or, with no
// statistics, the sample's rows scaled by its share of the pages) split by
// group and outcome as a block sample of about inboxSample rows splits it. Groups too small to appear in the sample are
// listed with no rows (the group list itself is exact, walked through the
// primary key).
func (s *server) inboxCounts(ctx context.Context, exact bool) (inboxCounts, error) {
	c := inboxCounts{Retention: s.cfg.InboxRetention}
	var oldest *time.Time
	if err := s.cfg.Pool.QueryRow(ctx, `SELECT min(processed_at) FROM `+s.tables.inbox).Scan(&oldest); err != nil {
		return c, fmt.Errorf("oldest inbox row: %w", err)
	}
	if oldest != nil {
		c.Oldest = *oldest
		c.Overdue = c.Retention > 0 && time.Since(c.Oldest) > c.Retention+time.Hour
	}
	estimate, err := s.inbox.EstimateRows(ctx, s.cfg.Pool)
	if err != nil {
		return c, err
	}
	// A table the planner has no statistics of (never analyzed) is sized
	// by its pages: counted when small, sampled otherwise, the sample then
	// giving the total too.
	var pages int64
	if estimate < 0 {
		if err := s.cfg.Pool.QueryRow(ctx, `SELECT pg_relation_size(to_regclass($1)) / current_setting('block_size')::bigint`,
			s.tables.inbox).Scan(&pages); err != nil {
			return c, fmt.Errorf("inbox size: %w", err)
		}
	}
	const counts = `SELECT consumer_group, count(*) FILTER (WHERE outcome = 'processed') AS processed,
			count(*) FILTER (WHERE outcome = 'dead_lettered') AS dead, count(*) AS total FROM `
	if exact || estimate >= 0 && estimate < exactInboxBelow || estimate < 0 && pages*inboxRowsPerPage < exactInboxBelow {
		rows, err := s.cfg.Pool.Query(ctx, counts+s.tables.inbox+` GROUP BY consumer_group ORDER BY consumer_group`)
		if err != nil {
			return c, fmt.Errorf("count inbox rows: %w", err)
		}
		if c.Groups, err = pgx.CollectRows(rows, pgx.RowToStructByPos[groupCount]); err != nil {
			return c, fmt.Errorf("count inbox rows: %w", err)
		}
		for _, g := range c.Groups {
			c.Total += g.Total
		}
		return c, nil
	}
	c.Estimated = true
	pct := 100 * float64(inboxSample) / float64(estimate)
	if estimate < 0 {
		pct = 100 * float64(inboxSample) / float64(pages*inboxRowsPerPage)
	}
	pct = min(100, pct)
	rows, err := s.cfg.Pool.Query(ctx, `WITH RECURSIVE groups AS (
			SELECT min(consumer_group) AS g FROM `+s.tables.inbox+`
			UNION ALL
			SELECT (SELECT min(consumer_group) FROM `+s.tables.inbox+` WHERE consumer_group > groups.g) FROM groups WHERE g IS NOT NULL),
		sample AS (`+counts+s.tables.inbox+` TABLESAMPLE SYSTEM ($1) GROUP BY consumer_group)
		SELECT groups.g, coalesce(sample.processed, 0), coalesce(sample.dead, 0), coalesce(sample.total, 0)
		FROM groups LEFT JOIN sample ON sample.consumer_group = groups.g WHERE groups.g IS NOT NULL ORDER BY groups.g`, pct)
	if err != nil {
		return c, fmt.Errorf("estimate inbox rows: %w", err)
	}
	if c.Groups, err = pgx.CollectRows(rows, pgx.RowToStructByPos[groupCount]); err != nil {
		return c, fmt.Errorf("estimate inbox rows: %w", err)
	}
	for _, g := range c.Groups {
		c.Sampled += g.Total
	}
	c.Total = estimate
	if estimate < 0 { // a block sample of pct % of the pages holds about pct % of the rows
		c.Total, c.FromPages = int64(float64(c.Sampled)*100/pct), true
	}
	for i := range c.Groups {
		g := &c.Groups[i]
		if c.Sampled > 0 {
			scale := func(n int64) int64 { return int64(float64(n) * float64(c.Total) / float64(c.Sampled)) }
			g.Processed, g.DeadLettered, g.Total = scale(g.Processed), scale(g.DeadLettered), scale(g.Total)
		}
	}
	return c, nil
}

type inboxRow struct {
	Group, MessageID, Outcome string
	At                        time.Time
	Topic                     string
	Partition                 int32
	Offset                    int64
}

type inboxData struct {
	Counts    inboxCounts
	MessageID string
	Rows      []inboxRow
	Looked    bool
}

func (s *server) inboxPage(ctx context.Context, r *http.Request, v *view) (string, error) {
	v.Title, v.Nav = "Inbox", "inbox"
	d := &inboxData{MessageID: strings.TrimSpace(r.URL.Query().Get("message_id"))}
	v.Data = d
	var err error
	if d.Counts, err = s.inboxCounts(ctx, r.URL.Query().Get("exact") == "1"); err != nil {
		return "inbox.html", err
	}
	if d.MessageID == "" {
		return "inbox.html", nil
	}
	d.Looked = true
	// The primary key is (consumer_group, message_id): walk the groups
	// through it (a skip scan) and look the id up in each, rather than scan
	// every row for the id.
	rows, err := s.cfg.Pool.Query(ctx, `WITH RECURSIVE groups AS (
			SELECT min(consumer_group) AS g FROM `+s.tables.inbox+`
			UNION ALL
			SELECT (SELECT min(consumer_group) FROM `+s.tables.inbox+` WHERE consumer_group > groups.g) FROM groups WHERE g IS NOT NULL)
		SELECT i.consumer_group, i.message_id, i.outcome, i.processed_at, i.topic, i.partition, i."offset"
		FROM groups JOIN `+s.tables.inbox+` i ON i.consumer_group = groups.g AND i.message_id = $1
		ORDER BY i.consumer_group`, d.MessageID)
	if err != nil {
		return "inbox.html", fmt.Errorf("look up %q in the inbox: %w", d.MessageID, err)
	}
	d.Rows, err = pgx.CollectRows(rows, pgx.RowToStructByPos[inboxRow])
	return "inbox.html", err
}

// ---- Webhooks ----

type deliveryRow struct {
	SubscriptionID uuid.UUID
	WebhookID      string
	EventType      string
	Status         string
	Attempts       int32
	LastStatus     *int32
	LastError      string
	UpdatedAt      time.Time
}

type webhooksData struct {
	Subs     []outbound.Overview
	Failures []deliveryRow // recent failed attempts, newest first
	Dead     []deliveryRow
}

func (s *server) webhooksPage(ctx context.Context, r *http.Request, v *view) (string, error) {
	v.Title, v.Nav = "Webhooks out", "webhooks"
	d := &webhooksData{}
	v.Data = d
	var err error
	if d.Subs, err = s.hooks.Overviews(ctx, s.cfg.Pool); err != nil {
		return "webhooks.html", err
	}
	// Payloads are never read: they may carry customer data.
	const cols = `subscription_id, webhook_id, event_type, status, attempts, last_status, coalesce(last_error, ''), updated_at`
	if d.Failures, err = s.deliveries(ctx, `SELECT `+cols+` FROM `+s.tables.deliveries+`
		WHERE status <> 'delivered' AND last_error IS NOT NULL AND last_error <> '' ORDER BY updated_at DESC LIMIT 50`); err != nil {
		return "webhooks.html", err
	}
	d.Dead, err = s.deliveries(ctx, `SELECT `+cols+` FROM `+s.tables.deliveries+`
		WHERE status = 'dead' ORDER BY dead_at DESC LIMIT `+strconv.Itoa(maxListed))
	return "webhooks.html", err
}

func (s *server) deliveries(ctx context.Context, sql string) ([]deliveryRow, error) {
	rows, err := s.cfg.Pool.Query(ctx, sql)
	if err != nil {
		return nil, fmt.Errorf("webhook deliveries: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[deliveryRow])
	if err != nil {
		return nil, fmt.Errorf("webhook deliveries: %w", err)
	}
	return out, nil
}

func formSubscription(f url.Values) (uuid.UUID, error) {
	id, err := uuid.Parse(f.Get("subscription"))
	if err != nil {
		return uuid.Nil, badRequest{fmt.Sprintf("subscription: %q is not a subscription id", f.Get("subscription"))}
	}
	return id, nil
}

func (s *server) webhookPause(ctx context.Context, r *http.Request) (string, url.Values, string, []any, error) {
	id, err := formSubscription(r.PostForm)
	if err != nil {
		return "", nil, "", nil, err
	}
	reason := "paused in the console by " + Identity(r.Context())
	if err := s.hooks.PauseSubscription(ctx, s.cfg.Pool, id, reason); err != nil {
		return "", nil, "", []any{"subscription", id}, err
	}
	return "webhooks", nil, fmt.Sprintf("subscription %s paused", id), []any{"subscription", id}, nil
}

func (s *server) webhookResume(ctx context.Context, r *http.Request) (string, url.Values, string, []any, error) {
	id, err := formSubscription(r.PostForm)
	if err != nil {
		return "", nil, "", nil, err
	}
	if err := s.hooks.ResumeSubscription(ctx, s.cfg.Pool, id); err != nil {
		return "", nil, "", []any{"subscription", id}, err
	}
	return "webhooks", nil, fmt.Sprintf("subscription %s resumed (breaker reset)", id), []any{"subscription", id}, nil
}

func (s *server) webhookRedrive(ctx context.Context, r *http.Request) (string, url.Values, string, []any, error) {
	id, err := formSubscription(r.PostForm)
	if err != nil {
		return "", nil, "", nil, err
	}
	ds, err := s.hooks.Redrive(ctx, s.cfg.Pool, outbound.RedriveFilter{SubscriptionID: id})
	if err != nil {
		return "", nil, "", []any{"subscription", id}, err
	}
	ids := make([]string, len(ds))
	for i, d := range ds {
		ids[i] = d.WebhookID
	}
	return "webhooks", nil, fmt.Sprintf("%d dead deliveries of %s redriven", len(ds), id), []any{"subscription", id, "webhook_ids", ids}, nil
}
