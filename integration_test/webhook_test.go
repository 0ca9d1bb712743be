package integration_test

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook"
)

// webhookSecret is the endpoint's Standard Webhooks secret: whsec_ and the
// base64 of a 32-byte key.
const webhookSecret = "whsec_c2VjcmV0LWtleS1vZi0zMi1ieXRlcy1mb3ItdGVzdHM="

// webhookReceiver serves a Receiver for the env's outbox and topic (its
// Standard Webhooks verifier knows webhookSecret), storing through pool.
func (e *env) webhookReceiver(t *testing.T, pool *pgxpool.Pool, mutate func(*webhook.Config)) (*webhook.Receiver, *httptest.Server) {
	t.Helper()
	v, err := webhook.NewStandardWebhooks(webhook.VerifierConfig{Secrets: []string{webhookSecret}})
	if err != nil {
		t.Fatal(err)
	}
	cfg := webhook.Config{Pool: pool, Outbox: outbox.Config{Schema: e.db.Schema, Shards: 16}, Topic: e.topic, Verifier: v}
	if mutate != nil {
		mutate(&cfg)
	}
	rc, err := webhook.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(rc)
	t.Cleanup(srv.Close)
	return rc, srv
}

// webhookDelivery is a Standard Webhooks delivery as a provider sends it:
// signed per the specification, written out here with crypto/hmac.
type webhookDelivery struct {
	id, ts, sig string
	body        []byte
}

func signWebhook(t *testing.T, secret, id string, body []byte, at time.Time) webhookDelivery {
	t.Helper()
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		t.Fatal(err)
	}
	ts := strconv.FormatInt(at.Unix(), 10)
	m := hmac.New(sha256.New, key)
	m.Write([]byte(id + "." + ts + "."))
	m.Write(body)
	return webhookDelivery{id: id, ts: ts, body: body, sig: "v1," + base64.StdEncoding.EncodeToString(m.Sum(nil))}
}

// post sends the delivery and returns the response's status and header.
func (d webhookDelivery) post(t *testing.T, method, url string, signed bool) (int, http.Header) {
	t.Helper()
	r, err := http.NewRequestWithContext(context.Background(), method, url, bytes.NewReader(d.body))
	if err != nil {
		t.Error(err)
		return 0, nil
	}
	r.Header.Set("Content-Type", "application/json")
	if signed {
		r.Header.Set("webhook-id", d.id)
		r.Header.Set("webhook-timestamp", d.ts)
		r.Header.Set("webhook-signature", d.sig)
	}
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Error(err) // callable from any goroutine
		return 0, nil
	}
	defer func() { _ = resp.Body.Close() }()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, resp.Header
}

func (e *env) outboxRows(t *testing.T) int64 {
	t.Helper()
	return e.count(t, `SELECT count(*) FROM outbox`)
}

// The hammer: 25 identical deliveries at once are all acknowledged, store
// one outbox row, and apply one effect downstream. A provider's retry after
// that is acknowledged without a second row; one after the outbox's
// retention removed the row is published again and the inbox skips it.
func TestWebhookHammerAppliesOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	rc, srv := e.webhookReceiver(t, e.db.Pool, nil)
	d := signWebhook(t, webhookSecret, testenv.UniqueName("msg"), []byte(`{"order_id":"o-1","amount":1500}`), time.Now())

	const n = 25
	statuses := make([]int, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			statuses[i], _ = d.post(t, http.MethodPost, srv.URL, true)
		}()
	}
	close(start)
	wg.Wait()
	for i, s := range statuses {
		if s != http.StatusAccepted {
			t.Errorf("delivery %d: status %d, want 202", i, s)
		}
	}
	if st := rc.Stats(); st != (webhook.Stats{Stored: 1, Duplicates: n - 1}) {
		t.Errorf("receiver stats %+v, want 1 stored and %d duplicates", st, n-1)
	}
	if rows := e.outboxRows(t); rows != 1 {
		t.Fatalf("%d outbox rows, want 1", rows)
	}

	relay, _ := e.startRelay(ctx, t, nil)
	c := e.start(ctx, e.config("a", recordEffect("a")))
	eventually(t, time.Minute, "the delivery processed", func() bool { return c.c.Stats().Processed == 1 })
	e.assertExactlyOnce(t, 1)
	if got := e.count(t, `SELECT count(*) FROM effects WHERE message_id = $1`, d.id); got != 1 {
		t.Errorf("the effect's message id is not the webhook-id %s", d.id)
	}
	recs := e.readTopic(t, e.topic, func(r []*kgo.Record) bool { return len(r) >= 1 })
	if r := recs[0]; !bytes.Equal(r.Value, d.body) || header(r, outbox.MessageIDHeader) != d.id ||
		header(r, webhook.HeaderProvider) != webhook.ProviderStandardWebhooks || header(r, webhook.HeaderTimestamp) != d.ts ||
		header(r, webhook.HeaderContentType) != "application/json" {
		t.Errorf("published record: value %q, headers %v", r.Value, r.Headers)
	}

	// A late retry: the row is sent but still in the outbox.
	eventually(t, 10*time.Second, "the row marked sent", func() bool { return relay.Stats().Published == 1 })
	if s, _ := d.post(t, http.MethodPost, srv.URL, true); s != http.StatusAccepted || rc.Stats().Duplicates != n || e.outboxRows(t) != 1 {
		t.Fatalf("retry after publishing: status %d, stats %+v, %d rows; want 202, a duplicate, 1 row", s, rc.Stats(), e.outboxRows(t))
	}

	// A retry after retention removed the sent row: stored and published
	// again, and the consumer's inbox skips it.
	if n, err := e.outbox(t).DeleteSent(ctx, e.db.Pool, 0, 100); err != nil || n != 1 {
		t.Fatalf("retention: deleted %d, %v; want 1", n, err)
	}
	if s, _ := d.post(t, http.MethodPost, srv.URL, true); s != http.StatusAccepted || rc.Stats().Stored != 2 {
		t.Fatalf("retry after retention: status %d, stats %+v; want 202 and stored again", s, rc.Stats())
	}
	eventually(t, time.Minute, "the republished delivery skipped as a duplicate", func() bool { return c.c.Stats().Duplicates == 1 })
	e.assertExactlyOnce(t, 1)
}

