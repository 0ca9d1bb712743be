package integration_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/internal/ratelog"
	"github.com/oncely/oncely/internal/telemetry"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook"
)

// collect reads every metric from the reader, by name.
func (tl *tel) collect(t *testing.T) map[string]metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := tl.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			out[m.Name] = m
		}
	}
	return out
}

// checkDurationHistograms fails the test unless every histogram in ms is
// in seconds with oncely's bucket boundaries, and names are among them.
func checkDurationHistograms(t *testing.T, ms map[string]metricdata.Metrics, names ...string) {
	t.Helper()
	for _, name := range names {
		if _, ok := ms[name]; !ok {
			t.Errorf("no %s recorded", name)
		}
	}
	for name, m := range ms {
		h, ok := m.Data.(metricdata.Histogram[float64])
		if !ok {
			continue
		}
		if m.Unit != "s" {
			t.Errorf("%s: unit %q, want s", name, m.Unit)
		}
		for _, dp := range h.DataPoints {
			if !slices.Equal(dp.Bounds, telemetry.DurationBuckets) {
				t.Errorf("%s: bounds %v, want %v", name, dp.Bounds, telemetry.DurationBuckets)
			}
			// An attempt, a produce, a request here takes well under
			// the last bound: nothing lands in the overflow bucket.
			if dp.Count == 0 || dp.BucketCounts[len(dp.BucketCounts)-1] != 0 {
				t.Errorf("%s: %d observations, bucket counts %v", name, dp.Count, dp.BucketCounts)
			}
		}
	}
}

// The consumer's processing and the relay's produce durations are
// histograms in seconds with second-based buckets (the SDK's defaults are
// meant for milliseconds: every observation fell in the first bucket).
func TestMetricDurationHistogramsUseSecondBuckets(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	tl := newTel(t)
	ctx := context.Background()
	cfg := e.config("a", recordEffect("a"))
	cfg.TracerProvider, cfg.MeterProvider = tl.tp, tl.mp
	m := e.start(ctx, cfg)
	relay, _ := e.startRelay(ctx, t, func(c *outbox.RelayConfig) { c.TracerProvider, c.MeterProvider = tl.tp, tl.mp })

	e.produce(t, uniqueMsgs("m", 20, 2))
	e.enqueue(t, ctx, true, outbox.Message{Topic: e.topic, Key: []byte("k"), Value: []byte("v")})
	eventually(t, time.Minute, "records processed and the outbox row published", func() bool {
		return m.c.Stats().Processed >= 21 && relay.Stats().Published == 1
	})
	checkDurationHistograms(t, tl.collect(t), "messaging.process.duration", "messaging.client.operation.duration")
}

// An inbox that was never analyzed (reltuples -1) with 22,000 rows reads
// 22,000, not 0; once analyzed, the planner's estimate follows the table as
// it grows, without another ANALYZE.
func TestMetricInboxRowsNeverAnalyzed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	tl := newTel(t)
	ctx := context.Background()
	if _, err := e.db.Pool.Exec(ctx, `ALTER TABLE inbox SET (autovacuum_enabled = false)`); err != nil {
		t.Fatal(err)
	}
	insert := func(from, to int) {
		t.Helper()
		if _, err := e.db.Pool.Exec(ctx, `INSERT INTO inbox (consumer_group, message_id)
			SELECT 'g', 'm-' || i FROM generate_series($1::int, $2::int) i`, from, to); err != nil {
			t.Fatal(err)
		}
	}
	insert(1, 22000)
	if n := e.count(t, `SELECT reltuples::bigint FROM pg_class WHERE oid = 'inbox'::regclass`); n != -1 {
		t.Fatalf("reltuples %d before the test, want -1 (never analyzed)", n)
	}
	cfg := e.config("a", recordEffect("a"))
	cfg.MeterProvider = tl.mp
	m := e.start(ctx, cfg)
	gauge := func() (int64, bool) {
		g, ok := tl.collect(t)["oncely.inbox.rows_estimate"]
		if !ok {
			return 0, false
		}
		dps := g.Data.(metricdata.Gauge[int64]).DataPoints
		if len(dps) != 1 {
			t.Fatalf("%d data points, want 1: %+v", len(dps), dps)
		}
		return dps[0].Value, true
	}
	var got int64
	eventually(t, time.Minute, "the consumer running and the gauge observed", func() bool {
		var ok bool
		got, ok = gauge()
		return m.c.Ready() && ok
	})
	if got != 22000 {
		t.Fatalf("oncely.inbox.rows_estimate = %d with 22000 rows never analyzed, want 22000", got)
	}

	if _, err := e.db.Pool.Exec(ctx, `ANALYZE inbox`); err != nil {
		t.Fatal(err)
	}
	insert(22001, 44000)
	got, _ = gauge()
	if got < 42000 || got > 46000 {
		t.Fatalf("oncely.inbox.rows_estimate = %d with 44000 rows, 22000 of them analyzed, want about 44000", got)
	}
}

