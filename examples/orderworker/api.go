package main

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/examples/orderworker/internal/testhalt"
	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook"
)

// The worker's HTTP routes for orders. Both store the order in oncely's
// outbox, for the orders topic, and answer 202 only after that transaction
// committed; the relay publishes it and the consumer applies it like any
// other record, so each order has exactly one effect however often the
// request is repeated.
const (
	webhookPath = "/webhooks/orders"
	ordersPath  = "/orders"

	// apiIDPrefix starts the message id of an order from POST /orders,
	// keeping it apart from webhook ids (which are the sender's webhook-id,
	// unprefixed) in the consumer's inbox.
	apiIDPrefix = "order-api:"
)

// httpAPI is POST /webhooks/orders and POST /orders.
type httpAPI struct {
	webhook  http.Handler            // the receiver, or a 503 when no secret is configured
	receiver *webhook.Receiver       // nil when no secret is configured
	keys     *idempotency.Middleware // behind POST /orders; its cleanup loop runs in the worker
	orders   http.Handler            // keys.Require(the handler)
}

// newHTTPAPI builds the routes on r's schema and pool. Nothing here touches
// the database: the tables exist once the worker's migrations ran, and the
// routes answer 503 until then (see register).
func newHTTPAPI(cfg workerConfig, r *oncely.Runner, log *slog.Logger) (*httpAPI, error) {
	a := &httpAPI{}
	if len(cfg.WebhookSecrets) == 0 {
		// 503 rather than 404: a provider keeps retrying a 5xx, so the
		// deliveries it sends before the secret is configured are not
		// lost, and the answer says what is missing. Unsigned deliveries
		// are never accepted.
		log.Warn("orderworker: no --webhook-secret (WEBHOOK_SECRET): POST " + webhookPath + " answers 503")
		a.webhook = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "orderworker: no webhook secret is configured (--webhook-secret, WEBHOOK_SECRET); deliveries are refused until one is",
				http.StatusServiceUnavailable)
		})
	} else {
		v, err := webhook.NewStandardWebhooks(webhook.VerifierConfig{Secrets: cfg.WebhookSecrets})
		if err != nil {
			return nil, err
		}
		// The receiver checks the method (405), the size (413, 1 MiB)
		// before the signature (401), then stores the raw body under
		// the webhook-id as message id and answers 202 after the commit.
		if a.receiver, err = r.Webhook(webhook.Config{Topic: cfg.Topic, Verifier: v, Key: webhookKey}); err != nil {
			return nil, err
		}
		a.webhook = a.receiver
	}
	// The runner runs the middleware's cleanup of expired keys.
	var err error
	if a.keys, err = r.Idempotency(idempotency.Config{}); err != nil {
		return nil, err
	}
	a.orders = nameClient(testhalt.Wrap(cfg.testHalt, a.keys.Require, &ordersHandler{outbox: r.Outbox(), topic: cfg.Topic, log: log}, log))
	return a, nil
}

// register adds the routes to mux. Until ready reports true (the worker's
// migrations ran), they answer 503 with Retry-After.
func (a *httpAPI) register(mux *http.ServeMux, ready func() bool) {
	gate := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !ready() {
				w.Header().Set("Retry-After", "1")
				http.Error(w, "orderworker: starting (migrations pending); retry later", http.StatusServiceUnavailable)
				return
			}
			h.ServeHTTP(w, r)
		})
	}
	mux.Handle(webhookPath, gate(a.webhook)) // the receiver answers other methods 405 itself
	mux.Handle("POST "+ordersPath, gate(a.orders))
}

// nameClient names the client of a POST /orders, whose Idempotency-Keys
// are its own (idempotency.WithClient; two clients may pick the same key).
// This example has no authentication, so the client is the X-Client-Id
// header, or "anonymous"; a real service names the principal its
// authentication middleware verified (an account or API-key id).
func nameClient(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		client := cmp.Or(r.Header.Get("X-Client-Id"), "anonymous")
		next.ServeHTTP(w, r.WithContext(idempotency.WithClient(r.Context(), client)))
	})
}

// webhookKey is the Kafka key of a webhook delivery: the order's customer,
// as for the produce command, so that one customer's orders stay in order.
// It runs after the signature was verified. A body that is no order gets no
// key; the consumer dead-letters it.
func webhookKey(_ webhook.Delivery, body []byte) []byte {
	var o struct {
		CustomerID string `json:"customer_id"`
	}
	if json.Unmarshal(body, &o) != nil || o.CustomerID == "" {
		return nil
	}
	return []byte(o.CustomerID)
}

