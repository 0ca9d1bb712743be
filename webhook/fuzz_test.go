package webhook

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The inverses of the parsers: headers built from parsed parts.

func formatSignatureList(es []sigEntry) string {
	parts := make([]string, len(es))
	for i, e := range es {
		parts[i] = e.version + "," + e.value
	}
	return strings.Join(parts, " ")
}

func (s stripeHeader) format() string {
	h := "t=" + s.t
	for _, sig := range s.v1 {
		h += ",v1=" + hex.EncodeToString(sig)
	}
	return h
}

func formatGitHubSignature(sig []byte) string { return "sha256=" + hex.EncodeToString(sig) }

// neverAccepts checks that a verifier refuses a request whose signature the
// fuzzer made up, with a 401 *Error.
func neverAccepts(t *testing.T, v Verifier, r *http.Request, body []byte, now time.Time) {
	t.Helper()
	d, err := v.Verify(r, body, now)
	if err == nil {
		t.Fatalf("a made-up signature passed: %+v, headers %v", d, r.Header)
	}
	if ve, ok := errors.AsType[*Error](err); !ok || ve.Status != http.StatusUnauthorized {
		t.Fatalf("refusal %v (%T), want a 401 *Error", err, err)
	}
}

func FuzzStandardWebhooksSignatureHeader(f *testing.F) {
	for _, s := range []string{
		specSig,
		specSig + " v1a,aGVsbG8= v2,x",
		"", " ", "v1", "v1,", ",x", "v1,a,b", "  v1,x\tv2,y  ", "v1,===", "v1,\u00a0x",
		"\xc2,\xa0", // invalid UTF-8 on each side of the comma: a rune only when joined
	} {
		f.Add(s)
	}
	v := mustVerifier(f, NewStandardWebhooks, VerifierConfig{Secrets: []string{specSecret}})
	now := time.Unix(1614265330, 0)
	f.Fuzz(func(t *testing.T, h string) {
		es := parseSignatureList(h)
		for _, e := range es {
			if e.version == "" || e.value == "" || strings.Contains(e.version, ",") ||
				strings.ContainsAny(e.version, " \t") || strings.ContainsAny(e.value, " \t") {
				t.Fatalf("entry %+v from %q breaks the format", e, h)
			}
		}
		// A header built from the parsed entries parses back to them.
		if again := parseSignatureList(formatSignatureList(es)); !slices.Equal(again, es) {
			t.Fatalf("%q parsed to %+v, its formatted form %q to %+v", h, es, formatSignatureList(es), again)
		}
		if strings.Contains(h, specSig[len("v1,"):]) {
			return // the genuine signature is in there
		}
		r := request(map[string]string{"webhook-id": specID, "webhook-timestamp": specTS, "webhook-signature": h})
		neverAccepts(t, v, r, []byte(specBody), now)
	})
}

func FuzzStripeSignatureHeader(f *testing.F) {
	for _, s := range []string{
		"t=" + stripeVectorT + ",v1=" + stripeVectorV1 + ",v0=6ffbb59b",
		"t=1,v1=,v1=00", "t=", "t=1,t=2", "v1=ab", "t=1,v1=zz", "t=1,", "=", "t=1,x=y=z", "t=01,v1=AB",
	} {
		f.Add(s)
	}
	v := mustVerifier(f, NewStripe, VerifierConfig{Secrets: []string{stripeVectorSecret}})
	f.Fuzz(func(t *testing.T, h string) {
		s, err := parseStripeSignature(h)
		if err != nil {
			if s.t != "" || s.v1 != nil {
				t.Fatalf("%q: error %v with a partial result %+v", h, err, s)
			}
		} else {
			ts, ok := parseUnix(s.t)
			if !ok || ts.Unix() < 0 {
				t.Fatalf("%q: t=%q accepted", h, s.t)
			}
			// A header built from the parsed parts parses back to them.
			again, err := parseStripeSignature(s.format())
			if err != nil || again.t != s.t || !slices.EqualFunc(again.v1, s.v1, bytes.Equal) {
				t.Fatalf("%q parsed to %+v; its formatted form %q to %+v, %v", h, s, s.format(), again, err)
			}
		}
		if strings.Contains(strings.ToLower(h), stripeVectorV1) {
			return
		}
		// The vector's body and its time: only the signature is made up.
		r := request(map[string]string{"Stripe-Signature": h})
		ts, _ := strconv.ParseInt(stripeVectorT, 10, 64)
		neverAccepts(t, v, r, []byte(stripeVectorBody), time.Unix(ts, 0))
	})
}

func FuzzGitHubSignatureHeader(f *testing.F) {
	for _, s := range []string{
		githubVectorSig, strings.ToUpper(githubVectorSig), "sha256=", "sha1=abc", "sha256=" + strings.Repeat("g", 64), "sha256=sha256=",
	} {
		f.Add(s)
	}
	v := mustVerifier(f, NewGitHub, VerifierConfig{Secrets: []string{githubVectorSecret}})
	f.Fuzz(func(t *testing.T, h string) {
		if sig, err := parseGitHubSignature(h); err == nil {
			if len(sig) != sha256.Size || formatGitHubSignature(sig) != "sha256="+strings.ToLower(h[len("sha256="):]) {
				t.Fatalf("%q parsed to %x", h, sig)
			}
		}
		// Any 32 bytes (here derived from the input) survive a round trip.
		sum := sha256.Sum256([]byte(h))
		if got, err := parseGitHubSignature(formatGitHubSignature(sum[:])); err != nil || !bytes.Equal(got, sum[:]) {
			t.Fatalf("round trip of %x: %x, %v", sum, got, err)
		}
		if strings.EqualFold(h, githubVectorSig) {
			return
		}
		r := request(map[string]string{"X-Hub-Signature-256": h, "X-GitHub-Delivery": "d-1"})
		neverAccepts(t, v, r, []byte(githubVectorBody), time.Time{})
	})
}