// clientIDSink is a fake seed broker that records the client id of the
// first request on each connection, then hangs up.
func clientIDSink(t *testing.T) (addr string, ids <-chan string) {
	t.Helper()
	ln, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan string, 64)
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			// Request: size, api key, version, correlation id, client id
			// (int16 length, then bytes).
			var hdr [4 + 2 + 2 + 4 + 2]byte
			if _, err := io.ReadFull(conn, hdr[:]); err == nil {
				id := make([]byte, binary.BigEndian.Uint16(hdr[12:]))
				if _, err := io.ReadFull(conn, id); err == nil {
					select {
					case ch <- string(id):
					default:
					}
				}
			}
			_ = conn.Close()
		}
	}()
	return ln.Addr().String(), ch
}

// The Kafka client id of the consumer (which also writes the dead-letter
// records) and of the relay: the consumer's instance id, a configured id,
// or oncely-<hostname>-<pid>; never franz-go's default "kgo".
func TestTelemetryKafkaClientID(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	def := "oncely-" + host + "-" + strconv.Itoa(os.Getpid())
	first := func(ids <-chan string) string {
		t.Helper()
		select {
		case id := <-ids:
			return id
		case <-time.After(30 * time.Second):
			t.Fatal("no request reached the fake broker within 30s")
			return ""
		}
	}
	for _, tc := range []struct{ name, instanceID, clientID, want string }{
		{"default", "", "", def},
		{"instance id", "worker-3", "", "worker-3"},
		{"configured", "worker-3", "payments-1", "payments-1"},
	} {
		t.Run("consumer "+tc.name, func(t *testing.T) {
			addr, ids := clientIDSink(t)
			cfg := e.config("a", recordEffect("a"))
			cfg.Brokers, cfg.InstanceID, cfg.ClientID = []string{addr}, tc.instanceID, tc.clientID
			e.start(context.Background(), cfg)
			if got := first(ids); got != tc.want {
				t.Errorf("client id %q, want %q", got, tc.want)
			}
		})
	}
	for _, tc := range []struct{ name, clientID, want string }{{"default", "", def}, {"configured", "relay-1", "relay-1"}} {
		t.Run("relay "+tc.name, func(t *testing.T) {
			addr, ids := clientIDSink(t)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			e.startRelay(ctx, t, func(c *outbox.RelayConfig) { c.Brokers, c.ClientID = []string{addr}, tc.clientID })
			e.enqueue(t, ctx, true, outbox.Message{Topic: e.topic, Value: []byte(tc.name)})
			if got := first(ids); got != tc.want {
				t.Errorf("client id %q, want %q", got, tc.want)
			}
		})
	}
}

// logRecords keeps the records a logger writes.
type logRecords struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (l *logRecords) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecords) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.recs = append(l.recs, r.Clone())
	return nil
}
func (l *logRecords) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecords) WithGroup(string) slog.Handler      { return l }

// warnings returns the count of WARN-or-above records by message, and the
// largest "suppressed" count a record of a message carried.
func (l *logRecords) warnings() (count, suppressed map[string]int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	count, suppressed = map[string]int64{}, map[string]int64{}
	for _, r := range l.recs {
		if r.Level < slog.LevelWarn {
			continue
		}
		count[r.Message]++
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == ratelog.SuppressedKey {
				suppressed[r.Message] = max(suppressed[r.Message], a.Value.Int64())
			}
			return true
		})
	}
	return count, suppressed
}

