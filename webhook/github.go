package webhook

import (
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// The GitHub headers.
const (
	ghSignature = "X-Hub-Signature-256"
	ghDelivery  = "X-GitHub-Delivery"
	ghEvent     = "X-GitHub-Event"
)

// NewGitHub returns a Verifier for GitHub's webhook signatures:
//
//   - X-Hub-Signature-256 is "sha256=" + hex(HMAC-SHA256(secret, body)),
//     with the webhook's secret taken as it is. The legacy SHA-1
//     X-Hub-Signature is not accepted.
//   - The delivery id is X-GitHub-Delivery (the same when a delivery is
//     redelivered), the event type X-GitHub-Event. An authentic request
//     without X-GitHub-Delivery is refused with 400.
//
// The scheme signs neither a timestamp nor the delivery id, so
// cfg.Tolerance must be zero: replay protection rests on deduplication by
// delivery id alone (see the package documentation).
func NewGitHub(cfg VerifierConfig) (Verifier, error) {
	if err := cfg.check("github"); err != nil {
		return nil, err
	}
	if cfg.Tolerance != 0 {
		return nil, errors.New("webhook: github: VerifierConfig.Tolerance: GitHub signs no timestamp, so there is nothing to check it against; leave it zero")
	}
	v := &github{}
	for _, s := range cfg.Secrets {
		v.keys = append(v.keys, []byte(s))
	}
	return v, nil
}

type github struct{ keys [][]byte }

func (v *github) Verify(r *http.Request, body []byte, _ time.Time) (Delivery, error) {
	const scheme = "github"
	raw := r.Header.Get(ghSignature)
	if raw == "" {
		return Delivery{}, unauthorized(ErrMissingSignature, "%s: no %s header", scheme, ghSignature)
	}
	sig, err := parseGitHubSignature(raw)
	if err != nil {
		return Delivery{}, unauthorized(ErrMalformedHeader, "%s: %s: %v", scheme, ghSignature, err)
	}
	if !anyEqual([][]byte{sig}, macs(v.keys, body)) {
		return Delivery{}, unauthorized(ErrSignatureMismatch, "%s: the signature was checked against %d secret(s)", scheme, len(v.keys))
	}
	id := r.Header.Get(ghDelivery)
	if id == "" {
		return Delivery{}, &Error{Status: http.StatusBadRequest, Reason: ErrNoDeliveryID,
			Detail: fmt.Sprintf("%s: no %s header", scheme, ghDelivery)}
	}
	return Delivery{ID: id, Provider: ProviderGitHub, EventType: r.Header.Get(ghEvent)}, nil
}

// parseGitHubSignature parses "sha256=" followed by 64 hex digits.
func parseGitHubSignature(h string) ([]byte, error) {
	hx, ok := strings.CutPrefix(h, "sha256=")
	if !ok {
		return nil, fmt.Errorf("%q does not start with sha256=", truncate(h))
	}
	if len(hx) != 2*32 {
		return nil, fmt.Errorf("want 64 hex digits after sha256=, got %d characters", len(hx))
	}
	b, err := hex.DecodeString(hx)
	if err != nil {
		return nil, fmt.Errorf("not hex: %w", err)
	}
	return b, nil
}
