package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/outbox"
)

// ---- Consumer lag and its trend ----

type lagKey struct {
	Group, Topic string
	Partition    int32
}

type lagRow struct {
	Group, State, Topic string
	Partition           int32 // -1 on a group and topic's total row
	Commit, End, Lag    int64
	Err                 string
	// Trend is the lag's change since the sample Since ago (0 and no Since
	// without an earlier sample).
	Trend int64
	Since time.Duration
	// A RabbitMQ queue's consumers (its Lag the messages ready), and a
	// JetStream consumer's messages awaiting acknowledgement, redelivered,
	// pull requests waiting and last delivery (its Lag the messages
	// pending): see rabbitLag and jetStreamLag.
	Consumers                        int
	AckPending, Redelivered, Waiting int64
	Active                           time.Time
}

// lagSample is the lag of every partition at one time.
type lagSample struct {
	at  time.Time
	lag map[lagKey]int64
}

// lagHistory keeps the lag samples of the last lagKept, at most one per
// minLagGap: every overview view and every tick of Console.Run records the
// lag it read. The trend of a partition compares its lag now with the
// oldest sample no older than trendWindow. The samples live in the
// console's process: a restart starts the trend afresh.
type lagHistory struct {
	mu      sync.Mutex
	samples []lagSample
}

const (
	lagKept     = time.Hour
	minLagGap   = 5 * time.Second
	trendWindow = 15 * time.Minute
)

// record adds rows as a sample taken at now.
func (h *lagHistory) record(now time.Time, rows []lagRow) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if n := len(h.samples); n > 0 && now.Sub(h.samples[n-1].at) < minLagGap {
		return
	}
	s := lagSample{at: now, lag: make(map[lagKey]int64, len(rows))}
	for _, r := range rows {
		if r.Err == "" {
			s.lag[lagKey{r.Group, r.Topic, r.Partition}] = r.Lag
		}
	}
	i := 0
	for i < len(h.samples) && now.Sub(h.samples[i].at) > lagKept {
		i++
	}
	h.samples = append(h.samples[i:], s)
}

// trend sets each row's trend against the oldest sample within
// trendWindow before now that knows its partition.
func (h *lagHistory) trend(now time.Time, rows []lagRow) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i := range rows {
		r := &rows[i]
		if r.Err != "" {
			continue
		}
		for _, s := range h.samples {
			age := now.Sub(s.at)
			if age > trendWindow || age <= 0 {
				continue
			}
			if old, ok := s.lag[lagKey{r.Group, r.Topic, r.Partition}]; ok {
				r.Trend, r.Since = r.Lag-old, age
				break
			}
		}
	}
}

// lag reads every consumer group's lag per partition, records it as a
// sample, and returns it with its trend, a total row per group and topic
// first.
func (s *server) lag(ctx context.Context) ([]lagRow, error) {
	cl, err := s.kafka()
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	listed, err := adm.ListGroups(ctx)
	if err != nil {
		return nil, fmt.Errorf("list consumer groups: %w", err)
	}
	groups := listed.Groups()
	if len(groups) == 0 {
		return nil, nil
	}
	lags, err := adm.Lag(ctx, groups...)
	if err != nil {
		return nil, fmt.Errorf("consumer group lag: %w", err)
	}
	now := time.Now()
	var parts []lagRow
	for _, g := range lags.Sorted() {
		for _, l := range g.Lag.Sorted() {
			row := lagRow{Group: g.Group, State: g.State, Topic: l.Topic, Partition: l.Partition,
				Commit: l.Commit.At, End: l.End.Offset, Lag: l.Lag}
			if l.Err != nil {
				row.Err = l.Err.Error()
			}
			parts = append(parts, row)
		}
	}
	// Totals per group and topic, sampled and trended as partition -1.
	var out []lagRow
	for i := 0; i < len(parts); {
		j := i
		total := lagRow{Group: parts[i].Group, State: parts[i].State, Topic: parts[i].Topic, Partition: -1}
		for ; j < len(parts) && parts[j].Group == total.Group && parts[j].Topic == total.Topic; j++ {
			if parts[j].Err != "" {
				total.Err = "a partition's lag is unknown"
			}
			total.Lag += max(parts[j].Lag, 0)
		}
		out = append(out, total)
		out = append(out, parts[i:j]...)
		i = j
	}
	s.lagHistory.record(now, out)
	s.lagHistory.trend(now, out)
	return out, nil
}

// ---- Dead letters over time ----

type classCount struct {
	Topic  string // the place: a topic, a stream
	Counts map[dlq.Class]int
	Total  int
	Err    string
	Note   string // what the index counted misses (a read under way)
}

// sourceCounts is a source's places with their dead letters by class.
type sourceCounts struct {
	Kind   sourceKind
	Places []classCount
	Err    string // the places are unknown
}

// bucket counts the dead letters whose last failure falls in [At, At+span).
type bucket struct {
	At     time.Time
	Counts map[dlq.Class]int
	Total  int
}

// deadLetterTimes counts dead letters by class in the last 24 hours per
// hour and in the last 14 days per day, by their last failure, every
// dead-letter topic together; Older counts the rest.
type deadLetterTimes struct {
	Hours, Days []bucket
	Older       int
}

