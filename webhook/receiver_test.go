package webhook

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/outbox"
)

// These tests need no database: the Receiver's pool points at a port where
// nothing listens, so any attempt to store answers 503. A refusal that
// shows up as 4xx, with Stats().Failed still zero, therefore never reached
// the database. The integration tests (integration_test/webhook_test.go)
// cover storing against a real Postgres.

// deadPool returns a pool whose every connection attempt is refused.
func deadPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	l, err := (&net.ListenConfig{}).Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close() // free again: connecting is refused
	p, err := pgxpool.New(context.Background(), "postgres://nobody@"+addr+"/none?sslmode=disable&connect_timeout=5")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

const testSecret = specSecret

func newTestReceiver(t *testing.T, mutate func(*Config)) (*Receiver, *httptest.Server) {
	t.Helper()
	cfg := Config{Pool: deadPool(t), Topic: "webhooks", Verifier: mustVerifier(t, NewStandardWebhooks, VerifierConfig{Secrets: []string{testSecret}})}
	if mutate != nil {
		mutate(&cfg)
	}
	rc, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(rc)
	t.Cleanup(srv.Close)
	return rc, srv
}

// signedRequest returns a Standard Webhooks delivery signed with secret now.
func signedRequest(t *testing.T, url, secret, id string, body io.Reader, signedBody string, ts time.Time) *http.Request {
	t.Helper()
	r, err := http.NewRequestWithContext(t.Context(), http.MethodPost, url, body)
	if err != nil {
		t.Fatal(err)
	}
	tss := strconv.FormatInt(ts.Unix(), 10)
	r.Header.Set("webhook-id", id)
	r.Header.Set("webhook-timestamp", tss)
	r.Header.Set("webhook-signature", swSign(t, secret, id, tss, signedBody))
	return r
}

func do(t *testing.T, r *http.Request) (int, http.Header, string) {
	t.Helper()
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, string(b)
}

// chunked hides a reader's length, so the client sends it chunked and the
// server learns the size only by reading.
type chunked struct{ io.Reader }

func TestReceiverRefusesBeforeStoring(t *testing.T) {
	const limit = 1024
	rc, srv := newTestReceiver(t, func(c *Config) { c.MaxBodyBytes = limit })
	now := time.Now()
	fits := strings.Repeat("x", limit)
	over := strings.Repeat("x", limit+1)
	cases := []struct {
		name   string
		req    func() *http.Request
		status int
		check  func(t *testing.T, h http.Header, body string)
	}{
		{name: "GET", status: http.StatusMethodNotAllowed, req: func() *http.Request {
			r, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, srv.URL, nil)
			return r
		}, check: func(t *testing.T, h http.Header, _ string) {
			if h.Get("Allow") != http.MethodPost {
				t.Errorf("Allow: %q, want POST", h.Get("Allow"))
			}
		}},
		{name: "PUT, even signed", status: http.StatusMethodNotAllowed, req: func() *http.Request {
			r := signedRequest(t, srv.URL, testSecret, "msg_put", strings.NewReader("{}"), "{}", now)
			r.Method = http.MethodPut
			return r
		}},
		{name: "oversized and unsigned, with Content-Length", status: http.StatusRequestEntityTooLarge, req: func() *http.Request {
			r, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader(over))
			return r
		}},
		{name: "oversized and signed, chunked", status: http.StatusRequestEntityTooLarge, req: func() *http.Request {
			return signedRequest(t, srv.URL, testSecret, "msg_big", chunked{strings.NewReader(over)}, over, now)
		}},
		{name: "oversized and unsigned, chunked", status: http.StatusRequestEntityTooLarge, req: func() *http.Request {
			r, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, chunked{strings.NewReader(over)})
			return r
		}},
		{name: "exactly the limit, badly signed, gets past the size check", status: http.StatusUnauthorized, req: func() *http.Request {
			return signedRequest(t, srv.URL, testSecret, "msg_fits", strings.NewReader(fits), fits+"tampered", now)
		}},
		{name: "unsigned", status: http.StatusUnauthorized, req: func() *http.Request {
			r, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader("{}"))
			return r
		}, check: func(t *testing.T, _ http.Header, body string) {
			if !strings.Contains(body, "missing signature") {
				t.Errorf("body %q does not say what is wrong", body)
			}
		}},
		{name: "wrong secret", status: http.StatusUnauthorized, req: func() *http.Request {
			return signedRequest(t, srv.URL, "whsec_b3RoZXItc2VjcmV0LW5vYm9keS1jb25maWd1cmVk", "msg_x", strings.NewReader("{}"), "{}", now)
		}},
		{name: "stale", status: http.StatusUnauthorized, req: func() *http.Request {
			return signedRequest(t, srv.URL, testSecret, "msg_old", strings.NewReader("{}"), "{}", now.Add(-DefaultTolerance-time.Minute))
		}, check: func(t *testing.T, _ http.Header, body string) {
			if !strings.Contains(body, "timestamp outside tolerance") {
				t.Errorf("body %q does not say what is wrong", body)
			}
		}},
		{name: "future", status: http.StatusUnauthorized, req: func() *http.Request {
			return signedRequest(t, srv.URL, testSecret, "msg_new", strings.NewReader("{}"), "{}", now.Add(DefaultTolerance+time.Minute))
		}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			status, h, body := do(t, c.req())
			if status != c.status {
				t.Fatalf("status %d (%s), want %d", status, body, c.status)
			}
			if c.check != nil {
				c.check(t, h, body)
			}
			if st := rc.Stats(); st != (Stats{Refused: int64(i + 1)}) {
				t.Fatalf("stats %+v: want %d refusals and nothing else", st, i+1)
			}
		})
	}
}

