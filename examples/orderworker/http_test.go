package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/examples/orderworker/internal/testhalt"
	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/webhook"
)

// The HTTP routes, against worker processes: the webhook hammer, the
// Idempotency-Key hammer, and a worker killed (SIGKILL) in the middle of a
// POST /orders, on either side of its commit.

// Standard Webhooks secrets: whsec_ and the base64 of the key. Workers get
// both, as during a rotation; senders sign with the new one.
var (
	newWebhookSecret = "whsec_" + base64.StdEncoding.EncodeToString([]byte("orderworker test webhook key, new"))
	oldWebhookSecret = "whsec_" + base64.StdEncoding.EncodeToString([]byte("orderworker test webhook key, old"))
)

// hammerSize is how many identical requests the hammers send at once.
const hammerSize = 25

// apiClient never reuses a connection: net/http's Transport silently
// retries a request carrying an Idempotency-Key on a broken reused
// connection (it treats it as replayable), which would hide what the server
// did with the first attempt. A request with "Expect: 100-continue" waits
// for the server's go-ahead before its body is sent.
var apiClient = &http.Client{
	Transport: &http.Transport{DisableKeepAlives: true, ExpectContinueTimeout: 10 * time.Second},
	Timeout:   30 * time.Second,
}

// reply is a response, read in full.
type reply struct {
	status int
	header http.Header
	body   []byte
}

func (r reply) replayed() bool { return r.header.Get(idempotency.ReplayedHeader) == "true" }

// label is the reply's entry in a status histogram.
func (r reply) label() string {
	if r.replayed() {
		return strconv.Itoa(r.status) + " replayed"
	}
	return strconv.Itoa(r.status)
}

func send(ctx context.Context, method, target string, header http.Header, body []byte) (reply, error) {
	req, err := http.NewRequestWithContext(ctx, method, target, bytes.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	if header != nil {
		req.Header = header.Clone()
	}
	resp, err := apiClient.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: b}, err
}

// together runs do n times at once: n goroutines wait until all of them are
// ready, then are released by one close.
func together(n int, do func() (reply, error)) ([]reply, []error) {
	replies, errs := make([]reply, n), make([]error, n)
	var ready, done sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		ready.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			ready.Done()
			<-start
			replies[i], errs[i] = do()
		}()
	}
	ready.Wait()
	close(start)
	done.Wait()
	return replies, errs
}

// histogram counts replies by status ("202", "202 replayed", "409", ...)
// and failed requests ("error").
func histogram(replies []reply, errs []error) map[string]int {
	h := map[string]int{}
	for i, r := range replies {
		if errs[i] != nil {
			h["error"]++
			continue
		}
		h[r.label()]++
	}
	return h
}

// signed returns the Standard Webhooks headers of a delivery: webhook-id,
// webhook-timestamp and webhook-signature "v1," + base64(HMAC-SHA256(key,
// id + "." + timestamp + "." + body)), key being the secret without whsec_,
// base64-decoded.
func signed(t *testing.T, secret, id string, body []byte, at time.Time) http.Header {
	t.Helper()
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		t.Fatal(err)
	}
	ts := strconv.FormatInt(at.Unix(), 10)
	m := hmac.New(sha256.New, key)
	m.Write([]byte(id + "." + ts + "."))
	m.Write(body)
	return http.Header{
		"Content-Type":      {"application/json"},
		"Webhook-Id":        {id},
		"Webhook-Timestamp": {ts},
		"Webhook-Signature": {"v1," + base64.StdEncoding.EncodeToString(m.Sum(nil))},
	}
}

// keyed returns the headers of a POST /orders with key.
func keyed(key string) http.Header {
	return http.Header{"Content-Type": {"application/json"}, idempotency.DefaultHeader: {key}}
}

// testOrder is an order of its own customer, so that the customer's balance
// is the order's amount exactly when the order counted once.
func testOrder(prefix string) (Order, []byte) {
	o := Order{OrderID: testenv.UniqueName(prefix + "-ord"), CustomerID: testenv.UniqueName(prefix + "-cust"), AmountCents: 4242}
	b, _ := json.Marshal(o) // cannot fail: strings and an int
	return o, b
}

