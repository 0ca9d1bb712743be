package webhook

import (
	"cmp"
	"encoding/base64"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// The Standard Webhooks headers.
const (
	swID        = "webhook-id"
	swTimestamp = "webhook-timestamp"
	swSignature = "webhook-signature"
)

// NewStandardWebhooks returns a Verifier for the Standard Webhooks scheme
// (https://www.standardwebhooks.com/):
//
//   - webhook-id is the delivery id, webhook-timestamp the send time in
//     unix seconds, webhook-signature a space-separated list of versioned
//     signatures such as "v1,<base64>".
//   - A v1 signature is base64(HMAC-SHA256(key, id + "." + timestamp + "." +
//     body)), where the key is the secret "whsec_<base64>" base64-decoded
//     (the whsec_ prefix is optional).
//   - Signatures of other versions (such as the asymmetric v1a) are ignored;
//     a request passes when any v1 signature matches any secret and its
//     timestamp is within the tolerance.
func NewStandardWebhooks(cfg VerifierConfig) (Verifier, error) {
	const scheme = "standard webhooks"
	if err := cfg.check(scheme); err != nil {
		return nil, err
	}
	v := &standardWebhooks{tolerance: cmp.Or(cfg.Tolerance, DefaultTolerance)}
	for i, s := range cfg.Secrets {
		key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(s, "whsec_"))
		if err != nil {
			// The error names the offending byte, never the secret.
			return nil, fmt.Errorf("webhook: %s: VerifierConfig.Secrets[%d]: want whsec_ followed by base64: %w", scheme, i, err)
		}
		if len(key) == 0 {
			return nil, fmt.Errorf("webhook: %s: VerifierConfig.Secrets[%d]: the key is empty", scheme, i)
		}
		v.keys = append(v.keys, key)
	}
	return v, nil
}

type standardWebhooks struct {
	keys      [][]byte
	tolerance time.Duration
}

func (v *standardWebhooks) Verify(r *http.Request, body []byte, now time.Time) (Delivery, error) {
	const scheme = "standard webhooks"
	id, tsRaw, sigRaw := r.Header.Get(swID), r.Header.Get(swTimestamp), r.Header.Get(swSignature)
	switch {
	case sigRaw == "":
		return Delivery{}, unauthorized(ErrMissingSignature, "%s: no %s header", scheme, swSignature)
	case id == "":
		return Delivery{}, unauthorized(ErrMalformedHeader, "%s: no %s header, which the signature covers", scheme, swID)
	case tsRaw == "":
		return Delivery{}, unauthorized(ErrMalformedHeader, "%s: no %s header, which the signature covers", scheme, swTimestamp)
	}
	ts, ok := parseUnix(tsRaw)
	if !ok {
		return Delivery{}, unauthorized(ErrMalformedHeader, "%s: %s %q is not unix seconds", scheme, swTimestamp, truncate(tsRaw))
	}
	var sigs [][]byte
	for _, e := range parseSignatureList(sigRaw) {
		if e.version != "v1" {
			continue
		}
		if b, ok := decodeSignature(e.value); ok {
			sigs = append(sigs, b)
		}
	}
	if len(sigs) == 0 {
		return Delivery{}, unauthorized(ErrMissingSignature, "%s: %s holds no v1 signature in base64", scheme, swSignature)
	}
	want := macs(v.keys, []byte(id), []byte{'.'}, []byte(tsRaw), []byte{'.'}, body)
	if !anyEqual(sigs, want) {
		return Delivery{}, unauthorized(ErrSignatureMismatch, "%s: %d v1 signature(s) checked against %d secret(s)", scheme, len(sigs), len(v.keys))
	}
	if err := checkTimestamp(scheme, swTimestamp, ts, now, v.tolerance); err != nil {
		return Delivery{}, err
	}
	return Delivery{ID: id, Provider: ProviderStandardWebhooks, Timestamp: ts}, nil
}

// sigEntry is one "version,value" entry of a webhook-signature header.
type sigEntry struct{ version, value string }

// parseSignatureList splits a webhook-signature header into its entries.
// Entries are separated by spaces (or tabs); each is a version, a comma and
// a value (which may itself hold commas). Entries without a comma, or with
// an empty version or value, are skipped: they cannot match.
func parseSignatureList(h string) []sigEntry {
	var out []sigEntry
	for _, f := range strings.FieldsFunc(h, isSpaceOrTab) {
		version, value, ok := strings.Cut(f, ",")
		if !ok || version == "" || value == "" {
			continue
		}
		out = append(out, sigEntry{version: version, value: value})
	}
	return out
}

func isSpaceOrTab(r rune) bool { return r == ' ' || r == '\t' }

// decodeSignature decodes a v1 signature: canonical standard base64 and
// nothing else. The decoder alone skips CR and LF anywhere in its input, so
// those are refused first: one signature has one spelling.
func decodeSignature(s string) ([]byte, bool) {
	if strings.ContainsAny(s, "\r\n") {
		return nil, false
	}
	b, err := base64.StdEncoding.Strict().DecodeString(s)
	return b, err == nil
}

// truncate shortens attacker-controlled text quoted in an error.
func truncate(s string) string {
	const limit = 64
	if len(s) <= limit {
		return s
	}
	return s[:limit] + "..."
}