// An authentic delivery that cannot be stored is answered 503 with
// Retry-After, never 2xx.
func TestReceiverDatabaseDownAnswers503(t *testing.T) {
	rc, srv := newTestReceiver(t, nil)
	status, h, body := do(t, signedRequest(t, srv.URL, testSecret, "msg_1", strings.NewReader("{}"), "{}", time.Now()))
	if status != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
		t.Fatalf("status %d, Retry-After %q (%s); want 503 with Retry-After", status, h.Get("Retry-After"), body)
	}
	if st := rc.Stats(); st != (Stats{Failed: 1}) {
		t.Fatalf("stats %+v, want one failure", st)
	}
}

// verifierFunc adapts a function to Verifier.
type verifierFunc func(r *http.Request, body []byte, now time.Time) (Delivery, error)

func (f verifierFunc) Verify(r *http.Request, body []byte, now time.Time) (Delivery, error) {
	return f(r, body, now)
}

// A custom verifier's *Error chooses the status; any other error is a 401;
// a delivery without a usable id is a 400.
func TestReceiverCustomVerifier(t *testing.T) {
	cases := []struct {
		name   string
		verify verifierFunc
		prefix string
		status int
	}{
		{"typed error", func(*http.Request, []byte, time.Time) (Delivery, error) {
			return Delivery{}, &Error{Status: http.StatusForbidden, Reason: errors.New("source address not allowed")}
		}, "", http.StatusForbidden},
		{"typed error without a reason", func(*http.Request, []byte, time.Time) (Delivery, error) {
			return Delivery{}, &Error{Status: http.StatusTooManyRequests}
		}, "", http.StatusTooManyRequests},
		{"typed error with a status that is not an error", func(*http.Request, []byte, time.Time) (Delivery, error) {
			return Delivery{}, &Error{Status: http.StatusOK, Reason: ErrSignatureMismatch}
		}, "", http.StatusUnauthorized},
		{"plain error fails closed", func(*http.Request, []byte, time.Time) (Delivery, error) {
			return Delivery{}, errors.New("key server unreachable")
		}, "", http.StatusUnauthorized},
		{"no id", func(*http.Request, []byte, time.Time) (Delivery, error) { return Delivery{Provider: "x"}, nil }, "", http.StatusBadRequest},
		{"id too long with the prefix", func(*http.Request, []byte, time.Time) (Delivery, error) {
			return Delivery{ID: strings.Repeat("i", outbox.MaxIDLen-3)}, nil
		}, "acme:", http.StatusBadRequest},
		{"the body reaches the verifier unchanged", func(_ *http.Request, body []byte, _ time.Time) (Delivery, error) {
			if !bytes.Equal(body, []byte(" {\"b\": 1}\n")) {
				return Delivery{}, errors.New("body changed")
			}
			return Delivery{ID: "ok"}, nil
		}, "", http.StatusServiceUnavailable}, // authentic: on to the (dead) database
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, srv := newTestReceiver(t, func(cfg *Config) { cfg.Verifier, cfg.IDPrefix = c.verify, c.prefix })
			r, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader(" {\"b\": 1}\n"))
			if status, _, body := do(t, r); status != c.status {
				t.Fatalf("status %d (%s), want %d", status, body, c.status)
			}
		})
	}
}