// startReady starts a worker and waits until GET /healthz answers 200
// (migrated and consuming); it returns the worker and its base URL.
func (e *env) startReady(ctx context.Context, name string, environ []string, extra ...string) (*workerProcess, string) {
	e.t.Helper()
	w := e.startWithEnv(name, environ, extra...)
	var base string
	if err := poll(ctx, 30*time.Second, 20*time.Millisecond, name+" ready", func(ctx context.Context) (bool, error) {
		if err := alive(w); err != nil {
			return false, err
		}
		if base == "" {
			m := w.find(httpAddrRE)
			if m == nil {
				return false, nil
			}
			base = "http://" + m[1]
		}
		r, err := send(ctx, http.MethodGet, base+"/healthz", nil, nil)
		return err == nil && r.status == http.StatusOK, nil
	}); err != nil {
		e.t.Fatal(err)
	}
	return w, base
}

// waitProcessed waits until the relays published the outbox and the group
// consumed everything on the topic, with at least n orders applied.
func (e *env) waitProcessed(ctx context.Context, n int, ws ...*workerProcess) {
	e.t.Helper()
	e.waitPublished(ctx, 20*time.Second, ws...)
	e.waitEffects(ctx, n, 30*time.Second, ws...)
}

// requireOneEffect fails unless the order has exactly one row in orders,
// under messageID, its customer's balance is its amount, and the inbox
// holds messageID once.
func (e *env) requireOneEffect(ctx context.Context, o Order, messageID string) {
	e.t.Helper()
	rows, err := e.db.Pool.Query(ctx, `SELECT message_id FROM orders WHERE order_id = $1`, o.OrderID)
	if err != nil {
		e.t.Fatal(err)
	}
	var ids []string
	var id string
	if _, err := pgx.ForEachRow(rows, []any{&id}, func() error { ids = append(ids, id); return nil }); err != nil {
		e.t.Fatal(err)
	}
	var balance int64
	if err := e.db.Pool.QueryRow(ctx, `SELECT balance_cents FROM customer_balances WHERE customer_id = $1`, o.CustomerID).Scan(&balance); err != nil {
		e.t.Fatalf("balance of %s: %v", o.CustomerID, err)
	}
	inbox, err := e.count(ctx, `SELECT count(*) FROM inbox WHERE consumer_group = $1 AND message_id = $2`, e.group, messageID)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Logf("order %s: %d row(s) in orders (message ids %v), balance %d (amount %d), inbox rows for %s: %d",
		o.OrderID, len(ids), ids, balance, o.AmountCents, messageID, inbox)
	if len(ids) != 1 || ids[0] != messageID || balance != o.AmountCents || inbox != 1 {
		e.t.Errorf("not exactly one effect: want one row under message id %s, balance %d and one inbox row", messageID, o.AmountCents)
	}
}

// webhookStatsRE reads the receiver's counters from the stopped line.
var webhookStatsRE = regexp.MustCompile(`webhooks_stored=(\d+) webhooks_duplicates=(\d+) webhooks_refused=(\d+)`)

