package natsconsumer

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/outbox"
)

// HeaderKey carries an outbox row's key, which NATS has no place for.
const HeaderKey = "oncely-key"

// JetStreamPublisher publishes the outbox relay's rows to JetStream
// (outbox.RelayConfig.Publisher): a row's topic is the subject, its value
// the data, its headers the headers (the trace context among them), its
// key the HeaderKey header. Nats-Msg-Id is the row's stable message id, so
// JetStream's duplicate window drops a row published again (a relay that
// stopped after the PubAck and before marking the row sent), and the
// downstream inbox deduplicates one published again after the window.
// Rows go one after another, each after the previous one's PubAck, so the
// rows of a key are stored in enqueue-commit order.
type JetStreamPublisher struct {
	JetStream jetstream.JetStream
}

// System is messaging.system: nats.
func (JetStreamPublisher) System() string { return System }

// Publish publishes recs in order and waits for each PubAck; after the
// first failure the rest are not published (they fail with the same error
// and stay pending).
func (p JetStreamPublisher) Publish(ctx context.Context, recs []*kgo.Record) []error {
	errs := make([]error, len(recs))
	for i, rec := range recs {
		m := message(rec)
		if id := header(rec, outbox.MessageIDHeader); id != "" {
			m.Header.Set(nats.MsgIdHdr, id)
		}
		if rec.Key != nil {
			m.Header.Set(HeaderKey, string(rec.Key))
		}
		if _, err := p.JetStream.PublishMsg(ctx, m); err != nil {
			for j := i; j < len(recs); j++ {
				errs[j] = fmt.Errorf("natsconsumer: publish to %s: %w", rec.Topic, err)
			}
			break
		}
	}
	return errs
}

// message is rec as a NATS message: its topic the subject, its value the
// data, its headers the headers.
func message(rec *kgo.Record) *nats.Msg {
	m := nats.NewMsg(rec.Topic)
	m.Data = rec.Value
	for _, h := range rec.Headers {
		m.Header.Add(h.Key, string(h.Value))
	}
	return m
}

// Refuse: a subject NATS cannot publish to, or data over the server's
// maximum payload.
func (p JetStreamPublisher) Refuse(rec *kgo.Record) error {
	if rec.Topic == "" || strings.ContainsAny(rec.Topic, " \t\r\n*>") || strings.HasPrefix(rec.Topic, ".") ||
		strings.HasSuffix(rec.Topic, ".") || strings.Contains(rec.Topic, "..") {
		return fmt.Errorf("%w: %q", nats.ErrBadSubject, rec.Topic)
	}
	if limit := p.JetStream.Conn().MaxPayload(); limit > 0 && int64(len(rec.Value)) > limit {
		return fmt.Errorf("%w: %d bytes over the server's %d", nats.ErrMaxPayload, len(rec.Value), limit)
	}
	return nil
}

// Permanent: a bad subject or an oversized message; anything else (no
// stream captures the subject, a timeout, a lost connection) is retried.
func (JetStreamPublisher) Permanent(err error) bool {
	return errors.Is(err, nats.ErrBadSubject) || errors.Is(err, nats.ErrMaxPayload)
}

var _ outbox.Publisher = JetStreamPublisher{}
