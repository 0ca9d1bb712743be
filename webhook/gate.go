package webhook

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"
)

// gate is what every webhook endpoint (Receiver, Intake) does before a
// delivery counts: the method, the body within its limit, the signature
// and timestamp, the delivery id. Each refusal is answered with a terse
// body, logged in detail and counted.
type gate struct {
	verifier Verifier
	idPrefix string
	maxID    int // bytes of idPrefix + the delivery id
	maxBody  int64
	logger   *slog.Logger
	refused  atomic.Int64
}

// admit checks, in order, the method (405), the body size (413), the
// signature and timestamp (401, or the verifier's status) and the delivery
// id (400). It returns the delivery, its raw body and its message id
// (idPrefix + the delivery id), or answers the request and returns the
// refusal.
func (g *gate) admit(w http.ResponseWriter, r *http.Request) (Delivery, []byte, string, *intake) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		return Delivery{}, nil, "", g.refuse(w, r, http.StatusMethodNotAllowed, RefusalMethod, "webhook: method not allowed; deliveries are POSTed", "method "+r.Method)
	}
	body, status, err := g.readBody(w, r)
	if err != nil {
		reason := RefusalBodyUnreadable
		if status == http.StatusRequestEntityTooLarge {
			reason = RefusalBodyTooLarge
		}
		return Delivery{}, nil, "", g.refuse(w, r, status, reason, err.Error(), err.Error())
	}
	d, err := g.verifier.Verify(r, body, time.Now())
	if err != nil {
		status := http.StatusUnauthorized // fail closed
		if ve, ok := errors.AsType[*Error](err); ok && ve.Status >= 400 && ve.Status < 600 {
			status = ve.Status
		}
		return Delivery{}, nil, "", g.refuse(w, r, status, refusalOf(err), refusalBody(err), err.Error())
	}
	id := g.idPrefix + d.ID
	switch {
	case d.ID == "":
		return Delivery{}, nil, "", g.refuse(w, r, http.StatusBadRequest, RefusalNoDeliveryID, "webhook: "+ErrNoDeliveryID.Error(), "the verifier returned no delivery id")
	case len(id) > g.maxID:
		msg := fmt.Sprintf("webhook: the delivery id is %d bytes long, over the limit of %d", len(id), g.maxID)
		return Delivery{}, nil, "", g.refuse(w, r, http.StatusBadRequest, RefusalDeliveryIDTooLong, msg, msg)
	}
	return d, body, id, nil
}

// readBody reads the whole body within maxBody, or returns the status to
// refuse the request with.
func (g *gate) readBody(w http.ResponseWriter, r *http.Request) ([]byte, int, error) {
	limit := g.maxBody
	if r.ContentLength > limit {
		return nil, http.StatusRequestEntityTooLarge,
			fmt.Errorf("webhook: the body of %d bytes is over the limit of %d", r.ContentLength, limit)
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return nil, http.StatusRequestEntityTooLarge, fmt.Errorf("webhook: the body is over the limit of %d bytes", limit)
		}
		return nil, http.StatusBadRequest, errors.New("webhook: the body could not be read")
	}
	return body, 0, nil
}

// refuse answers a 4xx status with body, which never quotes the request,
// logs detail, which says exactly what was wrong, at Info, and returns the
// refusal for the telemetry (reason: one of the Refusal* values).
func (g *gate) refuse(w http.ResponseWriter, r *http.Request, status int, reason, body, detail string) *intake {
	g.refused.Add(1)
	g.logger.LogAttrs(r.Context(), slog.LevelInfo, "webhook: request refused",
		slog.Int("status", status), slog.String("reason", detail), slog.String("remote_addr", r.RemoteAddr))
	http.Error(w, body, status)
	return &intake{outcome: OutcomeRefused, refusal: reason, status: status}
}