// TestWebhookHammer: 25 identical, signed deliveries of one order at once
// all get 202, and the order has exactly one effect. Refused deliveries
// (no signature, wrong secret, stale, oversized, wrong method) store
// nothing. A redelivery after the outbox forgot the first is published again
// and skipped by the consumer's inbox.
func TestWebhookHammer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	w, base := e.startReady(ctx, "worker-1", []string{"WEBHOOK_SECRET=" + oldWebhookSecret + ", " + newWebhookSecret})
	endpoint := base + webhookPath

	o, body := testOrder("wh")
	id := testenv.UniqueName("msg")
	h := signed(t, newWebhookSecret, id, body, time.Now())
	replies, errs := together(hammerSize, func() (reply, error) { return send(ctx, http.MethodPost, endpoint, h, body) })
	hist := histogram(replies, errs)
	t.Logf("%d identical webhook deliveries at once: statuses %v", hammerSize, hist)
	if hist["202"] != hammerSize {
		t.Errorf("statuses %v; want all %d answered 202", hist, hammerSize)
	}

	// Refusals: each with its status, none with a side effect.
	now := time.Now()
	big := bytes.Repeat([]byte(" "), webhook.DefaultMaxBodyBytes+1)
	// The oversized requests wait for 100 Continue, which never comes: the
	// 413 is the answer to the headers (Content-Length), and the client does
	// not see a reset while it would still be writing the body.
	bigUnsigned := http.Header{"Webhook-Id": {"msg_big"}, "Expect": {"100-continue"}}
	bigSigned := signed(t, newWebhookSecret, "msg_big_signed", big, now)
	bigSigned.Set("Expect", "100-continue")
	unsigned := signed(t, newWebhookSecret, "msg_unsigned", body, now)
	unsigned.Del("Webhook-Signature")
	tampered := signed(t, newWebhookSecret, "msg_tampered", body, now)
	refusals := []struct {
		name, method, id string
		header           http.Header
		body             []byte
		want             int
	}{
		{"unsigned", http.MethodPost, "msg_unsigned", unsigned, body, http.StatusUnauthorized},
		{"wrong secret", http.MethodPost, "msg_wrong", signed(t, "whsec_"+base64.StdEncoding.EncodeToString([]byte("nobody's key")), "msg_wrong", body, now), body, http.StatusUnauthorized},
		{"tampered body", http.MethodPost, "msg_tampered", tampered, bytes.Replace(body, []byte("4242"), []byte("9999"), 1), http.StatusUnauthorized},
		{"stale", http.MethodPost, "msg_stale", signed(t, newWebhookSecret, "msg_stale", body, now.Add(-10*time.Minute)), body, http.StatusUnauthorized},
		{"future", http.MethodPost, "msg_future", signed(t, newWebhookSecret, "msg_future", body, now.Add(10*time.Minute)), body, http.StatusUnauthorized},
		{"oversized, unsigned", http.MethodPost, "msg_big", bigUnsigned, big, http.StatusRequestEntityTooLarge},
		{"oversized, signed", http.MethodPost, "msg_big_signed", bigSigned, big, http.StatusRequestEntityTooLarge},
		{"GET", http.MethodGet, "msg_get", signed(t, newWebhookSecret, "msg_get", nil, now), nil, http.StatusMethodNotAllowed},
	}
	var refusedIDs []string
	for _, c := range refusals {
		r, err := send(ctx, c.method, endpoint, c.header, c.body)
		if err != nil || r.status != c.want {
			t.Errorf("%s: %d, %v; want %d", c.name, r.status, err, c.want)
		}
		refusedIDs = append(refusedIDs, c.id)
	}
	if n, err := e.count(ctx, `SELECT count(*) FROM outbox WHERE message_id = ANY($1)`, refusedIDs); err != nil || n != 0 {
		t.Errorf("%d outbox rows for refused deliveries, %v; want 0", n, err)
	}

	e.waitProcessed(ctx, 1, w)
	e.requireOneEffect(ctx, o, id)

	// The outbox keeps sent rows for a day (a redelivery until then is a
	// duplicate there). Past that, a redelivery is stored and published
	// again, under the same id, and the consumer's inbox skips it.
	if n, err := e.count(ctx, `WITH d AS (DELETE FROM outbox WHERE message_id = $1 AND sent_at IS NOT NULL RETURNING 1)
		SELECT count(*) FROM d`, id); err != nil || n != 1 {
		t.Fatalf("deleted %d sent outbox rows of %s, %v; want 1", n, id, err)
	}
	r, err := send(ctx, http.MethodPost, endpoint, signed(t, newWebhookSecret, id, body, time.Now()), body)
	if err != nil || r.status != http.StatusAccepted {
		t.Fatalf("redelivery: %d, %v; want 202", r.status, err)
	}
	e.waitProcessed(ctx, 1, w)
	e.requireOneEffect(ctx, o, id)

	stopAll(t, w)
	_, dups := stats(t, w)
	m := w.find(webhookStatsRE)
	if m == nil {
		t.Fatal("no webhook counters in the stopped line")
	}
	t.Logf("worker: webhooks stored %s, found already stored %s, refused %s; records skipped by the inbox %d", m[1], m[2], m[3], dups)
	if m[1] != "2" || m[2] != strconv.Itoa(hammerSize-1) || m[3] != strconv.Itoa(len(refusals)) || dups != 1 {
		t.Errorf("want 2 stored (the first delivery and the late redelivery), %d duplicates, %d refused, 1 skipped by the inbox",
			hammerSize-1, len(refusals))
	}
}

