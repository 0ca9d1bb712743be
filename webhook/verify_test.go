package webhook

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The signatures below are computed by the tests themselves, written out
// from each scheme's published algorithm with crypto/hmac, independently of
// the code under test; each scheme also has a fixed vector computed
// elsewhere.

func hmacSHA256(key []byte, parts ...string) []byte {
	m := hmac.New(sha256.New, key)
	for _, p := range parts {
		_, _ = io.WriteString(m, p)
	}
	return m.Sum(nil)
}

// swSign signs per Standard Webhooks: base64 of HMAC-SHA256 keyed with the
// base64-decoded secret, over id.timestamp.body.
func swSign(t *testing.T, secret, id, ts, body string) string {
	t.Helper()
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		t.Fatal(err)
	}
	return "v1," + base64.StdEncoding.EncodeToString(hmacSHA256(key, id, ".", ts, ".", body))
}

// stripeSign signs per Stripe: hex of HMAC-SHA256 keyed with the secret's
// bytes as they are, over t.body.
func stripeSign(secret, ts, body string) string {
	return hex.EncodeToString(hmacSHA256([]byte(secret), ts, ".", body))
}

// githubSign signs per GitHub: sha256= and the hex HMAC-SHA256 of the body.
func githubSign(secret, body string) string {
	return "sha256=" + hex.EncodeToString(hmacSHA256([]byte(secret), body))
}

func request(headers map[string]string) *http.Request {
	r := httptest.NewRequestWithContext(context.Background(), http.MethodPost, "/webhook", nil)
	for k, v := range headers {
		r.Header.Set(k, v)
	}
	return r
}

// wantRefusal checks that err is an *Error with the status and reason.
func wantRefusal(t *testing.T, err error, status int, reason error) {
	t.Helper()
	if err == nil {
		t.Fatalf("accepted; want a refusal (%d, %v)", status, reason)
	}
	ve, ok := errors.AsType[*Error](err)
	if !ok {
		t.Fatalf("error %v (%T) is not a *webhook.Error", err, err)
	}
	if ve.Status != status || !errors.Is(err, reason) {
		t.Fatalf("refused with %d %q; want %d and reason %q", ve.Status, err, status, reason)
	}
}