// While the database is unreachable, the consumer's and the relay's
// warnings of one kind go out once per LogInterval, however often their
// loops fail, and the next one says how many were held back.
func TestTelemetryOutageWarningsRateLimited(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	proxy := testenv.NewPostgresProxy(t)
	consumerLog, relayLog := &logRecords{}, &logRecords{}

	cfg := e.config("a", recordEffect("a"))
	cfg.Pool = proxy.Pool(t, e.db.Schema, 4)
	cfg.Logger = slog.New(consumerLog)
	cfg.LogInterval = time.Hour // one line of a kind for the whole test
	m := e.start(ctx, cfg)
	relay, _ := e.startRelay(ctx, t, func(c *outbox.RelayConfig) {
		c.Pool = proxy.Pool(t, e.db.Schema, 4)
		c.Logger = slog.New(relayLog)
		c.LogInterval = 100 * time.Millisecond
	})
	// Records before the outage: the partitions' workers are running.
	e.produce(t, uniqueMsgs("before", 20, 2))
	eventually(t, time.Minute, "the first records processed, the relay ready", func() bool {
		return m.c.Stats().Processed == 20 && m.c.Ready() && relay.Ready()
	})

	proxy.Cut()
	e.produce(t, uniqueMsgs("during", 20, 2))
	const failures = 60
	eventually(t, time.Minute, "the consumer's attempts failing on the database", func() bool {
		return m.c.Stats().Retries >= failures
	})
	// The relay fails every cycle too; a line after the first carries the
	// count of those held back.
	eventually(t, time.Minute, "a relay warning counting held-back ones", func() bool {
		_, suppressed := relayLog.warnings()
		return suppressed["oncely outbox: reading pending shards failed"] >= 3
	})

	count, _ := consumerLog.warnings()
	var total int64
	for msg, n := range count {
		total += n
		if n > 1 {
			t.Errorf("%q logged %d times within one LogInterval, want once", msg, n)
		}
	}
	if count["oncely attempt failed on the database; retrying"]+count["oncely batch failed on the database; retrying"] == 0 {
		t.Errorf("no warning about the database: %v", count)
	}
	if total >= failures {
		t.Errorf("%d warnings for %d failed attempts", total, failures)
	}

	proxy.Restore()
	eventually(t, time.Minute, "every record processed after the outage", func() bool {
		return e.count(t, `SELECT count(DISTINCT message_id) FROM effects`) == 40
	})
}

// counts reads a counter's data points by the values of keys.
func (tl *tel) counts(t *testing.T, name string, keys ...attribute.Key) map[string]int64 {
	t.Helper()
	m, ok := tl.collect(t)[name]
	if !ok {
		t.Fatalf("no %s recorded", name)
	}
	out := map[string]int64{}
	for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
		var parts []string
		for _, k := range keys {
			v, _ := dp.Attributes.Value(k)
			parts = append(parts, v.Emit())
		}
		out[strings.Join(parts, "/")] += dp.Value
	}
	return out
}

// outcomes lists the value of key on the ended spans named name.
func (tl *tel) outcomes(name string, key attribute.Key) []string {
	var out []string
	for _, s := range tl.ended(name) {
		out = append(out, attrs(s)[key].Emit())
	}
	slices.Sort(out)
	return out
}