// TestOrdersHammer: 25 identical POST /orders with one Idempotency-Key at
// once get 202 (one fresh, the others replays) or 409 (the key was in
// progress), and the order has one effect. A later retry gets the first
// response byte for byte; the key with another body gets 422; no key gets
// 400; an invalid order gets 400, recorded like any answer. Without a
// webhook secret, the webhook route answers 503.
func TestOrdersHammer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	w, base := e.startReady(ctx, "worker-1", []string{"WEBHOOK_SECRET="})
	endpoint := base + ordersPath

	o, body := testOrder("api")
	key := testenv.UniqueName("key")
	replies, errs := together(hammerSize, func() (reply, error) { return send(ctx, http.MethodPost, endpoint, keyed(key), body) })
	hist := histogram(replies, errs)
	t.Logf("%d identical POST /orders with one key at once: statuses %v", hammerSize, hist)
	var first reply
	for i, r := range replies {
		switch {
		case errs[i] != nil:
			t.Errorf("request %d: %v", i, errs[i])
		case r.status == http.StatusAccepted && !r.replayed():
			first = r
		case r.status == http.StatusConflict:
			if r.header.Get("Retry-After") == "" {
				t.Errorf("409 without Retry-After")
			}
		case r.status != http.StatusAccepted:
			t.Errorf("request %d: status %d (%s); want only 202 and 409", i, r.status, r.body)
		}
	}
	if hist["202"] != 1 {
		t.Fatalf("statuses %v; want exactly one 202 that is not a replay", hist)
	}
	for _, r := range replies {
		if r.replayed() && (r.status != first.status || !bytes.Equal(r.body, first.body)) {
			t.Errorf("replay %d %s differs from the first response %d %s", r.status, r.body, first.status, first.body)
		}
	}
	var receipt orderReceipt
	if err := json.Unmarshal(first.body, &receipt); err != nil || receipt.OrderID != o.OrderID || receipt.Status != "accepted" ||
		!strings.HasPrefix(receipt.MessageID, apiIDPrefix+key+":") || first.header.Get("Content-Type") != "application/json" {
		t.Errorf("first response %s (%s), %v; want the order's receipt as application/json", first.body, first.header.Get("Content-Type"), err)
	}

	// A later retry: the first response, byte for byte, marked replayed.
	later, err := send(ctx, http.MethodPost, endpoint, keyed(key), body)
	if err != nil || later.status != first.status || !bytes.Equal(later.body, first.body) ||
		later.header.Get("Content-Type") != first.header.Get("Content-Type") || !later.replayed() {
		t.Errorf("retry: %d %q %s (replayed %v), %v; want %d %q %s replayed",
			later.status, later.header.Get("Content-Type"), later.body, later.replayed(), err,
			first.status, first.header.Get("Content-Type"), first.body)
	}
	// The key with another body: 422. No key: 400.
	other := bytes.Replace(body, []byte("4242"), []byte("4343"), 1)
	if r, err := send(ctx, http.MethodPost, endpoint, keyed(key), other); err != nil || r.status != http.StatusUnprocessableEntity {
		t.Errorf("same key, another body: %d, %v; want 422", r.status, err)
	}
	if r, err := send(ctx, http.MethodPost, endpoint, http.Header{"Content-Type": {"application/json"}}, body); err != nil || r.status != http.StatusBadRequest {
		t.Errorf("no key: %d, %v; want 400", r.status, err)
	}

	// Invalid orders: 400, recorded, so that a retry gets the same answer.
	for _, bad := range []string{
		`not json`,
		`{"order_id":"o","customer_id":"c","amount_cents":1.5}`,
		`{"order_id":"o","customer_id":"c","amount_cents":1,"coupon":"x"}`,
		`{"order_id":"o","customer_id":"c","amount_cents":1} {}`,
		`{"customer_id":"c","amount_cents":1}`,
		`{"order_id":"o","amount_cents":1}`,
		`{"order_id":"o","customer_id":"c"}`,
		`{"order_id":"o","customer_id":"c","amount_cents":0}`,
		`{"order_id":"o","customer_id":"c","amount_cents":-100}`,
	} {
		k := testenv.UniqueName("bad")
		r1, err1 := send(ctx, http.MethodPost, endpoint, keyed(k), []byte(bad))
		r2, err2 := send(ctx, http.MethodPost, endpoint, keyed(k), []byte(bad))
		if err1 != nil || err2 != nil || r1.status != http.StatusBadRequest || r1.header.Get("Content-Type") != "application/problem+json" ||
			r1.replayed() || r2.status != http.StatusBadRequest || !r2.replayed() || !bytes.Equal(r1.body, r2.body) {
			t.Errorf("%s: %d %s then %d %s (replayed %v), %v, %v; want 400 problem+json, then its replay",
				bad, r1.status, r1.body, r2.status, r2.body, r2.replayed(), err1, err2)
		}
	}

	// No secret configured: the webhook route refuses even a signed
	// delivery, with 503, and stores nothing.
	wid := testenv.UniqueName("msg")
	if r, err := send(ctx, http.MethodPost, base+webhookPath, signed(t, newWebhookSecret, wid, body, time.Now()), body); err != nil ||
		r.status != http.StatusServiceUnavailable {
		t.Errorf("webhook without a secret: %d, %v; want 503", r.status, err)
	}

	e.waitProcessed(ctx, 1, w)
	e.requireOneEffect(ctx, o, receipt.MessageID)
	// Only that one order went to the orders topic: no refused request,
	// no 409 and no replay enqueued anything.
	if n, err := e.count(ctx, `SELECT count(*) FROM outbox WHERE topic = $1`, e.topic); err != nil || n != 1 {
		t.Errorf("%d outbox rows for %s, %v; want 1", n, e.topic, err)
	}
	stopAll(t, w)
}