func TestReceiverConfigErrors(t *testing.T) {
	pool := deadPool(t)
	v := mustVerifier(t, NewGitHub, VerifierConfig{Secrets: []string{"s"}})
	ok := Config{Pool: pool, Topic: "webhooks", Verifier: v}
	cases := []struct {
		name   string
		mutate func(*Config)
		want   string
	}{
		{"no pool", func(c *Config) { c.Pool = nil }, "Config.Pool"},
		{"no topic", func(c *Config) { c.Topic = "" }, "Config.Topic is required"},
		{"bad topic", func(c *Config) { c.Topic = "web hooks" }, `Config.Topic: "web hooks" is not a valid Kafka topic name`},
		{"no verifier", func(c *Config) { c.Verifier = nil }, "Config.Verifier is required"},
		{"negative body limit", func(c *Config) { c.MaxBodyBytes = -1 }, "Config.MaxBodyBytes: -1 is negative"},
		{"negative timeout", func(c *Config) { c.StoreTimeout = -time.Second }, "Config.StoreTimeout: -1s is negative"},
		{"bad schema", func(c *Config) { c.Outbox.Schema = `x"; drop table y` }, "Config.Outbox: outbox: Config.Schema"},
		{"prefix too long", func(c *Config) { c.IDPrefix = strings.Repeat("p", outbox.MaxIDLen) }, "Config.IDPrefix"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := ok
			c.mutate(&cfg)
			if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want it to contain %q", err, c.want)
			}
		})
	}
	if _, err := New(ok); err != nil {
		t.Fatalf("a valid config: %v", err)
	}
}

