package webhook

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/internal/telemetry"
	"github.com/oncely/oncely/outbox"
)

// Defaults of Config.
const (
	DefaultMaxBodyBytes = 1 << 20
	DefaultStoreTimeout = 5 * time.Second
)

// Record headers the Receiver sets on every enqueued delivery, besides the
// outbox's message-id (the delivery id).
const (
	HeaderProvider    = "webhook-provider"     // Delivery.Provider
	HeaderEventType   = "webhook-event-type"   // Delivery.EventType, when known
	HeaderTimestamp   = "webhook-timestamp"    // Delivery.Timestamp in unix seconds, when the scheme has one
	HeaderContentType = "webhook-content-type" // the request's Content-Type, when it had one
)

// Config configures a Receiver.
type Config struct {
	// Pool runs the transaction that stores each delivery. Required.
	Pool *pgxpool.Pool
	// Outbox is the outbox's schema and shard layout; it must match the
	// relay's. Defaults as in outbox.Config.
	Outbox outbox.Config
	// Topic is the Kafka topic deliveries are published to. Required.
	Topic string
	// Verifier authenticates requests. Required.
	Verifier Verifier
	// IDPrefix is put before the delivery id to form the message id. Leave
	// it empty unless several providers or endpoints whose delivery ids
	// might collide share one outbox and consumer group.
	IDPrefix string
	// Key returns the record's Kafka key (deliveries with equal keys are
	// published in commit order). Optional: without it, records have no key.
	Key func(d Delivery, body []byte) []byte
	// MaxBodyBytes bounds the request body; a longer one is answered 413.
	// Default DefaultMaxBodyBytes (1 MiB).
	MaxBodyBytes int64
	// StoreTimeout bounds the transaction that stores a delivery; when it
	// passes, the request is answered 503. Keep it below the provider's own
	// timeout (GitHub: 10s). Default DefaultStoreTimeout.
	StoreTimeout time.Duration
	// Logger receives a line per refusal and failure. Default: discard.
	Logger *slog.Logger
	// TracerProvider and MeterProvider instrument the receiver: a
	// SpanReceive span per request, with its outcome, and the
	// MetricInboundRequests and MetricInboundDuration metrics. Default: the
	// global providers.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
}

// Kafka's rule for topic names.
var topicRE = regexp.MustCompile(`^[a-zA-Z0-9._-]{1,249}$`)

func (c *Config) validate() error {
	switch {
	case c.Pool == nil:
		return errors.New("webhook: Config.Pool: a *pgxpool.Pool is required")
	case c.Topic == "":
		return errors.New("webhook: Config.Topic is required")
	case !topicRE.MatchString(c.Topic) || c.Topic == "." || c.Topic == "..":
		return fmt.Errorf("webhook: Config.Topic: %q is not a valid Kafka topic name", c.Topic)
	case c.Verifier == nil:
		return errors.New("webhook: Config.Verifier is required (NewStandardWebhooks, NewStripe, NewGitHub or your own)")
	case c.MaxBodyBytes < 0:
		return fmt.Errorf("webhook: Config.MaxBodyBytes: %d is negative", c.MaxBodyBytes)
	case c.StoreTimeout < 0:
		return fmt.Errorf("webhook: Config.StoreTimeout: %s is negative", c.StoreTimeout)
	case len(c.IDPrefix) >= outbox.MaxIDLen:
		return fmt.Errorf("webhook: Config.IDPrefix: %d bytes leave no room for an id within outbox.MaxIDLen (%d)", len(c.IDPrefix), outbox.MaxIDLen)
	}
	return nil
}

// Receiver is the http.Handler of one webhook endpoint. See the package
// documentation for what it guarantees.
type Receiver struct {
	cfg    Config
	outbox *outbox.Outbox
	tel    *telemetry.Requests
	gate   gate

	stored, duplicates, failed atomic.Int64
}