// TestOrdersCrash kills the worker (SIGKILL) while a POST /orders hangs at a
// test-only crash point (ONCELY_TEST_ORDERS_HALT), starts another, and
// retries the request with the same key: before the commit, the retry runs
// afresh (202); after it, the retry gets the committed response replayed.
// Either way the order has exactly one effect.
func TestOrdersCrash(t *testing.T) {
	t.Parallel()
	for _, point := range []string{testhalt.BeforeCommit, testhalt.AfterCommit} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			testOrdersCrash(t, point)
		})
	}
}

var haltRE = regexp.MustCompile(`msg="ONCELY_TEST: POST /orders halted" point=(\S+) key=(\S+)`)

func testOrdersCrash(t *testing.T, point string) {
	e := newEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	// The first worker's connections carry an application_name of their
	// own, to find its open transaction in pg_stat_activity.
	app := testenv.UniqueName("orderworker-crash")
	w1, base := e.startReady(ctx, "worker-1", []string{testhalt.Env + "=" + point, "DATABASE_URL=" + withAppName(t, e.db.URL, app)},
		"--instance-id", "crash-1")

	o, body := testOrder("crash")
	key := testenv.UniqueName("key")
	type result struct {
		r   reply
		err error
	}
	inFlight := make(chan result, 1)
	go func() {
		r, err := send(ctx, http.MethodPost, base+ordersPath, keyed(key), body)
		inFlight <- result{r, err}
	}()
	var first result
	if err := poll(ctx, 20*time.Second, 5*time.Millisecond, "the worker halted in POST /orders", func(context.Context) (bool, error) {
		select {
		case first = <-inFlight:
			return false, giveUp(fmt.Errorf("the request returned: %d %s, %v", first.r.status, first.r.body, first.err))
		default:
		}
		if err := alive(w1); err != nil {
			return false, err
		}
		m := w1.find(haltRE)
		return m != nil && m[1] == point && m[2] == key, nil
	}); err != nil {
		t.Fatal(err)
	}

	// Where the worker hangs, seen from the database.
	var stored reply
	switch point {
	case testhalt.BeforeCommit:
		// The handler's writes are in an open transaction, idle, waiting
		// for the halted worker: it has written (an xid is assigned: the
		// key row and the order in the outbox), and none of it is visible
		// here, uncommitted.
		if err := poll(ctx, 10*time.Second, 5*time.Millisecond, "the request's open transaction", func(ctx context.Context) (bool, error) {
			n, err := e.count(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE application_name = $1 AND state = 'idle in transaction' AND backend_xid IS NOT NULL`, app)
			return n == 1, err
		}); err != nil {
			t.Fatal(err)
		}
		if n, err := e.count(ctx, `SELECT count(*) FROM idempotency_keys WHERE key = $1`, key); err != nil || n != 0 {
			t.Fatalf("%d committed key rows, %v; want 0 before the commit", n, err)
		}
	case testhalt.AfterCommit:
		// Committed: the key row holds the response the client has not
		// received, and the order is in the outbox.
		if err := e.db.Pool.QueryRow(ctx, `SELECT status, body FROM idempotency_keys WHERE key = $1`, key).Scan(&stored.status, &stored.body); err != nil {
			t.Fatalf("the committed key row: %v", err)
		}
		if n, err := e.count(ctx, `SELECT count(*) FROM outbox WHERE topic = $1`, e.topic); err != nil || n != 1 || stored.status != http.StatusAccepted {
			t.Fatalf("committed: status %d, %d outbox rows, %v; want 202 and 1", stored.status, n, err)
		}
	}
	t.Logf("worker-1 halted %s; SIGKILL", point)
	w1.kill()
	select {
	case first = <-inFlight:
	case <-ctx.Done():
		t.Fatal("the request did not end with the worker")
	}
	if first.err == nil {
		t.Fatalf("the client got %d %s from a killed worker; want no response", first.r.status, first.r.body)
	}
	t.Logf("the client got no response: %v", first.err)

	// The retry, against a fresh worker. The old transaction's advisory
	// lock lasts until Postgres noticed the dead connection, so a 409 is
	// possible for a moment; the client retries it as Retry-After says.
	w2, base2 := e.startReady(ctx, "worker-2", nil, "--instance-id", "crash-1")
	var retry reply
	conflicts := 0
	if err := poll(ctx, 20*time.Second, 50*time.Millisecond, "an answer other than 409", func(ctx context.Context) (bool, error) {
		r, err := send(ctx, http.MethodPost, base2+ordersPath, keyed(key), body)
		if err != nil {
			return false, giveUp(err)
		}
		if r.status == http.StatusConflict {
			conflicts++
			return false, nil
		}
		retry = r
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("retry: %s %s (after %d 409s)", retry.label(), retry.body, conflicts)
	var receipt orderReceipt
	if err := json.Unmarshal(retry.body, &receipt); err != nil || retry.status != http.StatusAccepted || receipt.OrderID != o.OrderID {
		t.Fatalf("retry: %d %s, %v; want 202 with the order's receipt", retry.status, retry.body, err)
	}
	switch point {
	case testhalt.BeforeCommit: // nothing was committed: a fresh run
		if retry.replayed() {
			t.Error("the retry was replayed, but nothing had committed")
		}
	case testhalt.AfterCommit: // the committed response, which the client never got
		if !retry.replayed() || !bytes.Equal(retry.body, stored.body) {
			t.Errorf("retry %s (replayed %v); want the committed response %s replayed", retry.body, retry.replayed(), stored.body)
		}
	}

	e.waitProcessed(ctx, 1, w2)
	e.requireOneEffect(ctx, o, receipt.MessageID)
	stopAll(t, w2)
}

// withAppName returns the database URL (or keyword/value string) with an
// application_name.
func withAppName(t *testing.T, dsn, app string) string {
	t.Helper()
	if !strings.Contains(dsn, "://") {
		return dsn + " application_name=" + app
	}
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	return u.String()
}