func mustVerifier(t testing.TB, mk func(VerifierConfig) (Verifier, error), cfg VerifierConfig) Verifier {
	t.Helper()
	v, err := mk(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// The example from the Standard Webhooks specification.
const (
	specSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	specID     = "msg_p5jXN8AQM9LWM0D4loKWxJek"
	specTS     = "1614265330"
	specBody   = `{"test": 2432232314}`
	specSig    = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
)

func TestVerifyStandardWebhooksSpecVector(t *testing.T) {
	if got := swSign(t, specSecret, specID, specTS, specBody); got != specSig {
		t.Fatalf("the test's own signer gives %s for the spec's example, want %s", got, specSig)
	}
	v := mustVerifier(t, NewStandardWebhooks, VerifierConfig{Secrets: []string{specSecret}})
	r := request(map[string]string{"webhook-id": specID, "webhook-timestamp": specTS, "webhook-signature": specSig})
	d, err := v.Verify(r, []byte(specBody), time.Unix(1614265330, 0))
	if err != nil {
		t.Fatal(err)
	}
	want := Delivery{ID: specID, Provider: ProviderStandardWebhooks, Timestamp: time.Unix(1614265330, 0)}
	if d != want {
		t.Fatalf("delivery %+v, want %+v", d, want)
	}
}

func TestVerifyStandardWebhooks(t *testing.T) {
	const (
		oldSecret   = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
		newSecret   = "whsec_" + "c2VjcmV0LWtleS1vZi0zMi1ieXRlcy1mb3ItdGVzdHM=" // 32 bytes
		otherSecret = "whsec_" + "b3RoZXItc2VjcmV0LW5vYm9keS1jb25maWd1cmVk"
		id          = "msg_2Lq8"
		body        = `{"type":"order.created","data":{"id":42}}`
	)
	now := time.Unix(1_700_000_000, 0)
	ts := strconv.FormatInt(now.Unix(), 10)
	rotated := mustVerifier(t, NewStandardWebhooks, VerifierConfig{Secrets: []string{oldSecret, newSecret}})
	type tc struct {
		name    string
		v       Verifier
		headers map[string]string
		body    string
		now     time.Time
		reason  error // nil: accepted
	}
	signed := func(secret, id, ts, body string) map[string]string {
		return map[string]string{"webhook-id": id, "webhook-timestamp": ts, "webhook-signature": swSign(t, secret, id, ts, body)}
	}
	with := func(h map[string]string, k, v string) map[string]string {
		out := map[string]string{}
		for k, v := range h {
			out[k] = v
		}
		if v == "" {
			delete(out, k)
		} else {
			out[k] = v
		}
		return out
	}
	good := signed(newSecret, id, ts, body)
	tol := DefaultTolerance
	at := func(d time.Duration) string { return strconv.FormatInt(now.Add(d).Unix(), 10) }
	cases := []tc{
		{name: "valid, new secret", headers: good},
		{name: "valid, old secret still configured", headers: signed(oldSecret, id, ts, body)},
		{name: "unknown secret", headers: signed(otherSecret, id, ts, body), reason: ErrSignatureMismatch},
		{name: "one of several signatures matches", headers: with(good, "webhook-signature",
			"v1a,aGVsbG8= v1,"+base64.StdEncoding.EncodeToString(make([]byte, 32))+" v2,xyz "+good["webhook-signature"])},
		{name: "tampered body", headers: good, body: body + " ", reason: ErrSignatureMismatch},
		{name: "tampered id", headers: with(good, "webhook-id", "msg_2Lq9"), reason: ErrSignatureMismatch},
		{name: "tampered timestamp", headers: with(good, "webhook-timestamp", at(time.Second)), reason: ErrSignatureMismatch},
		{name: "stale beyond the tolerance", headers: signed(newSecret, id, at(-tol-time.Second), body), reason: ErrTimestamp},
		{name: "stale at the tolerance", headers: signed(newSecret, id, at(-tol), body)},
		{name: "future beyond the tolerance", headers: signed(newSecret, id, at(tol+time.Second), body), reason: ErrTimestamp},
		{name: "future at the tolerance", headers: signed(newSecret, id, at(tol), body)},
		{name: "custom tolerance", v: mustVerifier(t, NewStandardWebhooks, VerifierConfig{Secrets: []string{newSecret}, Tolerance: time.Minute}),
			headers: signed(newSecret, id, at(-61*time.Second), body), reason: ErrTimestamp},
		{name: "no signature header", headers: with(good, "webhook-signature", ""), reason: ErrMissingSignature},
		{name: "no v1 signature", headers: with(good, "webhook-signature", "v1a,aGVsbG8= v2,abc"), reason: ErrMissingSignature},
		{name: "bare base64 without version", headers: with(good, "webhook-signature", strings.TrimPrefix(good["webhook-signature"], "v1,")), reason: ErrMissingSignature},
		{name: "v1 value not base64", headers: with(good, "webhook-signature", "v1,not*base64"), reason: ErrMissingSignature},
		// Found by FuzzStandardWebhooksSignatureHeader: Go's base64 decoder
		// skips CR and LF, so a genuine signature with a line break inside
		// was a second spelling of it that passed.
		{name: "v1 value with a line break inside", headers: with(good, "webhook-signature",
			good["webhook-signature"][:9]+"\n"+good["webhook-signature"][9:]), reason: ErrMissingSignature},
		{name: "v1 value with a carriage return inside", headers: with(good, "webhook-signature",
			good["webhook-signature"][:9]+"\r"+good["webhook-signature"][9:]), reason: ErrMissingSignature},
		{name: "no id", headers: with(good, "webhook-id", ""), reason: ErrMalformedHeader},
		{name: "no timestamp", headers: with(good, "webhook-timestamp", ""), reason: ErrMalformedHeader},
		{name: "timestamp not a number", headers: with(good, "webhook-timestamp", "yesterday"), reason: ErrMalformedHeader},
		{name: "timestamp with a sign", headers: with(good, "webhook-timestamp", "+"+ts), reason: ErrMalformedHeader},
		{name: "timestamp with a fraction", headers: with(good, "webhook-timestamp", ts+".5"), reason: ErrMalformedHeader},
		{name: "timestamp in milliseconds is far in the future", headers: signed(newSecret, id, ts+"000", body), reason: ErrTimestamp},
		{name: "timestamp too long", headers: with(good, "webhook-timestamp", strings.Repeat("9", 40)), reason: ErrMalformedHeader},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			v := c.v
			if v == nil {
				v = rotated
			}
			b := body
			if c.body != "" {
				b = c.body
			}
			when := now
			if !c.now.IsZero() {
				when = c.now
			}
			d, err := v.Verify(request(c.headers), []byte(b), when)
			if c.reason != nil {
				wantRefusal(t, err, http.StatusUnauthorized, c.reason)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d.ID != c.headers["webhook-id"] || d.Provider != ProviderStandardWebhooks || strconv.FormatInt(d.Timestamp.Unix(), 10) != c.headers["webhook-timestamp"] {
				t.Fatalf("delivery %+v does not match the request %v", d, c.headers)
			}
		})
	}
}

// Stripe's scheme, with a vector computed by Python's hmac module:
// hmac.new(b"whsec_test_secret", b'1492774577.' + body, hashlib.sha256).hexdigest()
const (
	stripeVectorSecret = "whsec_test_secret"
	stripeVectorT      = "1492774577"
	stripeVectorBody   = `{"id":"evt_1NxYz7","object":"event","type":"charge.succeeded"}`
	stripeVectorV1     = "fca1490bc3c5b4381b52e11b32d7413296daa938dbe549c91025e4f472bcd4ea"
)

func TestVerifyStripeVector(t *testing.T) {
	if got := stripeSign(stripeVectorSecret, stripeVectorT, stripeVectorBody); got != stripeVectorV1 {
		t.Fatalf("the test's own signer gives %s, want %s", got, stripeVectorV1)
	}
	v := mustVerifier(t, NewStripe, VerifierConfig{Secrets: []string{stripeVectorSecret}})
	r := request(map[string]string{"Stripe-Signature": "t=" + stripeVectorT + ",v1=" + stripeVectorV1 + ",v0=6ffbb59b2300aae63f272406069a9788598b792a944a07aba816edb039989a39"})
	d, err := v.Verify(r, []byte(stripeVectorBody), time.Unix(1492774577+30, 0))
	if err != nil {
		t.Fatal(err)
	}
	want := Delivery{ID: "evt_1NxYz7", Provider: ProviderStripe, EventType: "charge.succeeded", Timestamp: time.Unix(1492774577, 0)}
	if d != want {
		t.Fatalf("delivery %+v, want %+v", d, want)
	}
}

func TestVerifyStripe(t *testing.T) {
	const (
		oldSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
		newSecret = "whsec_rolled_2024"
		body      = `{"id":"evt_3Ab","object":"event","type":"invoice.paid","data":{"object":{}}}`
	)
	now := time.Unix(1_700_000_000, 0)
	ts := strconv.FormatInt(now.Unix(), 10)
	at := func(d time.Duration) string { return strconv.FormatInt(now.Add(d).Unix(), 10) }
	v := mustVerifier(t, NewStripe, VerifierConfig{Secrets: []string{oldSecret, newSecret}})
	hdr := func(ts string, v1s ...string) map[string]string {
		h := "t=" + ts
		for _, s := range v1s {
			h += ",v1=" + s
		}
		return map[string]string{"Stripe-Signature": h}
	}
	// Stripe uses the secret's bytes as they are; a signature keyed with
	// the base64-decoded secret (the Standard Webhooks way) must not pass.
	decoded, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(oldSecret, "whsec_"))
	decodedSig := hex.EncodeToString(hmacSHA256(decoded, ts, ".", body))
	cases := []struct {
		name    string
		headers map[string]string
		body    string
		status  int // 0: accepted
		reason  error
	}{
		{name: "valid, new secret", headers: hdr(ts, stripeSign(newSecret, ts, body))},
		{name: "valid, old secret still configured", headers: hdr(ts, stripeSign(oldSecret, ts, body))},
		{name: "second v1 matches (secret being rolled)", headers: hdr(ts, stripeSign("whsec_unknown", ts, body), stripeSign(newSecret, ts, body))},
		{name: "unknown items are ignored", headers: map[string]string{"Stripe-Signature": "t=" + ts + ",v0=abcd,v2=zz,v1=" + stripeSign(newSecret, ts, body)}},
		{name: "unknown secret", headers: hdr(ts, stripeSign("whsec_unknown", ts, body)), status: 401, reason: ErrSignatureMismatch},
		{name: "secret base64-decoded is wrong for Stripe", headers: hdr(ts, decodedSig), status: 401, reason: ErrSignatureMismatch},
		{name: "tampered body", headers: hdr(ts, stripeSign(newSecret, ts, body)), body: strings.Replace(body, "evt_3Ab", "evt_3Ac", 1), status: 401, reason: ErrSignatureMismatch},
		{name: "tampered timestamp", headers: hdr(at(time.Second), stripeSign(newSecret, ts, body)), status: 401, reason: ErrSignatureMismatch},
		{name: "stale", headers: hdr(at(-DefaultTolerance-time.Second), stripeSign(newSecret, at(-DefaultTolerance-time.Second), body)), status: 401, reason: ErrTimestamp},
		{name: "future", headers: hdr(at(DefaultTolerance+time.Second), stripeSign(newSecret, at(DefaultTolerance+time.Second), body)), status: 401, reason: ErrTimestamp},
		{name: "no header", headers: nil, status: 401, reason: ErrMissingSignature},
		{name: "only v0", headers: map[string]string{"Stripe-Signature": "t=" + ts + ",v0=" + stripeSign(newSecret, ts, body)}, status: 401, reason: ErrMissingSignature},
		{name: "no t", headers: map[string]string{"Stripe-Signature": "v1=" + stripeSign(newSecret, ts, body)}, status: 401, reason: ErrMalformedHeader},
		{name: "t twice", headers: map[string]string{"Stripe-Signature": "t=" + ts + ",t=" + ts + ",v1=" + stripeSign(newSecret, ts, body)}, status: 401, reason: ErrMalformedHeader},
		{name: "t not a number", headers: hdr("soon", stripeSign(newSecret, "soon", body)), status: 401, reason: ErrMalformedHeader},
		{name: "v1 not hex", headers: hdr(ts, "xyz"), status: 401, reason: ErrMalformedHeader},
		{name: "item without =", headers: map[string]string{"Stripe-Signature": "t=" + ts + ",v1"}, status: 401, reason: ErrMalformedHeader},
		{name: "spaces are not Stripe's format", headers: map[string]string{"Stripe-Signature": "t=" + ts + ", v1=" + stripeSign(newSecret, ts, body)}, status: 401, reason: ErrMissingSignature},
		// The body is parsed only after the signature is verified: an
		// unsigned body that is not even JSON is a 401, not a 400.
		{name: "unsigned garbage body", headers: hdr(ts, stripeSign("whsec_unknown", ts, "{")), body: "{", status: 401, reason: ErrSignatureMismatch},
		{name: "signed body without id", headers: hdr(ts, stripeSign(newSecret, ts, `{"object":"event"}`)), body: `{"object":"event"}`, status: 400, reason: ErrNoDeliveryID},
		{name: "signed body not JSON", headers: hdr(ts, stripeSign(newSecret, ts, "id=evt_1")), body: "id=evt_1", status: 400, reason: ErrNoDeliveryID},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := body
			if c.body != "" {
				b = c.body
			}
			d, err := v.Verify(request(c.headers), []byte(b), now)
			if c.status != 0 {
				wantRefusal(t, err, c.status, c.reason)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d.ID != "evt_3Ab" || d.EventType != "invoice.paid" || d.Provider != ProviderStripe || !d.Timestamp.Equal(now) {
				t.Fatalf("delivery %+v", d)
			}
		})
	}
}