// The secrets appear in no log line, response or error of the Receiver,
// whatever the request: refusals of every kind and a delivery that cannot be
// stored, logged at debug level. (FuzzVerifierConfig covers the
// constructors' and Verify's errors.)
func TestSecretsStayOutOfLogs(t *testing.T) {
	var logs bytes.Buffer
	const other = "whsec_b3RoZXItc2VjcmV0LW5vYm9keS1jb25maWd1cmVk"
	_, srv := newTestReceiver(t, func(c *Config) {
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	now := time.Now()
	requests := []*http.Request{
		signedRequest(t, srv.URL, testSecret, "msg_ok", strings.NewReader("{}"), "{}", now),                  // 503: no database
		signedRequest(t, srv.URL, other, "msg_wrong", strings.NewReader("{}"), "{}", now),                    // 401: another secret
		signedRequest(t, srv.URL, testSecret, "msg_old", strings.NewReader("{}"), "{}", now.Add(-time.Hour)), // 401: stale
		signedRequest(t, srv.URL, testSecret, "msg_body", strings.NewReader("{ }"), "{}", now),               // 401: body changed
	}
	unsigned, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	requests = append(requests, unsigned)
	var bodies strings.Builder
	for _, r := range requests {
		status, _, body := do(t, r)
		if status < 400 {
			t.Fatalf("%s: status %d, want a refusal or 503", r.Header.Get("webhook-id"), status)
		}
		bodies.WriteString(body)
	}
	key := strings.TrimPrefix(testSecret, "whsec_")
	if strings.Contains(logs.String(), key) || strings.Contains(bodies.String(), key) {
		t.Fatalf("a secret leaked:\nlogs:\n%s\nresponses:\n%s", logs.String(), bodies.String())
	}
	if strings.Count(logs.String(), "request refused") != 4 || !strings.Contains(logs.String(), "delivery not stored") {
		t.Fatalf("want 4 refusals and a failed store logged (else nothing was checked):\n%s", logs.String())
	}
}

// Refused requests are answered tersely: the body names the reason and
// never echoes a request header, the number of secrets tried or the clock
// skew, for every built-in verifier and every kind of refusal; the details
// are in the log, at Info.
func TestRefusalsAreTerse(t *testing.T) {
	const mark = "EchoMark7q"
	now := time.Now()
	ts := strconv.FormatInt(now.Unix(), 10)
	stale := strconv.FormatInt(now.Add(-time.Hour).Unix(), 10)
	future := strconv.FormatInt(now.Add(time.Hour).Unix(), 10)
	const stripeSecret, ghSecret = "whsec_stripe_test_secret", "gh-secret"
	for _, tc := range []struct {
		name     string
		verifier func(t *testing.T) Verifier
		headers  map[string]string
		reason   string // in the body
		logged   string // in the log line's detail
	}{
		{"standard: malformed timestamp", func(t *testing.T) Verifier {
			return mustVerifier(t, NewStandardWebhooks, VerifierConfig{Secrets: []string{testSecret}})
		},
			map[string]string{"webhook-id": "msg_1", "webhook-timestamp": mark, "webhook-signature": "v1,AAAA"}, "malformed header", mark},
		{"standard: no signature matches two secrets", func(t *testing.T) Verifier {
			return mustVerifier(t, NewStandardWebhooks, VerifierConfig{Secrets: []string{testSecret, "whsec_b3RoZXItc2VjcmV0LW5vYm9keS1jb25maWd1cmVk"}})
		}, map[string]string{"webhook-id": "msg_1" + mark, "webhook-timestamp": ts, "webhook-signature": "v1,AAAA v1,BBBB"}, "no signature matches", "2 secret(s)"},
		{"standard: stale", func(t *testing.T) Verifier {
			return mustVerifier(t, NewStandardWebhooks, VerifierConfig{Secrets: []string{testSecret}})
		},
			map[string]string{"webhook-id": "msg_1", "webhook-timestamp": stale, "webhook-signature": swSign(t, testSecret, "msg_1", stale, "{}")},
			"timestamp outside tolerance", "old"},
		{"stripe: malformed item", func(t *testing.T) Verifier {
			return mustVerifier(t, NewStripe, VerifierConfig{Secrets: []string{stripeSecret}})
		},
			map[string]string{"Stripe-Signature": "t=" + ts + "," + mark}, "malformed header", mark},
		{"stripe: future", func(t *testing.T) Verifier {
			return mustVerifier(t, NewStripe, VerifierConfig{Secrets: []string{stripeSecret}})
		},
			map[string]string{"Stripe-Signature": "t=" + future + ",v1=" + stripeSign(stripeSecret, future, "{}")},
			"timestamp outside tolerance", "ahead"},
		{"github: not sha256", func(t *testing.T) Verifier {
			return mustVerifier(t, NewGitHub, VerifierConfig{Secrets: []string{ghSecret}})
		},
			map[string]string{"X-Hub-Signature-256": "md5=" + mark, "X-GitHub-Delivery": "d-1"}, "malformed header", mark},
		{"github: mismatch", func(t *testing.T) Verifier {
			return mustVerifier(t, NewGitHub, VerifierConfig{Secrets: []string{ghSecret}})
		},
			map[string]string{"X-Hub-Signature-256": githubSign("other", "{}"), "X-GitHub-Delivery": mark}, "no signature matches", "1 secret(s)"},
		{"custom verifier quoting a header", func(*testing.T) Verifier {
			return verifierFunc(func(r *http.Request, _ []byte, _ time.Time) (Delivery, error) {
				return Delivery{}, fmt.Errorf("bad token %q", r.Header.Get("Authorization"))
			})
		}, map[string]string{"Authorization": "Bearer " + mark}, "refused", mark},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			_, srv := newTestReceiver(t, func(c *Config) {
				c.Verifier = tc.verifier(t)
				c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
			})
			r, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader("{}"))
			if err != nil {
				t.Fatal(err)
			}
			for k, v := range tc.headers {
				r.Header.Set(k, v)
			}
			status, _, body := do(t, r)
			if status != http.StatusUnauthorized {
				t.Fatalf("status %d (%s), want 401", status, body)
			}
			if want := "webhook: " + tc.reason + "\n"; body != want {
				t.Errorf("body %q, want %q", body, want)
			}
			for _, leak := range []string{mark, "secret", "old", "ahead", "tolerance of"} {
				if strings.Contains(body, leak) {
					t.Errorf("body %q contains %q", body, leak)
				}
			}
			if !strings.Contains(logs.String(), "request refused") || !strings.Contains(logs.String(), tc.logged) {
				t.Errorf("the log does not carry the detail %q:\n%s", tc.logged, logs.String())
			}
		})
	}
	// The method is not echoed either.
	_, srv := newTestReceiver(t, nil)
	r, err := http.NewRequestWithContext(t.Context(), "PROPFIND"+strings.ToUpper(mark), srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	if status, _, body := do(t, r); status != http.StatusMethodNotAllowed || strings.Contains(strings.ToLower(body), strings.ToLower(mark)) {
		t.Errorf("405 %d %q echoes the method", status, body)
	}
}