func newTimes(now time.Time) *deadLetterTimes {
	t := &deadLetterTimes{}
	h := now.UTC().Truncate(time.Hour)
	for i := 23; i >= 0; i-- {
		t.Hours = append(t.Hours, bucket{At: h.Add(-time.Duration(i) * time.Hour), Counts: map[dlq.Class]int{}})
	}
	d := time.Date(now.UTC().Year(), now.UTC().Month(), now.UTC().Day(), 0, 0, 0, 0, time.UTC)
	for i := 13; i >= 0; i-- {
		t.Days = append(t.Days, bucket{At: d.AddDate(0, 0, -i), Counts: map[dlq.Class]int{}})
	}
	return t
}

func (t *deadLetterTimes) add(at time.Time, c dlq.Class) {
	in := func(bs []bucket, span time.Duration) bool {
		if len(bs) == 0 || at.Before(bs[0].At) || !at.Before(bs[len(bs)-1].At.Add(span)) {
			return false
		}
		i := int(at.Sub(bs[0].At) / span)
		bs[i].Counts[c]++
		bs[i].Total++
		return true
	}
	in(t.Hours, time.Hour)
	if !in(t.Days, 24*time.Hour) {
		t.Older++
	}
}

// nonEmpty drops the buckets without dead letters.
func nonEmpty(bs []bucket) []bucket {
	return slices.DeleteFunc(bs, func(b bucket) bool { return b.Total == 0 })
}

// ---- Outbox per topic ----

type topicBacklog struct {
	Topic          string
	Pending        int64
	OldestPending  time.Duration
	Parked         int64
	OldestParkedAt *time.Time
}

// ---- Readiness ----

// notReady is one thing that is not ready, and why.
type notReady struct{ Component, Reason string }

// readiness returns what is not ready: the runner's reasons, when
// Config.Ready is set, and the console's own findings: the database and
// the brokers unreachable, dead-letter topics missing, consumer groups
// behind with no member, outbox rows parked, webhook breakers open, inbox
// rows past their retention.
func (s *server) readiness(ctx context.Context, d *overviewData) []notReady {
	var out []notReady
	if s.cfg.Ready != nil {
		if err := s.cfg.Ready(); err != nil {
			var multi interface{ Unwrap() []error }
			if errors.As(err, &multi) && len(multi.Unwrap()) > 0 {
				for _, e := range multi.Unwrap() {
					out = append(out, notReady{"runner", e.Error()})
				}
			} else {
				out = append(out, notReady{"runner", err.Error()})
			}
		}
	}
	if err := s.cfg.Pool.Ping(ctx); err != nil {
		out = append(out, notReady{"database", "unreachable: " + err.Error()})
	}
	if d.LagErr != "" {
		out = append(out, notReady{"Kafka", d.LagErr})
	}
	for _, src := range d.DeadLetters {
		if src.Err != "" {
			out = append(out, notReady{"dead-letter " + src.Kind.Noun + "s", src.Err})
		}
		for _, t := range src.Places {
			if t.Err != "" {
				out = append(out, notReady{fmt.Sprintf("%s %q", src.Kind.Noun, t.Topic), t.Err})
			}
		}
	}
	for _, r := range d.Lag {
		if r.Partition == -1 && r.Lag > 0 && (r.State == "Empty" || r.State == "Dead") {
			out = append(out, notReady{fmt.Sprintf("consumer group %q", r.Group),
				fmt.Sprintf("%d records behind on %s and no member consumes (state %s)", r.Lag, r.Topic, r.State)})
		}
	}
	out = append(out, brokersNotReady(d, time.Now())...)
	if d.Outbox.Parked > 0 {
		out = append(out, notReady{"outbox", fmt.Sprintf("%d parked rows hold their keys' later rows back (retry or discard them)", d.Outbox.Parked)})
	}
	if n := d.Breakers["open"]; n > 0 {
		out = append(out, notReady{"webhooks", fmt.Sprintf("%d endpoints' breakers are open", n)})
	}
	if d.Inbox.Overdue {
		out = append(out, notReady{"inbox", fmt.Sprintf("the oldest row is %s old, past the retention of %s: is a cleaner running?",
			time.Since(d.Inbox.Oldest).Round(time.Minute), d.Inbox.Retention)})
	}
	return out
}

// ---- The page ----

type overviewData struct {
	NotReady   []notReady
	Lag        []lagRow
	LagErr     string
	TrendSince time.Duration // how far back the lag samples go
	NoKafka    bool          // only JetStream or RabbitMQ is configured: no lag to show
	// The backlog of the RabbitMQ queues and the JetStream consumers, with
	// its trend (lagRow), when they are configured.
	Rabbit, JetStream       []lagRow
	RabbitErr, JetStreamErr string
	HasRabbit, HasJetStream bool
	// DeadLetters are every source's places; AnyPlaces: one has a place.
	DeadLetters []sourceCounts
	AnyPlaces   bool
	Every       string // what the buckets count: "topic", "topic, stream and queue"
	Times       *deadLetterTimes
	Classes     []dlq.Class
	Outbox      outbox.Status
	Backlog     []topicBacklog
	OutboxErr   string
	Inbox       inboxCounts
	InboxErr    string
	Breakers    map[string]int // by breaker state
	Paused      int
	HooksErr    string
}