// Every request to a webhook receiver is a span with its outcome, and is
// counted by outcome and refusal reason: accepted, duplicate, refused (bad
// method, body too large, missing or wrong signature) and failed (database
// down). The stored row carries the span's trace context.
func TestTelemetryWebhookReceiver(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	tl := newTel(t)
	proxy := testenv.NewPostgresProxy(t)
	_, srv := e.webhookReceiver(t, proxy.Pool(t, e.db.Schema, 4), func(c *webhook.Config) {
		c.TracerProvider, c.MeterProvider, c.MaxBodyBytes = tl.tp, tl.mp, 1024
	})
	body := []byte(`{"order_id":"o-1"}`)
	d := signWebhook(t, webhookSecret, "msg_tel_1", body, time.Now())
	for _, c := range []struct {
		name   string
		status int
		send   func() int
	}{
		{"accepted", 202, func() int { s, _ := d.post(t, http.MethodPost, srv.URL, true); return s }},
		{"duplicate", 202, func() int { s, _ := d.post(t, http.MethodPost, srv.URL, true); return s }},
		{"unsigned", 401, func() int { s, _ := d.post(t, http.MethodPost, srv.URL, false); return s }},
		{"wrong secret", 401, func() int {
			s, _ := signWebhook(t, "whsec_"+base64.StdEncoding.EncodeToString([]byte("another-secret-of-32-bytes-long!")), "msg_tel_2", body, time.Now()).
				post(t, http.MethodPost, srv.URL, true)
			return s
		}},
		{"method", 405, func() int { s, _ := d.post(t, http.MethodPut, srv.URL, true); return s }},
		{"too large", 413, func() int {
			s, _ := signWebhook(t, webhookSecret, "msg_tel_3", bytes.Repeat([]byte("x"), 2048), time.Now()).post(t, http.MethodPost, srv.URL, true)
			return s
		}},
		{"database down", 503, func() int {
			proxy.Cut()
			defer proxy.Restore()
			s, _ := signWebhook(t, webhookSecret, "msg_tel_4", body, time.Now()).post(t, http.MethodPost, srv.URL, true)
			return s
		}},
	} {
		if got := c.send(); got != c.status {
			t.Fatalf("%s: answered %d, want %d", c.name, got, c.status)
		}
	}

	want := map[string]int64{"accepted/": 1, "duplicate/": 1, "refused/missing_signature": 1, "refused/signature_mismatch": 1,
		"refused/method": 1, "refused/body_too_large": 1, "failed/": 1}
	if got := tl.counts(t, webhook.MetricInboundRequests, "oncely.webhook.outcome", "oncely.webhook.refusal"); !maps.Equal(got, want) {
		t.Errorf("%s by outcome/refusal: %v, want %v", webhook.MetricInboundRequests, got, want)
	}
	if got, want := tl.outcomes(webhook.SpanReceive, "oncely.webhook.outcome"),
		[]string{"accepted", "duplicate", "failed", "refused", "refused", "refused", "refused"}; !slices.Equal(got, want) {
		t.Errorf("%s spans' outcomes %v, want %v", webhook.SpanReceive, got, want)
	}
	for _, s := range tl.ended(webhook.SpanReceive) {
		a := attrs(s)
		switch a["oncely.webhook.outcome"].Emit() {
		case "accepted":
			var tp string
			if err := e.db.Pool.QueryRow(context.Background(), `SELECT convert_from(header_values[array_position(header_keys, 'traceparent')], 'UTF8')
				FROM outbox WHERE message_id = 'msg_tel_1'`).Scan(&tp); err != nil {
				t.Fatal(err)
			}
			if tp != traceparentOf(s.SpanContext()) || a["messaging.message.id"].Emit() != "msg_tel_1" ||
				a["oncely.webhook.provider"].Emit() != webhook.ProviderStandardWebhooks || a["http.response.status_code"].AsInt64() != 202 {
				t.Errorf("accepted span %v, stored traceparent %q", a, tp)
			}
		case "failed":
			if s.Status().Code != codes.Error || a["http.response.status_code"].AsInt64() != 503 {
				t.Errorf("failed span: status %v, attributes %v", s.Status(), a)
			}
		case "refused":
			if s.Status().Code == codes.Error {
				t.Errorf("a refusal is marked as a span error: %v", a)
			}
		}
	}
	checkDurationHistograms(t, tl.collect(t), webhook.MetricInboundDuration)
}

