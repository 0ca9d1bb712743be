package webhook

import (
	"cmp"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"
)

const stripeSignature = "Stripe-Signature"

// NewStripe returns a Verifier for Stripe's webhook signatures:
//
//   - The Stripe-Signature header is a comma-separated list of key=value
//     items: t=<unix seconds> once, v1=<hex> one or more times (several
//     while an endpoint secret is being rolled), and others (v0, for test
//     mode's legacy scheme) that are ignored.
//   - A v1 signature is hex(HMAC-SHA256(secret, t + "." + body)), where the
//     secret is the endpoint's signing secret ("whsec_...") taken as it is,
//     bytes and prefix included: Stripe does not base64-decode it.
//   - The delivery id is the event's top-level "id" (evt_...), the same on
//     every retry, and the event type its "type". The body is parsed only
//     after its signature was verified; an authentic body without an id is
//     refused with 400.
func NewStripe(cfg VerifierConfig) (Verifier, error) {
	if err := cfg.check("stripe"); err != nil {
		return nil, err
	}
	v := &stripe{tolerance: cmp.Or(cfg.Tolerance, DefaultTolerance)}
	for _, s := range cfg.Secrets {
		v.keys = append(v.keys, []byte(s))
	}
	return v, nil
}

type stripe struct {
	keys      [][]byte
	tolerance time.Duration
}

func (v *stripe) Verify(r *http.Request, body []byte, now time.Time) (Delivery, error) {
	const scheme = "stripe"
	raw := r.Header.Get(stripeSignature)
	if raw == "" {
		return Delivery{}, unauthorized(ErrMissingSignature, "%s: no %s header", scheme, stripeSignature)
	}
	h, err := parseStripeSignature(raw)
	if err != nil {
		return Delivery{}, unauthorized(ErrMalformedHeader, "%s: %s: %v", scheme, stripeSignature, err)
	}
	if len(h.v1) == 0 {
		return Delivery{}, unauthorized(ErrMissingSignature, "%s: %s holds no v1 signature", scheme, stripeSignature)
	}
	want := macs(v.keys, []byte(h.t), []byte{'.'}, body)
	if !anyEqual(h.v1, want) {
		return Delivery{}, unauthorized(ErrSignatureMismatch, "%s: %d v1 signature(s) checked against %d secret(s)", scheme, len(h.v1), len(v.keys))
	}
	ts, _ := parseUnix(h.t) // parseStripeSignature checked it
	if err := checkTimestamp(scheme, "t", ts, now, v.tolerance); err != nil {
		return Delivery{}, err
	}
	// Authentic: now, and only now, the body may be parsed.
	var event struct {
		ID   string `json:"id"`
		Type string `json:"type"`
	}
	if err := json.Unmarshal(body, &event); err != nil {
		return Delivery{}, &Error{Status: http.StatusBadRequest, Reason: ErrNoDeliveryID,
			Detail: fmt.Sprintf("%s: the signed body is not a JSON event: %v", scheme, err)}
	}
	if event.ID == "" {
		return Delivery{}, &Error{Status: http.StatusBadRequest, Reason: ErrNoDeliveryID,
			Detail: scheme + `: the signed event has no "id"`}
	}
	return Delivery{ID: event.ID, Provider: ProviderStripe, EventType: event.Type, Timestamp: ts}, nil
}

// stripeHeader is a parsed Stripe-Signature header.
type stripeHeader struct {
	t  string   // unix seconds, as sent (it is part of the signed payload)
	v1 [][]byte // decoded v1 signatures, in header order
}

// parseStripeSignature parses a Stripe-Signature header. Every item must be
// key=value; t must appear exactly once, in unix seconds; v1 values must be
// hex. Items with other keys are ignored.
func parseStripeSignature(h string) (stripeHeader, error) {
	var s stripeHeader
	seenT := false
	for i, item := range strings.Split(h, ",") {
		k, val, ok := strings.Cut(item, "=")
		if !ok {
			return stripeHeader{}, fmt.Errorf("item %d %q is not key=value", i+1, truncate(item))
		}
		switch k {
		case "t":
			if seenT {
				return stripeHeader{}, errors.New("t appears more than once")
			}
			if _, ok := parseUnix(val); !ok {
				return stripeHeader{}, fmt.Errorf("t=%q is not unix seconds", truncate(val))
			}
			s.t, seenT = val, true
		case "v1":
			b, err := hex.DecodeString(val)
			if err != nil {
				return stripeHeader{}, fmt.Errorf("v1 signature %d is not hex: %w", len(s.v1)+1, err)
			}
			s.v1 = append(s.v1, b)
		}
	}
	if !seenT {
		return stripeHeader{}, errors.New("no t= timestamp")
	}
	return s, nil
}
