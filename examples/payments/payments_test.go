package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/oncelytest"
	"github.com/oncely/oncely/outbox"
)

const stripeSecret = "whsec_test_secret"

// TestHandler runs the consumer's handler on one message at a time, in a
// transaction that is rolled back, and checks what the consumer would do.
func TestHandler(t *testing.T) {
	t.Parallel()
	db := oncelytest.Schema(t, "")
	if _, err := db.Pool.Exec(t.Context(), schemaSQL); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(t.Context(), `INSERT INTO payments (id, client, amount, currency, status)
		VALUES ('p-created', 'acme', 500, 'eur', 'created'), ('p-paid', 'acme', 1000, 'eur', 'paid')`); err != nil {
		t.Fatal(err)
	}
	out, err := outbox.New(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	h := handler(out)

	// effects reads, in the handler's transaction, the ledger and the
	// events it wrote.
	effects := func(want string) oncelytest.Options {
		return oncelytest.Options{Inspect: func(ctx context.Context, tx pgx.Tx) error {
			var got string
			err := tx.QueryRow(ctx, `SELECT coalesce(string_agg(l.kind || ' ' || l.payment_id || ' ' || l.amount, '; '), '') || ' | ' ||
				(SELECT count(*) FROM outbox) || ' event(s)' FROM ledger l`).Scan(&got)
			if err == nil && got != want {
				err = fmt.Errorf("effects %q, want %q", got, want)
			}
			return err
		}}
	}
	stripeEvent := func(typ, payment string) []byte {
		return fmt.Appendf(nil, `{"id": "evt_1", "type": %q, "data": {"object": {"id": "pi_1", "metadata": {"payment_id": %q}}}}`, typ, payment)
	}

	for _, c := range []struct {
		name, topic string
		value       []byte
		effects     string    // for a processed message
		class       dlq.Class // for a dead-lettered one
	}{
		{name: "refund", topic: refundTopic, value: []byte(`{"payment_id": "p-paid", "amount": 300}`), effects: "refund p-paid 300 | 1 event(s)"},
		{name: "capture", topic: stripeTopic, value: stripeEvent("payment_intent.succeeded", "p-created"), effects: "capture p-created 500 | 1 event(s)"},
		{name: "another Stripe event", topic: stripeTopic, value: stripeEvent("customer.created", "p-created"), effects: " | 0 event(s)"},
		{name: "undecodable refund", topic: refundTopic, value: []byte(`{"payment_id": `), class: dlq.ClassUndecodable},
		{name: "undecodable Stripe event", topic: stripeTopic, value: []byte(`not json`), class: dlq.ClassUndecodable},
		{name: "refund above what is left", topic: refundTopic, value: []byte(`{"payment_id": "p-paid", "amount": 1001}`), class: dlq.ClassPermanent},
		{name: "refund of nothing", topic: refundTopic, value: []byte(`{"payment_id": "p-paid", "amount": 0}`), class: dlq.ClassPermanent},
		{name: "refund of an unpaid payment", topic: refundTopic, value: []byte(`{"payment_id": "p-created", "amount": 1}`), class: dlq.ClassPermanent},
		{name: "refund of an unknown payment", topic: refundTopic, value: []byte(`{"payment_id": "p-none", "amount": 1}`), class: dlq.ClassPermanent},
		{name: "second capture", topic: stripeTopic, value: stripeEvent("payment_intent.succeeded", "p-paid"), class: dlq.ClassPermanent},
	} {
		msg := oncelytest.NewMessage(c.topic, nil, c.value)
		if c.class == "" {
			if out := oncelytest.RunWith(t, db.Pool, h, msg, effects(c.effects)); !out.Processed() {
				t.Errorf("%s: %v, want processed", c.name, out)
			}
		} else if out := oncelytest.Run(t, db.Pool, h, msg); !out.DeadLettered(c.class) {
			t.Errorf("%s: %v, want dead-lettered with class %s", c.name, out, c.class)
		}
	}
}

// TestPaymentsEndToEnd runs the service as main does, against a broker and
// a schema of the test's own: the API behind Idempotency-Key, a Stripe
// webhook delivered twice, a refund delivered twice, poison records, the
// events the relay publishes, and the runner's endpoints.
func TestPaymentsEndToEnd(t *testing.T) {
	t.Parallel()
	db := oncelytest.Schema(t, "")
	k := oncelytest.StartKafka(t, stripeTopic, refundTopic, eventTopic, dlq.DefaultTopic(stripeTopic), dlq.DefaultTopic(refundTopic))
	ln, err := new(net.ListenConfig).Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	base := "http://" + ln.Addr().String()
	env := map[string]string{
		"DATABASE_URL": db.URL, "SCHEMA": db.Schema, "KAFKA_BROKERS": strings.Join(k.Brokers, ","),
		"STRIPE_WEBHOOK_SECRET": stripeSecret, "API_KEYS": `{"key-of-acme": "acme", "key-of-globex": "globex"}`,
	}
	ctx, cancel := context.WithCancel(t.Context())
	stopped := make(chan error, 1)
	go func() { stopped <- run(ctx, func(name string) string { return env[name] }, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-stopped; err != nil {
			t.Errorf("run: %v", err)
		}
	})
	waitFor(t, "GET /readyz 200", func() bool { return call(t, "GET", base+"/readyz", nil, nil).status == http.StatusOK })

	// One payment for two requests with one key; the retry gets the first
	// response back. Another client's equal key is another request.
	body := []byte(`{"amount": 1000, "currency": "eur"}`)
	acme := map[string]string{"Authorization": "Bearer key-of-acme", "Idempotency-Key": "order-1"}
	first, retry := call(t, "POST", base+"/payments", acme, body), call(t, "POST", base+"/payments", acme, body)
	if first.status != http.StatusCreated || retry.status != http.StatusCreated || !bytes.Equal(first.body, retry.body) ||
		retry.header.Get(idempotency.ReplayedHeader) != "true" {
		t.Fatalf("POST /payments twice: %d %s, then %d %s (replayed %q); want 201 twice, the same body, the second replayed",
			first.status, first.body, retry.status, retry.body, retry.header.Get(idempotency.ReplayedHeader))
	}
	var created struct{ ID string }
	if err := json.Unmarshal(first.body, &created); err != nil || created.ID == "" {
		t.Fatalf("POST /payments body %s: %v", first.body, err)
	}
	globex := call(t, "POST", base+"/payments", map[string]string{"Authorization": "Bearer key-of-globex", "Idempotency-Key": "order-1"}, body)
	if globex.status != http.StatusCreated || bytes.Equal(globex.body, first.body) {
		t.Errorf("another client's key order-1: %d %s; want a payment of its own", globex.status, globex.body)
	}
	if got := call(t, "POST", base+"/payments", map[string]string{"Idempotency-Key": "order-2"}, body); got.status != http.StatusUnauthorized {
		t.Errorf("POST /payments without an API key: %d, want 401", got.status)
	}
	count(t, db, `SELECT count(*) FROM payments WHERE client = 'acme'`, 1)

	// A Stripe event delivered twice, signed as Stripe signs it: one capture.
	event := fmt.Appendf(nil, `{"id": "evt_1Nv0", "object": "event", "type": "payment_intent.succeeded",
		"data": {"object": {"id": "pi_3Nv0", "object": "payment_intent", "metadata": {"payment_id": %q}}}}`, created.ID)
	for i := range 2 {
		h := map[string]string{"Stripe-Signature": stripeSignature(stripeSecret, event, time.Now()), "Content-Type": "application/json"}
		if got := call(t, "POST", base+"/webhooks/stripe", h, event); got.status != http.StatusAccepted {
			t.Fatalf("Stripe delivery %d: %d %s, want 202", i+1, got.status, got.body)
		}
	}
	forged := map[string]string{"Stripe-Signature": stripeSignature("whsec_other", event, time.Now())}
	if got := call(t, "POST", base+"/webhooks/stripe", forged, event); got.status != http.StatusUnauthorized {
		t.Errorf("a delivery signed with another secret: %d, want 401", got.status)
	}
	waitFor(t, "the capture", func() bool { return query(t, db, `SELECT count(*) FROM ledger WHERE kind = 'capture'`) > 0 })

	// A refund delivered twice under one message id, then two poison records
	// behind it on the same partition.
	refund := func(id, value string) *kgo.Record {
		return &kgo.Record{Topic: refundTopic, Value: []byte(value), Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(id)}}}
	}
	k.Produce(t,
		refund("refund-1", fmt.Sprintf(`{"payment_id": %q, "amount": 300}`, created.ID)),
		refund("refund-1", fmt.Sprintf(`{"payment_id": %q, "amount": 300}`, created.ID)),
		refund("refund-garbled", `{"payment_id": `),
		refund("refund-unknown", `{"payment_id": "no-such-payment", "amount": 300}`))
	classes := map[string]dlq.Class{}
	for _, rec := range k.Consume(t, dlq.DefaultTopic(refundTopic), 2, time.Minute) {
		info, err := dlq.Decode(rec.Headers)
		if err != nil {
			t.Fatal(err)
		}
		classes[info.MessageID] = info.Class
	}
	if want := map[string]dlq.Class{"refund-garbled": dlq.ClassUndecodable, "refund-unknown": dlq.ClassPermanent}; fmt.Sprint(classes) != fmt.Sprint(want) {
		t.Errorf("dead letters %v, want %v", classes, want)
	}
	// The poison came after the duplicates: both copies were consumed by now.
	count(t, db, `SELECT count(*) FROM ledger WHERE kind = 'refund'`, 1)
	count(t, db, `SELECT count(*) FROM ledger WHERE kind = 'refund' AND message_id = 'refund-1'`, 1)
	count(t, db, `SELECT count(*) FROM ledger WHERE kind = 'capture'`, 1)
	count(t, db, `SELECT refunded FROM payments WHERE status = 'paid'`, 300)

	// The relay published each effect's event once.
	events := map[string]int{}
	for _, rec := range k.Consume(t, eventTopic, 4, time.Minute) {
		var e struct {
			Type      string
			PaymentID string `json:"payment_id"`
		}
		if err := json.Unmarshal(rec.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.PaymentID == created.ID || e.Type == "payment.created" {
			events[e.Type]++
		}
	}
	if want := map[string]int{"payment.created": 2, "payment.captured": 1, "payment.refunded": 1}; fmt.Sprint(events) != fmt.Sprint(want) {
		t.Errorf("events published %v, want %v", events, want)
	}

	metrics := call(t, "GET", base+"/metrics", nil, nil)
	if metrics.status != http.StatusOK || !bytes.Contains(metrics.body, []byte("messaging_client_consumed_messages")) {
		t.Errorf("GET /metrics: %d, %d bytes; want the consumer's metrics", metrics.status, len(metrics.body))
	}
	if got := call(t, "GET", base+"/livez", nil, nil); got.status != http.StatusOK {
		t.Errorf("GET /livez: %d", got.status)
	}
}

// stripeSignature is the Stripe-Signature header Stripe sends: t, the unix
// time, and v1, hex(HMAC-SHA256(secret, t + "." + body)).
func stripeSignature(secret string, body []byte, at time.Time) string {
	ts := strconv.FormatInt(at.Unix(), 10)
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write([]byte(ts + "." + string(body)))
	return "t=" + ts + ",v1=" + hex.EncodeToString(mac.Sum(nil))
}

type response struct {
	status int
	header http.Header
	body   []byte
}

// call sends a request; a request that cannot be sent has status -1.
func call(t *testing.T, method, url string, header map[string]string, body []byte) response {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return response{status: -1}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return response{resp.StatusCode, resp.Header, b}
}

func query(t *testing.T, db *oncelytest.DB, sql string) int64 {
	t.Helper()
	var n int64
	if err := db.Pool.QueryRow(t.Context(), sql).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func count(t *testing.T, db *oncelytest.DB, sql string, want int64) {
	t.Helper()
	if got := query(t, db, sql); got != want {
		t.Errorf("%s: %d, want %d", sql, got, want)
	}
}

// waitFor polls cond until it holds, failing the test after a minute.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s within a minute", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