// Every request of the middleware's methods is a span, the handler's spans
// its children, with its outcome, and is counted by outcome: stored,
// replayed, mismatch, conflict, refused, not_stored, aborted. Other methods
// pass through without either.
func TestTelemetryIdempotency(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	tl := newTel(t)
	entered, release := make(chan struct{}), newGate()
	mw, err := idempotency.New(e.db.Pool, idempotency.Config{Schema: e.db.Schema, TracerProvider: tl.tp, MeterProvider: tl.mp})
	if err != nil {
		t.Fatal(err)
	}
	keyed := mw.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, span := tl.tp.Tracer("test").Start(r.Context(), "handler")
		defer span.End()
		switch r.URL.Path {
		case "/slow":
			entered <- struct{}{}
			release.wait()
		case "/fail":
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		case "/abort":
			panic(http.ErrAbortHandler)
		}
		w.WriteHeader(http.StatusCreated)
	}))
	// The authentication in front names the client the keys belong to.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keyed.ServeHTTP(w, r.WithContext(idempotency.WithClient(r.Context(), "client-1")))
	}))
	t.Cleanup(srv.Close)
	send := func(method, path, key, body string) int {
		t.Helper()
		r, err := http.NewRequestWithContext(context.Background(), method, srv.URL+path, strings.NewReader(body))
		if err != nil {
			t.Error(err)
			return 0
		}
		if key != "" {
			r.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Error(err)
			return 0
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}

	for _, c := range []struct {
		method, path, key, body string
		status                  int
	}{
		{"POST", "/orders", "k1", "a", 201}, // stored
		{"POST", "/orders", "k1", "a", 201}, // replayed
		{"POST", "/orders", "k1", "b", 422}, // mismatch
		{"POST", "/orders", "", "a", 400},   // refused: no key
		{"POST", "/fail", "k3", "a", 503},   // not stored
		{"GET", "/orders", "", "", 201},     // not one of the methods
	} {
		if got := send(c.method, c.path, c.key, c.body); got != c.status {
			t.Fatalf("%s %s key %q: %d, want %d", c.method, c.path, c.key, got, c.status)
		}
	}
	slow := make(chan int, 1)
	go func() { slow <- send("POST", "/slow", "k2", "a") }()
	<-entered
	if got := send("POST", "/slow", "k2", "a"); got != http.StatusConflict {
		t.Fatalf("a second request while the first holds the key: %d, want 409", got)
	}
	release.open()
	if got := <-slow; got != http.StatusCreated {
		t.Fatalf("the slow request: %d, want 201", got)
	}
	r, err := http.NewRequestWithContext(context.Background(), "POST", srv.URL+"/abort", strings.NewReader("a"))
	if err != nil {
		t.Fatal(err)
	}
	r.Header.Set("Idempotency-Key", "k4")
	// A connection of its own: Go's transport resends a request with an
	// Idempotency-Key that fails on a reused connection.
	fresh := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	if resp, err := fresh.Do(r); err == nil {
		_ = resp.Body.Close()
		t.Fatalf("a handler that aborts: answered %d, want no answer", resp.StatusCode)
	}

	want := map[string]int64{"stored/": 2, "replayed/": 1, "mismatch/": 1, "refused/missing_key": 1, "not_stored/": 1, "conflict/": 1, "aborted/": 1}
	if got := tl.counts(t, idempotency.MetricRequests, "oncely.idempotency.outcome", "oncely.idempotency.refusal"); !maps.Equal(got, want) {
		t.Errorf("%s by outcome/refusal: %v, want %v", idempotency.MetricRequests, got, want)
	}
	spans := tl.ended(idempotency.SpanRequest)
	if got, want := tl.outcomes(idempotency.SpanRequest, "oncely.idempotency.outcome"),
		[]string{"aborted", "conflict", "mismatch", "not_stored", "refused", "replayed", "stored", "stored"}; !slices.Equal(got, want) {
		t.Errorf("%s spans' outcomes %v, want %v", idempotency.SpanRequest, got, want)
	}
	// The handler ran for the two stored requests, the one not stored, the
	// aborted one and the GET: under the middleware's span for all but the
	// GET.
	var parented int
	for _, h := range tl.ended("handler") {
		for _, s := range spans {
			if h.Parent().SpanID() == s.SpanContext().SpanID() {
				parented++
			}
		}
	}
	if n := len(tl.ended("handler")); n != 5 || parented != 4 {
		t.Errorf("%d handler spans, %d of them under the middleware's span; want 5 and 4", n, parented)
	}
	checkDurationHistograms(t, tl.collect(t), idempotency.MetricDuration)
}

