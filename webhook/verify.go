package webhook

import (
	"crypto/hmac"
	"crypto/sha256"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// Delivery is what a Verifier learned from an authentic request.
type Delivery struct {
	// ID is the provider's id of the delivery, the same on every retry of
	// it. It becomes the outbox message id (after Config.IDPrefix). Required.
	ID string
	// Provider names the scheme, e.g. ProviderStripe.
	Provider string
	// EventType is the provider's event type, when the scheme tells it
	// without parsing the body beyond what verification needs.
	EventType string
	// Timestamp is the signed send time; zero for schemes without one.
	Timestamp time.Time
}

// Verifier authenticates a request. Verify gets the raw body, already read
// within the size limit, and the current time; it must not parse the body
// before the signature over it is verified. It returns the delivery, or an
// error: an [*Error] says which status to answer, and any other error is
// answered 401.
type Verifier interface {
	Verify(r *http.Request, body []byte, now time.Time) (Delivery, error)
}

// Provider names, as found in Delivery.Provider and the HeaderProvider
// record header.
const (
	ProviderStandardWebhooks = "standard-webhooks"
	ProviderStripe           = "stripe"
	ProviderGitHub           = "github"
)

// Reasons for a refusal. Every error of the built-in verifiers is an
// [*Error] that wraps one of them, so errors.Is tells them apart.
var (
	// ErrMissingSignature: the request carries no signature of the scheme.
	ErrMissingSignature = errors.New("missing signature")
	// ErrMalformedHeader: a header of the scheme cannot be parsed.
	ErrMalformedHeader = errors.New("malformed header")
	// ErrSignatureMismatch: no signature matches any secret.
	ErrSignatureMismatch = errors.New("no signature matches")
	// ErrTimestamp: the signed timestamp is too old or too far ahead.
	ErrTimestamp = errors.New("timestamp outside tolerance")
	// ErrNoDeliveryID: the request is authentic but names no delivery id.
	ErrNoDeliveryID = errors.New("no delivery id")
)

// Error is a refused request: the Receiver answers Status and stores
// nothing.
type Error struct {
	// Status is the HTTP status to answer: 401 for authentication failures,
	// 400 for an authentic but unusable request. A status outside 400-599
	// is answered 401.
	Status int
	Reason error // one of the Err* reasons, or a verifier's own
	// Detail says exactly what was wrong, for the log: it may quote
	// request headers (truncated) and never contains a secret. The
	// Receiver logs it and answers with the Reason alone.
	Detail string
}

func (e *Error) Error() string {
	msg := "webhook: refused"
	if e.Reason != nil {
		msg = "webhook: " + e.Reason.Error()
	}
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	return msg
}

func (e *Error) Unwrap() error { return e.Reason }

// unauthorized returns a 401 refusal.
func unauthorized(reason error, format string, args ...any) *Error {
	return &Error{Status: http.StatusUnauthorized, Reason: reason, Detail: fmt.Sprintf(format, args...)}
}

// DefaultTolerance is how far a signed timestamp may be from the receiver's
// clock, in either direction.
const DefaultTolerance = 5 * time.Minute

// VerifierConfig configures a built-in Verifier.
type VerifierConfig struct {
	// Secrets are the endpoint's signing secrets, in the provider's format.
	// A request passes when any of its signatures matches any secret: list
	// the old and the new secret while rotating. At least one is required.
	Secrets []string
	// Tolerance bounds the difference between a signed timestamp and the
	// receiver's clock, in both directions. Default DefaultTolerance. Only
	// for schemes with a timestamp: NewGitHub refuses it.
	Tolerance time.Duration
}

// check validates the fields shared by all schemes.
func (c VerifierConfig) check(scheme string) error {
	if len(c.Secrets) == 0 {
		return fmt.Errorf("webhook: %s: VerifierConfig.Secrets: at least one secret is required", scheme)
	}
	for i, s := range c.Secrets {
		if s == "" {
			return fmt.Errorf("webhook: %s: VerifierConfig.Secrets[%d] is empty", scheme, i)
		}
	}
	if c.Tolerance < 0 {
		return fmt.Errorf("webhook: %s: VerifierConfig.Tolerance: %s is negative", scheme, c.Tolerance)
	}
	return nil
}

// macs returns HMAC-SHA256(key, parts...) for every key.
func macs(keys [][]byte, parts ...[]byte) [][]byte {
	out := make([][]byte, len(keys))
	for i, k := range keys {
		m := hmac.New(sha256.New, k)
		for _, p := range parts {
			m.Write(p)
		}
		out[i] = m.Sum(nil)
	}
	return out
}

// anyEqual reports whether any of got equals any of want, comparing in
// constant time.
func anyEqual(got, want [][]byte) bool {
	for _, g := range got {
		for _, w := range want {
			if hmac.Equal(g, w) {
				return true
			}
		}
	}
	return false
}

// maxUnixDigits bounds a timestamp's length: 18 digits never overflow int64.
const maxUnixDigits = 18

// parseUnix parses a timestamp in whole unix seconds: decimal digits only.
func parseUnix(s string) (time.Time, bool) {
	if s == "" || len(s) > maxUnixDigits {
		return time.Time{}, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return time.Time{}, false
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return time.Time{}, false
	}
	return time.Unix(n, 0), true
}

// checkTimestamp refuses ts when it is more than tol away from now. It
// compares instants, not durations: now.Sub(ts) saturates for timestamps
// centuries away, and negating the saturated minimum overflows.
func checkTimestamp(scheme, header string, ts, now time.Time, tol time.Duration) error {
	switch {
	case ts.Before(now.Add(-tol)):
		return unauthorized(ErrTimestamp, "%s: %s %d is %s old, beyond the tolerance of %s",
			scheme, header, ts.Unix(), now.Sub(ts).Round(time.Second), tol)
	case ts.After(now.Add(tol)):
		return unauthorized(ErrTimestamp, "%s: %s %d is %s ahead of this server's clock, beyond the tolerance of %s",
			scheme, header, ts.Unix(), ts.Sub(now).Round(time.Second), tol)
	}
	return nil
}