// GitHub's example from "Validating webhook deliveries" (docs.github.com).
const (
	githubVectorSecret = "It's a Secret to Everybody"
	githubVectorBody   = "Hello, World!"
	githubVectorSig    = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
)

func TestVerifyGitHub(t *testing.T) {
	if got := githubSign(githubVectorSecret, githubVectorBody); got != githubVectorSig {
		t.Fatalf("the test's own signer gives %s, want %s", got, githubVectorSig)
	}
	const (
		newSecret = "rotated-secret"
		delivery  = "72d3162e-cc78-11e3-81ab-4c9367dc0958"
		body      = `{"action":"opened","number":1}`
	)
	v := mustVerifier(t, NewGitHub, VerifierConfig{Secrets: []string{githubVectorSecret, newSecret}})
	hdr := func(sig string) map[string]string {
		return map[string]string{"X-Hub-Signature-256": sig, "X-GitHub-Delivery": delivery, "X-GitHub-Event": "pull_request"}
	}
	cases := []struct {
		name    string
		headers map[string]string
		body    string
		status  int
		reason  error
	}{
		{name: "the documented vector", headers: hdr(githubVectorSig), body: githubVectorBody},
		{name: "valid, new secret", headers: hdr(githubSign(newSecret, body))},
		{name: "unknown secret", headers: hdr(githubSign("other", body)), status: 401, reason: ErrSignatureMismatch},
		{name: "tampered body", headers: hdr(githubVectorSig), body: githubVectorBody + "\n", status: 401, reason: ErrSignatureMismatch},
		{name: "no signature", headers: map[string]string{"X-GitHub-Delivery": delivery}, status: 401, reason: ErrMissingSignature},
		{name: "legacy SHA-1 header only", headers: map[string]string{"X-Hub-Signature": "sha1=" + strings.Repeat("ab", 20), "X-GitHub-Delivery": delivery}, status: 401, reason: ErrMissingSignature},
		{name: "wrong algorithm prefix", headers: hdr("sha1=" + strings.TrimPrefix(githubSign(newSecret, body), "sha256=")), status: 401, reason: ErrMalformedHeader},
		{name: "bare hex", headers: hdr(strings.TrimPrefix(githubSign(newSecret, body), "sha256=")), status: 401, reason: ErrMalformedHeader},
		{name: "short", headers: hdr(githubSign(newSecret, body)[:70]), status: 401, reason: ErrMalformedHeader},
		{name: "not hex", headers: hdr("sha256=" + strings.Repeat("zz", 32)), status: 401, reason: ErrMalformedHeader},
		{name: "authentic without delivery id", headers: map[string]string{"X-Hub-Signature-256": githubSign(newSecret, body)}, status: 400, reason: ErrNoDeliveryID},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := body
			if c.body != "" {
				b = c.body
			}
			// No timestamp: the clock plays no part.
			d, err := v.Verify(request(c.headers), []byte(b), time.Time{})
			if c.status != 0 {
				wantRefusal(t, err, c.status, c.reason)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := Delivery{ID: delivery, Provider: ProviderGitHub, EventType: "pull_request"}
			if d != want {
				t.Fatalf("delivery %+v, want %+v", d, want)
			}
		})
	}
}