// The relay's gauges count the backlog exactly: pending and parked rows,
// not the sent ones kept for the retention.
func TestMetricOutboxGaugesCountTheBacklog(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	tl := newTel(t)
	ctx := context.Background()
	msgs := make([]outbox.Message, 1005)
	for i := range msgs {
		msgs[i] = outbox.Message{Topic: e.topic, Key: []byte(strconv.Itoa(i)), Value: []byte("v")}
	}
	e.enqueue(t, ctx, true, msgs...)
	if _, err := e.db.Pool.Exec(ctx, `UPDATE outbox SET sent_at = now() WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT 1000)`); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Pool.Exec(ctx, `UPDATE outbox SET parked_at = now(), error = 'test' WHERE id = (SELECT max(id) FROM outbox)`); err != nil {
		t.Fatal(err)
	}
	// A broker that never answers: the relay publishes nothing.
	addr, _ := clientIDSink(t)
	e.startRelay(ctx, t, func(c *outbox.RelayConfig) { c.Brokers, c.MeterProvider = []string{addr}, tl.mp })
	eventually(t, time.Minute, "the relay's gauges", func() bool {
		_, ok := tl.gauge(t, "oncely.outbox.pending")
		return ok
	})
	pending, _ := tl.gauge(t, "oncely.outbox.pending")
	parked, _ := tl.gauge(t, "oncely.outbox.parked")
	if pending != 4 || parked != 1 {
		t.Errorf("oncely.outbox.pending %d, oncely.outbox.parked %d; want 4 and 1 (1000 sent rows not counted)", pending, parked)
	}
	oldest := tl.collect(t)["oncely.outbox.oldest_pending_age"].Data.(metricdata.Gauge[float64]).DataPoints
	if len(oldest) != 1 || oldest[0].Value <= 0 {
		t.Errorf("oncely.outbox.oldest_pending_age %+v, want one positive value", oldest)
	}
}

// The runner hands its providers to the webhook receivers and idempotency
// middleware it creates, as to its consumers and relay.
func TestTelemetryRunnerInstrumentsHTTPComponents(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	tl := newTel(t)
	r, err := oncely.New(oncely.Config{Pool: e.db.Pool, Schema: e.db.Schema, Brokers: e.kafka.Brokers,
		TracerProvider: tl.tp, MeterProvider: tl.mp})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := r.Idempotency(idempotency.Config{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := webhook.NewStandardWebhooks(webhook.VerifierConfig{Secrets: []string{webhookSecret}})
	if err != nil {
		t.Fatal(err)
	}
	rc, err := r.Webhook(webhook.Config{Topic: e.topic, Verifier: v})
	if err != nil {
		t.Fatal(err)
	}
	keyed := mw.Require(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusCreated) }))
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keyed.ServeHTTP(w, r.WithContext(idempotency.WithClient(r.Context(), "client-1")))
	}))
	t.Cleanup(api.Close)
	hooks := httptest.NewServer(rc)
	t.Cleanup(hooks.Close)

	req, err := http.NewRequestWithContext(context.Background(), "POST", api.URL, strings.NewReader("a"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", "k1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST with a key: %v, %v", resp, err)
	}
	_ = resp.Body.Close()
	if s, _ := signWebhook(t, webhookSecret, "msg_runner_1", []byte(`{}`), time.Now()).post(t, http.MethodPost, hooks.URL, true); s != http.StatusAccepted {
		t.Fatalf("webhook delivery: %d, want 202", s)
	}

	if got := tl.counts(t, idempotency.MetricRequests, "oncely.idempotency.outcome"); got["stored"] != 1 {
		t.Errorf("%s %v, want one stored", idempotency.MetricRequests, got)
	}
	if got := tl.counts(t, webhook.MetricInboundRequests, "oncely.webhook.outcome"); got["accepted"] != 1 {
		t.Errorf("%s %v, want one accepted", webhook.MetricInboundRequests, got)
	}
	if n, m := len(tl.ended(idempotency.SpanRequest)), len(tl.ended(webhook.SpanReceive)); n != 1 || m != 1 {
		t.Errorf("%d %q and %d %q spans, want one of each", n, idempotency.SpanRequest, m, webhook.SpanReceive)
	}
}