var classes = []dlq.Class{dlq.ClassUndecodable, dlq.ClassPermanent, dlq.ClassMaxAttempts, dlq.ClassPanic, dlq.ClassOversized, dlq.ClassCrashLoop}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// overview reads Kafka and the database side by side: the page costs the
// slowest of them, not their sum.
func (s *server) overview(ctx context.Context, r *http.Request, v *view) (string, error) {
	v.Title, v.Nav = "Overview", "overview"
	now := time.Now()
	d := overviewData{Classes: classes, Breakers: map[string]int{}, Times: newTimes(now)}
	v.Data = &d
	var wg sync.WaitGroup
	d.NoKafka = len(s.cfg.KafkaOpts) == 0 && s.otherBrokers()
	if !d.NoKafka {
		wg.Go(func() {
			var err error
			d.Lag, err = s.lag(ctx)
			d.LagErr = errText(err)
			d.TrendSince = s.lagHistory.span(time.Now()).Truncate(time.Second)
		})
	}
	if d.HasRabbit = s.rabbit != nil; d.HasRabbit {
		wg.Go(func() {
			var err error
			d.Rabbit, err = s.rabbitLag(ctx)
			d.RabbitErr = errText(err)
		})
	}
	if d.HasJetStream = s.jetstream != nil; d.HasJetStream {
		wg.Go(func() {
			var err error
			d.JetStream, err = s.jetStreamLag(ctx)
			d.JetStreamErr = errText(err)
		})
	}
	wg.Go(func() {
		var nouns []string
		for _, src := range s.sources() {
			sc := sourceCounts{Kind: src.kind()}
			places, err := src.places(ctx)
			sc.Err = errText(err)
			for _, p := range places {
				sc.Places = append(sc.Places, s.countClasses(ctx, src, p, d.Times))
			}
			d.AnyPlaces = d.AnyPlaces || len(places) > 0
			d.DeadLetters = append(d.DeadLetters, sc)
			nouns = append(nouns, sc.Kind.Noun)
		}
		d.Every = nouns[len(nouns)-1]
		if len(nouns) > 1 {
			d.Every = strings.Join(nouns[:len(nouns)-1], ", ") + " and " + d.Every
		}
		d.Times.Hours, d.Times.Days = nonEmpty(d.Times.Hours), nonEmpty(d.Times.Days)
	})
	wg.Go(func() {
		var err error
		if d.Outbox, err = s.outbox.Status(ctx, s.cfg.Pool); err == nil {
			d.Backlog, err = s.backlog(ctx)
		}
		d.OutboxErr = errText(err)
	})
	wg.Go(func() {
		var err error
		d.Inbox, err = s.inboxCounts(ctx, false)
		d.InboxErr = errText(err)
	})
	wg.Go(func() {
		ovs, err := s.hooks.Overviews(ctx, s.cfg.Pool)
		d.HooksErr = errText(err)
		for _, o := range ovs {
			d.Breakers[string(o.Breaker.State)]++
			if o.Subscription.Paused() {
				d.Paused++
			}
		}
	})
	wg.Wait()
	d.NotReady = s.readiness(ctx, &d)
	return "overview.html", nil
}

// countClasses counts the dead letters of place by class, and adds them
// to times.
func (s *server) countClasses(ctx context.Context, src deadLetterSource, place string, times *deadLetterTimes) classCount {
	cc := classCount{Topic: place, Counts: map[dlq.Class]int{}}
	ti, note, err := src.view(ctx, place, s.cfg.ViewWait)
	cc.Err, cc.Note = errText(err), note
	if err == nil {
		ti.each(func(e dlq.Entry) bool {
			cc.Total++
			if e.Info != nil {
				cc.Counts[e.Info.Class]++
				times.add(e.Info.LastFailure, e.Info.Class)
			}
			return true
		})
	}
	return cc
}

// backlog returns the outbox's pending and parked rows per topic.
func (s *server) backlog(ctx context.Context) ([]topicBacklog, error) {
	rows, err := s.cfg.Pool.Query(ctx, `SELECT topic, count(*) FILTER (WHERE parked_at IS NULL),
			coalesce(now() - min(created_at) FILTER (WHERE parked_at IS NULL), '0'),
			count(*) FILTER (WHERE parked_at IS NOT NULL), min(parked_at)
		FROM `+s.tables.outbox+` WHERE sent_at IS NULL GROUP BY topic ORDER BY topic LIMIT `+fmt.Sprint(maxListed))
	if err != nil {
		return nil, fmt.Errorf("outbox backlog per topic: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[topicBacklog])
	if err != nil {
		return nil, fmt.Errorf("outbox backlog per topic: %w", err)
	}
	return out, nil
}

// span returns how far back the lag samples go from now.
func (h *lagHistory) span(now time.Time) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.samples) == 0 {
		return 0
	}
	return now.Sub(h.samples[0].at)
}