// Every refusal has its status and leaves nothing behind: no outbox row, no
// effect. A valid delivery afterwards is stored and applied, so the zeros
// mean something.
func TestWebhookRefusalsHaveNoSideEffect(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	rc, srv := e.webhookReceiver(t, e.db.Pool, nil)
	e.startRelay(ctx, t, nil)
	c := e.start(ctx, e.config("a", recordEffect("a")))

	now := time.Now()
	body := []byte(`{"order_id":"o-2"}`)
	big := bytes.Repeat([]byte("x"), webhook.DefaultMaxBodyBytes+1)
	tampered := signWebhook(t, webhookSecret, "msg_tampered", body, now)
	tampered.body = []byte(`{"order_id":"o-3"}`)
	noSig := signWebhook(t, webhookSecret, "msg_nosig", body, now)
	noSig.sig = ""
	cases := []struct {
		name   string
		d      webhookDelivery
		method string
		signed bool
		status int
	}{
		{"wrong secret", signWebhook(t, "whsec_b3RoZXItc2VjcmV0LW5vYm9keS1jb25maWd1cmVk", "msg_wrong", body, now), http.MethodPost, true, http.StatusUnauthorized},
		{"tampered body", tampered, http.MethodPost, true, http.StatusUnauthorized},
		{"missing signature", noSig, http.MethodPost, true, http.StatusUnauthorized},
		{"no headers at all", signWebhook(t, webhookSecret, "msg_bare", body, now), http.MethodPost, false, http.StatusUnauthorized},
		{"stale timestamp", signWebhook(t, webhookSecret, "msg_stale", body, now.Add(-webhook.DefaultTolerance-time.Minute)), http.MethodPost, true, http.StatusUnauthorized},
		{"future timestamp", signWebhook(t, webhookSecret, "msg_future", body, now.Add(webhook.DefaultTolerance+time.Minute)), http.MethodPost, true, http.StatusUnauthorized},
		{"oversized, signed", signWebhook(t, webhookSecret, "msg_big", big, now), http.MethodPost, true, http.StatusRequestEntityTooLarge},
		{"oversized, unsigned", signWebhook(t, webhookSecret, "msg_big2", big, now), http.MethodPost, false, http.StatusRequestEntityTooLarge},
		{"GET", signWebhook(t, webhookSecret, "msg_get", nil, now), http.MethodGet, true, http.StatusMethodNotAllowed},
	}
	for i, tc := range cases {
		status, h := tc.d.post(t, tc.method, srv.URL, tc.signed)
		if status != tc.status {
			t.Errorf("%s: status %d, want %d", tc.name, status, tc.status)
		}
		if tc.status == http.StatusMethodNotAllowed && h.Get("Allow") != http.MethodPost {
			t.Errorf("%s: Allow %q, want POST", tc.name, h.Get("Allow"))
		}
		if rows := e.outboxRows(t); rows != 0 {
			t.Fatalf("%s: %d outbox rows after a refusal", tc.name, rows)
		}
		if st := rc.Stats(); st != (webhook.Stats{Refused: int64(i + 1)}) {
			t.Errorf("%s: stats %+v", tc.name, st)
		}
	}

	valid := signWebhook(t, webhookSecret, "msg_valid", body, now)
	if s, _ := valid.post(t, http.MethodPost, srv.URL, true); s != http.StatusAccepted {
		t.Fatalf("the valid delivery: status %d", s)
	}
	eventually(t, time.Minute, "the valid delivery processed", func() bool { return c.c.Stats().Processed == 1 })
	e.assertExactlyOnce(t, 1)
	if got := e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'msg_valid'`); got != 1 {
		t.Error("the one effect is not the valid delivery's")
	}
}

// When the delivery cannot be committed the answer is 503, never 2xx, and
// nothing is stored; the provider's retry succeeds once the database is
// back. Three ways to fail: nothing listens at the database's address, the
// pool is closed, and (the subtle one) every statement succeeds but COMMIT
// fails.
func TestWebhookDatabaseUnavailable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	d := signWebhook(t, webhookSecret, "msg_db", []byte(`{"order_id":"o-4"}`), time.Now())
	want503 := func(what string, rc *webhook.Receiver, srv *httptest.Server) {
		t.Helper()
		status, h := d.post(t, http.MethodPost, srv.URL, true)
		if status != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
			t.Errorf("%s: status %d, Retry-After %q; want 503 with Retry-After", what, status, h.Get("Retry-After"))
		}
		if st := rc.Stats(); st != (webhook.Stats{Failed: 1}) {
			t.Errorf("%s: stats %+v, want one failure", what, st)
		}
		if rows := e.outboxRows(t); rows != 0 {
			t.Fatalf("%s: %d outbox rows", what, rows)
		}
	}

	// Nothing listens where the pool connects.
	l, err := (&net.ListenConfig{}).Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(e.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = l.Addr().String()
	_ = l.Close()
	unreachable, err := testenv.NewPool(ctx, u.String(), e.db.Schema, 4)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(unreachable.Close)
	rc, srv := e.webhookReceiver(t, unreachable, nil)
	want503("unreachable database", rc, srv)

	// A closed pool.
	closed, err := testenv.NewPool(ctx, e.db.URL, e.db.Schema, 4)
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	rc, srv = e.webhookReceiver(t, closed, nil)
	want503("closed pool", rc, srv)

	// The enqueue succeeds, the commit fails: a deferred constraint trigger
	// raises at COMMIT. A receiver that answered before committing, or that
	// ignored the commit's error, would answer 202 here.
	if _, err := e.db.Pool.Exec(ctx, `
		CREATE FUNCTION refuse_commit() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'test: commit refused'; END $$;
		CREATE CONSTRAINT TRIGGER refuse_commit AFTER INSERT ON outbox
			DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_commit()`); err != nil {
		t.Fatal(err)
	}
	rc, srv = e.webhookReceiver(t, e.db.Pool, nil)
	want503("commit refused", rc, srv)

	// The database is back: the provider's retry is stored and acknowledged.
	if _, err := e.db.Pool.Exec(ctx, `DROP TRIGGER refuse_commit ON outbox`); err != nil {
		t.Fatal(err)
	}
	if s, _ := d.post(t, http.MethodPost, srv.URL, true); s != http.StatusAccepted || e.outboxRows(t) != 1 {
		t.Fatalf("retry after recovery: status %d, %d rows; want 202 and 1 row", s, e.outboxRows(t))
	}
}

// A delivery that arrives while another transaction holds an uncommitted
// row with its id waits for that transaction instead of being acknowledged
// as a duplicate; when that transaction rolls back, the delivery is stored
// itself. (An ack on the strength of a row that then vanished would lose
// the delivery.)
func TestWebhookDuplicateWaitsForTheFirstCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	rc, srv := e.webhookReceiver(t, e.db.Pool, nil)
	d := signWebhook(t, webhookSecret, "msg_race", []byte(`{"order_id":"o-5"}`), time.Now())

	first, err := e.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Rollback(ctx)
	if _, err := e.outbox(t).Enqueue(ctx, first, outbox.Message{ID: d.id, Topic: e.topic, Value: []byte("first")}); err != nil {
		t.Fatal(err)
	}
	var pid int
	if err := first.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}

	answered := make(chan int, 1)
	go func() { s, _ := d.post(t, http.MethodPost, srv.URL, true); answered <- s }()
	eventually(t, 30*time.Second, "the delivery to wait on the first transaction", func() bool {
		return e.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))`, pid) == 1
	})
	select {
	case s := <-answered:
		t.Fatalf("answered %d while the first transaction was still open", s)
	default:
	}
	if err := first.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-answered:
		if s != http.StatusAccepted {
			t.Fatalf("status %d, want 202", s)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no answer after the first transaction rolled back")
	}
	if st := rc.Stats(); st != (webhook.Stats{Stored: 1}) {
		t.Errorf("stats %+v, want the delivery stored by the receiver", st)
	}
	var value []byte
	if err := e.db.Pool.QueryRow(ctx, `SELECT value FROM outbox WHERE message_id = $1`, d.id).Scan(&value); err != nil || !bytes.Equal(value, d.body) {
		t.Fatalf("outbox row: %q, %v; want the delivery's body", value, err)
	}
}
