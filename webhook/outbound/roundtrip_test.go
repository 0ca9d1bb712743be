package outbound

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook"
)

// TestRoundTripWithInboundReceiver sends deliveries to oncely's own inbound
// receiver (package webhook) configured with the Standard Webhooks verifier:
// the signatures verify (the subscription signs with an old and a new secret
// during a rotation, the receiver knows only the new one), and when the
// receiver's answer is lost after it stored a delivery, the retry carries the
// same webhook-id and the receiver recognises it as a duplicate.
func TestRoundTripWithInboundReceiver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	oldSecret, err := NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	newSecret, err := NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	verifier, err := webhook.NewStandardWebhooks(webhook.VerifierConfig{Secrets: []string{newSecret}})
	if err != nil {
		t.Fatal(err)
	}
	rc, err := webhook.New(webhook.Config{
		Pool: e.db.Pool, Outbox: outbox.Config{Schema: e.db.Schema}, Topic: "inbound", Verifier: verifier,
	})
	if err != nil {
		t.Fatal(err)
	}
	ep := newEndpoint(t, func(r request, w http.ResponseWriter, req *http.Request) {
		req.Body = io.NopCloser(bytes.NewReader(r.body)) // the recorder read it
		if r.attempt == 1 && strings.Contains(string(r.body), "lost-answer") {
			// The receiver stores the delivery, but its answer never
			// reaches the sender.
			rc.ServeHTTP(httptest.NewRecorder(), req)
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		rc.ServeHTTP(w, req)
	})
	e.subscribe(t, Subscription{URL: ep.URL(), Secrets: []string{oldSecret, newSecret}, EventTypes: []string{"t"}})
	enq := e.enqueue(t,
		Event{ID: "a", Type: "t", Payload: []byte(`{"k":"a"}`)},
		Event{ID: "b", Type: "t", Payload: []byte(`{"k":"b"}`)},
		Event{ID: "lost", Type: "t", Payload: []byte(`{"k":"lost-answer"}`)},
	)
	run(t, newDispatcher(t, e.fastConfig()))
	pgtest.WaitFor(t, e.ctx, "all deliveries", func() bool { return e.count(t, "status = 'delivered'") == len(enq) })

	st := rc.Stats()
	if st.Stored != 3 || st.Duplicates != 1 || st.Refused != 0 {
		t.Errorf("receiver stats %+v, want 3 stored, 1 duplicate, none refused", st)
	}
	for _, q := range enq {
		var n int
		err := e.db.Pool.QueryRow(e.ctx, `SELECT count(*) FROM `+sqlident.Table(e.db.Schema, "outbox")+
			` WHERE message_id = $1`, q.WebhookID).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Errorf("%s: %d outbox rows on the receiving side, want exactly 1", q.WebhookID, n)
		}
	}
	lost := byWebhookID(ep.requests())[enq[2].WebhookID]
	if len(lost) != 2 || lost[1].attempt != 2 {
		t.Errorf("the lost answer's delivery got %d requests, want attempts 1 and 2", len(lost))
	}

	// A tampered body is refused by the receiver: a terminal 401.
	tampered := newEndpoint(t, func(r request, w http.ResponseWriter, req *http.Request) {
		body := bytes.Clone(r.body)
		body[0] ^= 1 // same length, one bit changed
		req.Body = io.NopCloser(bytes.NewReader(body))
		rc.ServeHTTP(w, req)
	})
	sub := e.subscribe(t, Subscription{URL: tampered.URL(), Secrets: []string{newSecret}, EventTypes: []string{"tamper"}})
	badOnes := e.enqueue(t, Event{ID: "c", Type: "tamper", Payload: []byte(`{}`)})
	if len(badOnes) != 1 || badOnes[0].SubscriptionID != sub.ID {
		t.Fatalf("tamper event enqueued as %+v, want one delivery to the tampering endpoint", badOnes)
	}
	bad := badOnes[0]
	pgtest.WaitFor(t, e.ctx, "the refused delivery", func() bool { return e.delivery(t, bad.WebhookID).Status == StatusDead })
	if d := e.delivery(t, bad.WebhookID); d.LastStatus != http.StatusUnauthorized || d.SubscriptionID != sub.ID {
		t.Errorf("tampered delivery: %+v, want dead with 401", d)
	}
}