func TestVerifierConfigErrors(t *testing.T) {
	cases := []struct {
		name string
		mk   func(VerifierConfig) (Verifier, error)
		cfg  VerifierConfig
		want string
	}{
		{"no secrets", NewStandardWebhooks, VerifierConfig{}, "VerifierConfig.Secrets: at least one"},
		{"empty secret", NewStripe, VerifierConfig{Secrets: []string{"whsec_a", ""}}, "VerifierConfig.Secrets[1] is empty"},
		{"negative tolerance", NewStripe, VerifierConfig{Secrets: []string{"s"}, Tolerance: -time.Second}, "VerifierConfig.Tolerance: -1s is negative"},
		{"not base64", NewStandardWebhooks, VerifierConfig{Secrets: []string{"whsec_not*base64*secret"}}, "VerifierConfig.Secrets[0]: want whsec_ followed by base64"},
		{"empty key", NewStandardWebhooks, VerifierConfig{Secrets: []string{"whsec_"}}, "VerifierConfig.Secrets[0]: the key is empty"},
		{"tolerance for GitHub", NewGitHub, VerifierConfig{Secrets: []string{"s"}, Tolerance: time.Minute}, "VerifierConfig.Tolerance: GitHub signs no timestamp"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := c.mk(c.cfg)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want it to contain %q", err, c.want)
			}
			if strings.Contains(err.Error(), "not*base64*secret") {
				t.Fatalf("the error %q quotes the secret", err)
			}
		})
	}
}