// ordersHandler is POST /orders behind the idempotency middleware: the
// request's transaction (idempotency.Tx) is already open, and commits with
// the response this handler writes, after it returns.
type ordersHandler struct {
	outbox *outbox.Outbox
	topic  string
	log    *slog.Logger
}

// orderReceipt is the body of POST /orders' 202.
type orderReceipt struct {
	OrderID   string `json:"order_id"`
	Status    string `json:"status"`     // "accepted"
	MessageID string `json:"message_id"` // the record's message-id on the orders topic
}

func (h *ordersHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	tx, ok := idempotency.Tx(ctx)
	client, key, _ := idempotency.Key(ctx)
	if !ok { // cannot happen behind Require, which refuses requests without a key
		writeProblem(w, http.StatusInternalServerError, "the request has no idempotency transaction")
		return
	}
	body, err := io.ReadAll(r.Body) // bounded and buffered by the middleware
	if err != nil {
		writeProblem(w, http.StatusBadRequest, "could not read the request body")
		return
	}
	// A 400 is recorded like a 202: a retry with the key gets it back.
	o, err := decodeOrder(body)
	if err != nil {
		writeProblem(w, http.StatusBadRequest, err.Error())
		return
	}
	value, err := json.Marshal(o)
	if err != nil {
		writeProblem(w, http.StatusInternalServerError, "could not encode the order")
		return
	}
	id := apiMessageID(client, key, value)
	out, err := h.outbox.Enqueue(ctx, tx, outbox.Message{
		ID:      id,
		Topic:   h.topic,
		Key:     []byte(o.CustomerID), // as the produce command keys orders
		Value:   value,
		Headers: []outbox.Header{{Key: "content-type", Value: []byte("application/json")}},
	})
	if err != nil {
		// A 5xx is not recorded: the middleware rolls the transaction
		// back, and a retry with the key runs afresh.
		h.log.ErrorContext(ctx, "orderworker: POST /orders: enqueue failed", "order_id", o.OrderID, "err", err)
		w.Header().Set("Retry-After", "1")
		writeProblem(w, http.StatusServiceUnavailable, "the order could not be stored; retry with the same Idempotency-Key")
		return
	}
	if out[0].Duplicate {
		// The same order under the same key, whose key row expired
		// while its outbox row remains: it was accepted before, and
		// the consumer's inbox dedups any republish.
		h.log.InfoContext(ctx, "orderworker: POST /orders: order already in the outbox", "order_id", o.OrderID, "message_id", id)
	}
	writeJSON(w, http.StatusAccepted, orderReceipt{OrderID: o.OrderID, Status: "accepted", MessageID: id})
}

// apiMessageID is the message id of an order from POST /orders: the
// Idempotency-Key and a hash of the client and the order. It is the same on
// every run of a request with that key (a fresh run after a crash that
// rolled the first one back publishes the same id, so the consumer's inbox
// would dedup even a second enqueue). The client keeps two clients' equal
// keys apart, as the middleware does; the order keeps a key that is reused
// for another order once its row expired (after the middleware's TTL) from
// mapping to an id the inbox still holds, which would accept the order and
// then skip it.
func apiMessageID(client, key string, value []byte) string {
	h := sha256.New()
	h.Write([]byte(client))
	h.Write([]byte{0})
	h.Write(value)
	return apiIDPrefix + key + ":" + hex.EncodeToString(h.Sum(nil)[:8])
}

// decodeOrder reads an order as the consumer does (unknown fields are an
// error; so is anything after the object) and validates it.
func decodeOrder(body []byte) (Order, error) {
	var o Order
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&o); err != nil {
		return o, fmt.Errorf("the body is not an order: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return o, errors.New("the body is not an order: data after the JSON object")
	}
	return o, o.validate()
}

// writeJSON writes v as the JSON response.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeProblem(w, http.StatusInternalServerError, "could not encode the response")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b) // into the middleware's buffer, sent after the commit
}

// writeProblem writes an RFC 9457 problem details response, the format the
// idempotency middleware uses for its own refusals.
func writeProblem(w http.ResponseWriter, status int, detail string) {
	b, _ := json.Marshal(struct { // cannot fail: strings and an int
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}{"about:blank", http.StatusText(status), status, detail})
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}