// New returns a Receiver.
func New(cfg Config) (*Receiver, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	ob, err := outbox.New(cfg.Outbox)
	if err != nil {
		return nil, fmt.Errorf("webhook: Config.Outbox: %w", err)
	}
	cfg.MaxBodyBytes = cmp.Or(cfg.MaxBodyBytes, DefaultMaxBodyBytes)
	cfg.StoreTimeout = cmp.Or(cfg.StoreTimeout, DefaultStoreTimeout)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	tel, err := newInstruments(cfg.TracerProvider, cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	rc := &Receiver{cfg: cfg, outbox: ob, tel: tel}
	rc.gate = gate{verifier: cfg.Verifier, idPrefix: cfg.IDPrefix, maxID: outbox.MaxIDLen, maxBody: cfg.MaxBodyBytes, logger: cfg.Logger}
	return rc, nil
}

// Stats are a Receiver's counters since it was created.
type Stats struct {
	Stored     int64 // deliveries committed to the outbox, answered 202
	Duplicates int64 // deliveries whose id was already in the outbox: nothing stored, answered 202
	Refused    int64 // requests refused before storing (405, 413, 401, 400 or a verifier's own status)
	Failed     int64 // requests answered 503 because the delivery could not be stored
}

// Stats returns the counters.
func (rc *Receiver) Stats() Stats {
	return Stats{Stored: rc.stored.Load(), Duplicates: rc.duplicates.Load(), Refused: rc.gate.refused.Load(), Failed: rc.failed.Load()}
}

// ServeHTTP checks, in order, the method (405), the body size (413), the
// signature and timestamp (401, or the verifier's status), then stores the
// delivery and answers 202 after the commit, or 503 if it cannot be stored.
func (rc *Receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	ctx, span := rc.tel.Start(r.Context(), SpanReceive, telemetry.HTTPRequestMethod.String(r.Method), telemetry.MessagingDestination.String(rc.cfg.Topic))
	it := rc.serve(w, r.WithContext(ctx))
	attrs, spanAttrs := it.attributes(rc.cfg.Topic)
	rc.tel.End(ctx, span, start, attrs, spanAttrs, it.err, "store")
}

func (rc *Receiver) serve(w http.ResponseWriter, r *http.Request) intake {
	d, body, id, refused := rc.gate.admit(w, r)
	if refused != nil {
		return *refused
	}
	duplicate, err := rc.store(r.Context(), id, d, body, r.Header.Get("Content-Type"))
	if err != nil {
		rc.failed.Add(1)
		rc.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "webhook: delivery not stored; answering 503 so that the provider retries",
			slog.String("delivery_id", d.ID), slog.String("provider", d.Provider), slog.Any("error", err))
		w.Header().Set("Retry-After", "5")
		http.Error(w, "webhook: the delivery could not be stored; retry later", http.StatusServiceUnavailable)
		return intake{outcome: OutcomeFailed, status: http.StatusServiceUnavailable, delivery: d, messageID: id, err: err}
	}
	outcome := OutcomeAccepted
	if duplicate {
		rc.duplicates.Add(1)
		outcome = OutcomeDuplicate
	} else {
		rc.stored.Add(1)
	}
	rc.cfg.Logger.LogAttrs(r.Context(), slog.LevelDebug, "webhook: delivery accepted",
		slog.String("delivery_id", d.ID), slog.String("provider", d.Provider), slog.Bool("duplicate", duplicate))
	w.WriteHeader(http.StatusAccepted)
	return intake{outcome: outcome, status: http.StatusAccepted, delivery: d, messageID: id}
}

// store enqueues the delivery in a transaction of its own and reports
// whether its id was already in the outbox. It returns nil only after the
// commit succeeded.
func (rc *Receiver) store(ctx context.Context, id string, d Delivery, body []byte, contentType string) (duplicate bool, err error) {
	msg := outbox.Message{ID: id, Topic: rc.cfg.Topic, Value: body,
		Headers: []outbox.Header{{Key: HeaderProvider, Value: []byte(d.Provider)}}}
	if d.EventType != "" {
		msg.Headers = append(msg.Headers, outbox.Header{Key: HeaderEventType, Value: []byte(d.EventType)})
	}
	if !d.Timestamp.IsZero() {
		msg.Headers = append(msg.Headers, outbox.Header{Key: HeaderTimestamp, Value: strconv.AppendInt(nil, d.Timestamp.Unix(), 10)})
	}
	if contentType != "" {
		msg.Headers = append(msg.Headers, outbox.Header{Key: HeaderContentType, Value: []byte(contentType)})
	}
	if rc.cfg.Key != nil {
		msg.Key = rc.cfg.Key(d, body)
	}
	ctx, cancel := context.WithTimeout(ctx, rc.cfg.StoreTimeout)
	defer cancel()
	err = pgx.BeginFunc(ctx, rc.cfg.Pool, func(tx pgx.Tx) error {
		out, err := rc.outbox.Enqueue(ctx, tx, msg)
		if err != nil {
			return err
		}
		duplicate = out[0].Duplicate
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("webhook: store delivery %q: %w", id, err)
	}
	return duplicate, nil
}

// reasons are the refusals whose fixed text a response may carry: they name
// what failed, never a value of the request, a count of secrets or the
// clock skew.
var reasons = []error{ErrMissingSignature, ErrMalformedHeader, ErrSignatureMismatch, ErrTimestamp, ErrNoDeliveryID}

// refusalBody is the terse body of a refused verification: the reason
// alone, or "refused" for a verifier's own error, whose text may quote the
// request. The details go to the log.
func refusalBody(err error) string {
	for _, reason := range reasons {
		if errors.Is(err, reason) {
			return "webhook: " + reason.Error()
		}
	}
	return "webhook: refused"
}
