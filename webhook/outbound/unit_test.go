package outbound

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The Standard Webhooks specification's test vector.
const (
	vecSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	vecID     = "msg_p5jXN8AQM9LWM0D4loKWxJek"
	vecTS     = 1614265330
	vecBody   = `{"test": 2432232314}`
	vecSig    = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
)

func TestSignSpecTestVector(t *testing.T) {
	t.Parallel()
	got, err := Sign([]string{vecSecret}, vecID, time.Unix(vecTS, 0), []byte(vecBody))
	if err != nil {
		t.Fatal(err)
	}
	if got != vecSig {
		t.Errorf("Sign = %q, want the spec's %q", got, vecSig)
	}
	// The independent verifier agrees with the spec's vector too, so it can
	// judge the dispatcher's requests.
	if !verifyStandardWebhooks(vecSecret, vecID, "1614265330", []byte(vecBody), vecSig) {
		t.Error("the test's own verifier rejects the spec's test vector")
	}
	if verifyStandardWebhooks(vecSecret, vecID, "1614265331", []byte(vecBody), vecSig) {
		t.Error("the test's own verifier accepts a changed timestamp")
	}

	// Two secrets (rotation): one signature each, each verifiable alone.
	other, err := NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	both, err := Sign([]string{vecSecret, other}, vecID, time.Unix(vecTS, 0), []byte(vecBody))
	if err != nil {
		t.Fatal(err)
	}
	parts := strings.Split(both, " ")
	if len(parts) != 2 || parts[0] != vecSig {
		t.Fatalf("Sign with two secrets = %q, want the vector's signature then a second one", both)
	}
	for _, s := range []string{vecSecret, other} {
		if !verifyStandardWebhooks(s, vecID, "1614265330", []byte(vecBody), both) {
			t.Errorf("signature header does not verify with secret %.10s...", s)
		}
	}
}

func TestSecretValidation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		secret string
		ok     bool
	}{
		{vecSecret, true},
		{"MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", false},    // no whsec_ prefix
		{"whsec_not base64!", false},                   // not base64
		{"whsec_c2hvcnQ=", false},                      // 5 bytes: too short
		{"whsec_" + strings.Repeat("QUFB", 30), false}, // 90 bytes: too long
	} {
		_, err := decodeSecrets([]string{tc.secret})
		if (err == nil) != tc.ok {
			t.Errorf("decodeSecrets(%q) err = %v, want ok=%v", tc.secret, err, tc.ok)
		}
		if err != nil && strings.Contains(err.Error(), tc.secret) {
			t.Errorf("error %q quotes the secret", err)
		}
	}
	s, err := NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := decodeSecrets([]string{s}); err != nil {
		t.Errorf("NewSecret() = %q is not accepted: %v", s, err)
	}
}

func TestValidateURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url    string
		ok     bool
		scheme bool // refused for its scheme
	}{
		{"https://example.com/hook", true, false},
		{"http://example.com:8080/hook?x=1", true, false},
		{"ftp://example.com/hook", false, true},
		{"file:///etc/passwd", false, true},
		{"gopher://example.com/", false, true},
		{"javascript:alert(1)", false, true},
		{"https:///nohost", false, false},
		{"https://example.com/#frag", false, false},
		{"://bad", false, false},
	} {
		err := ValidateURL(tc.url)
		if (err == nil) != tc.ok {
			t.Errorf("ValidateURL(%q) = %v, want ok=%v", tc.url, err, tc.ok)
		}
		if tc.scheme && !errors.Is(err, ErrScheme) {
			t.Errorf("ValidateURL(%q) = %v, want ErrScheme", tc.url, err)
		}
	}
	if err := validateEventTypes([]string{"order.*", "*", "invoice.paid"}); err != nil {
		t.Errorf("valid event types refused: %v", err)
	}
	for _, bad := range []string{"", "or*der", "order*", "*.paid"} {
		if err := validateEventTypes([]string{bad}); err == nil {
			t.Errorf("event type %q accepted", bad)
		}
	}
}

func TestGuard(t *testing.T) {
	t.Parallel()
	deny := guard{}
	for _, tc := range []struct {
		addr   string
		reason string // "" = allowed
	}{
		{"127.0.0.1", "loopback"},
		{"127.8.9.10", "loopback"},
		{"::1", "loopback"},
		{"::ffff:127.0.0.1", "loopback"}, // IPv4-mapped
		{"169.254.169.253", "link-local"},
		{"fd00:ec2::1", "unique local"},
		{"10.1.2.3", "private"},
		{"172.16.0.1", "private"},
		{"172.31.255.255", "private"},
		{"192.168.1.1", "private"},
		{"fd12:3456::1", "unique local"},
		{"fe80::1", "link-local"},
		{"fe80::1%eth0", "link-local"}, // zoned
		{"0.0.0.0", "unspecified"},
		{"::", "unspecified"},
		{"224.0.0.1", "multicast"},
		{"ff02::1", "multicast"},
		{"100.64.0.1", "carrier-grade NAT"},
		{"100.127.255.254", "carrier-grade NAT"},
		{"255.255.255.255", "reserved"},
		{"64:ff9b::a9fe:a9fe", "cloud metadata"}, // NAT64 of 169.254.169.254
		{"64:ff9b::a9fe:1", "link-local"},        // NAT64 of 169.254.0.1
		{"2002:7f00:1::1", "loopback"},           // 6to4 of 127.0.0.1
		{"8.8.8.8", ""},
		{"1.1.1.1", ""},
		{"172.32.0.1", ""},  // just outside 172.16/12
		{"100.128.0.1", ""}, // just outside 100.64/10
		{"2606:4700:4700::1111", ""},
		{"64:ff9b::808:808", ""}, // NAT64 of 8.8.8.8

		// Every IPv6 form that embeds an IPv4 address is judged by it.
		{"::ffff:10.0.0.1", "private"},                       // IPv4-mapped
		{"::ffff:169.254.169.254", "cloud metadata"},         // IPv4-mapped metadata
		{"::127.0.0.1", "loopback"},                          // IPv4-compatible
		{"::10.1.2.3", "private"},                            // IPv4-compatible
		{"::a9fe:a9fe", "cloud metadata"},                    // IPv4-compatible 169.254.169.254
		{"::8.8.8.8", "IPv4-compatible"},                     // deprecated form: refused whatever it embeds
		{"::ffff:0:127.0.0.1", "loopback"},                   // IPv4-translated (SIIT)
		{"::ffff:0:8.8.8.8", "IPv4-translated"},              // refused whatever it embeds
		{"64:ff9b::127.0.0.1", "loopback"},                   // NAT64
		{"64:ff9b::10.0.0.1", "private"},                     // NAT64
		{"64:ff9b::100.100.100.200", "Alibaba"},              // NAT64 metadata
		{"64:ff9b:1:7f00:0:100::", "loopback"},               // local-use NAT64 /48 of 127.0.0.1
		{"64:ff9b:1:808:8:800::", "local-use NAT64"},         // local-use NAT64 of 8.8.8.8: refused
		{"2002:a9fe:a9fe::1", "cloud metadata"},              // 6to4 of 169.254.169.254
		{"2002:c0a8:101::1", "private"},                      // 6to4 of 192.168.1.1
		{"2002:0a00:0001::", "private"},                      // 6to4 of 10.0.0.1
		{"2002:808:808::1", ""},                              // 6to4 of 8.8.8.8
		{"2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"}, // Teredo, client 127.0.0.1
		{"2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"},   // Teredo of a public client
		{"2001:db8::5efe:a00:1", "private"},                  // ISATAP of 10.0.0.1 (under a documentation prefix)
		{"2606:4700::5efe:7f00:1", "loopback"},               // ISATAP of 127.0.0.1
		{"2606:4700::200:5efe:a9fe:a9fe", "cloud metadata"},  // ISATAP, universal bit set

		// Cloud metadata and platform addresses.
		{"169.254.169.254", "cloud metadata"},
		{"169.254.170.2", "ECS"},
		{"fd00:ec2::254", "AWS IMDS over IPv6"},
		{"fd20:ce::254", "GCP"},
		{"168.63.129.16", "Azure"},
		{"100.100.100.200", "Alibaba"},
		{"192.0.0.192", "Oracle"},
		{"169.254.0.23", "Tencent"},
		{"192.0.2.1", "documentation"},
		{"2001:db8::1", "documentation"},
		{"100::1", "discard"},
	} {
		err := deny.check(netip.MustParseAddr(tc.addr))
		if tc.reason == "" {
			if err != nil {
				t.Errorf("check(%s) = %v, want allowed", tc.addr, err)
			}
			continue
		}
		var ae *AddressError
		if !errors.As(err, &ae) || !strings.Contains(ae.Reason, tc.reason) {
			t.Errorf("check(%s) = %v, want an AddressError for %q", tc.addr, err, tc.reason)
		}
	}
	// An explicit allow-list opens exactly what it lists.
	allow := guard{allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("169.254.169.254/32")}}
	for _, a := range []string{"127.0.0.1", "::ffff:127.0.0.1", "169.254.169.254"} {
		if err := allow.check(netip.MustParseAddr(a)); err != nil {
			t.Errorf("allow-listed %s refused: %v", a, err)
		}
	}
	for _, a := range []string{"169.254.169.253", "10.0.0.1", "::1"} {
		if err := allow.check(netip.MustParseAddr(a)); err == nil {
			t.Errorf("%s allowed by an allow-list that does not contain it", a)
		}
	}
	// A metadata address stays closed inside an allow-listed range; only
	// the single address opens it.
	wide := guard{allow: []netip.Prefix{netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("168.63.0.0/16"),
		netip.MustParsePrefix("64:ff9b::/96")}}
	for _, a := range []string{"169.254.169.254", "168.63.129.16", "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe"} {
		if err := wide.check(netip.MustParseAddr(a)); err == nil {
			t.Errorf("metadata address %s allowed by a range that contains it", a)
		}
	}
	if err := wide.check(netip.MustParseAddr("169.254.1.1")); err != nil {
		t.Errorf("allow-listed link-local 169.254.1.1 refused: %v", err)
	}
	exact := guard{allow: []netip.Prefix{netip.MustParsePrefix("168.63.129.16/32")}}
	if err := exact.check(netip.MustParseAddr("168.63.129.16")); err != nil {
		t.Errorf("metadata address listed as a single address refused: %v", err)
	}
	// metadata.google.internal and its kind are refused by name, before
	// resolution; what they resolve to (169.254.169.254) by address.
	for _, host := range []string{"metadata.google.internal", "METADATA.GOOGLE.INTERNAL.", "metadata", "instance-data.ec2.internal", "metadata.tencentyun.com"} {
		err := ValidateURL("http://" + host + "/computeMetadata/v1/")
		var he *HostError
		if !errors.As(err, &he) {
			t.Errorf("ValidateURL(http://%s/) = %v, want a HostError", host, err)
		}
	}
	if err := deny.control("tcp4", "169.254.169.254:80", nil); err == nil {
		t.Error("control allowed the address metadata.google.internal resolves to")
	}
	// The dial-time hook parses the resolved address.
	if err := deny.control("tcp4", "169.254.169.254:80", nil); err == nil {
		t.Error("control allowed 169.254.169.254:80")
	}
	if err := deny.control("tcp6", "[2606:4700:4700::1111]:443", nil); err != nil {
		t.Errorf("control refused a public address: %v", err)
	}
}

func TestParseRetryAfter(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		h    string
		want time.Duration
		ok   bool
	}{
		{"", 0, false},
		{"0", 0, true},
		{"7", 7 * time.Second, true},
		{" 120 ", 2 * time.Minute, true},
		{"-3", 0, false},
		{"1.5", 0, false},
		{"soon", 0, false},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), 0, true}, // in the past: no wait
		{"99999999999999999999", 0, false},                     // overflows uint64
		{"9999999999", 365 * 24 * time.Hour, true},             // absurd: clamped (and capped later)
	} {
		got, ok := parseRetryAfter(tc.h, now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("parseRetryAfter(%q) = %s, %v; want %s, %v", tc.h, got, ok, tc.want, tc.ok)
		}
	}
}

// testDispatcher is a Dispatcher for pure decision tests (no database use).
func testDispatcher(t *testing.T, mut func(*DispatcherConfig)) *Dispatcher {
	t.Helper()
	cfg := DispatcherConfig{Pool: &pgxpool.Pool{}, MaxAttempts: 3, RetryBaseDelay: time.Second, RetryMaxDelay: 8 * time.Second,
		MaxRetryAfter: time.Minute}
	if mut != nil {
		mut(&cfg)
	}
	d, err := NewDispatcher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestDecide(t *testing.T) {
	t.Parallel()
	d := testDispatcher(t, nil)
	now := time.Now()
	for _, tc := range []struct {
		status     int
		retryAfter string
		want       DeliveryStatus
		kind       outcomeKind
	}{
		{200, "", StatusDelivered, success},
		{202, "", StatusDelivered, success},
		{204, "", StatusDelivered, success},
		{408, "", StatusPending, failure},
		{425, "", StatusPending, failure},
		{429, "", StatusPending, failure},
		{500, "", StatusPending, failure},
		{502, "", StatusPending, failure},
		{503, "5", StatusPending, failure},
		{301, "", StatusPending, failure}, // redirects are not followed
		{400, "", StatusDead, neutral},
		{401, "", StatusDead, neutral},
		{403, "", StatusDead, neutral},
		{404, "", StatusDead, neutral},
		{410, "", StatusDead, neutral},
		{413, "", StatusDead, neutral},
		{422, "", StatusDead, neutral},
	} {
		dec := d.decide(&job{attempt: 1}, result{status: tc.status, retryAfter: tc.retryAfter}, false, now)
		if dec.status != tc.want || dec.kind != tc.kind || dec.lastStatus != tc.status {
			t.Errorf("HTTP %d: decision %+v, want status %s kind %d", tc.status, dec, tc.want, tc.kind)
		}
		if dec.status == StatusPending && tc.retryAfter == "" && (dec.delay < 0 || dec.delay > d.backoff.Ceiling(1)) {
			t.Errorf("HTTP %d: retry delay %s outside [0, %s]", tc.status, dec.delay, d.backoff.Ceiling(1))
		}
	}

	// Retry-After replaces the backoff and throttles the endpoint; it is capped.
	dec := d.decide(&job{attempt: 1}, result{status: 429, retryAfter: "30"}, false, now)
	if dec.delay != 30*time.Second || dec.retryAfter != 30*time.Second {
		t.Errorf("429 Retry-After: 30: delay %s, throttle %s; want 30s, 30s", dec.delay, dec.retryAfter)
	}
	dec = d.decide(&job{attempt: 1}, result{status: 503, retryAfter: "86400"}, false, now)
	if dec.delay != time.Minute {
		t.Errorf("503 Retry-After: 86400 with MaxRetryAfter 1m: delay %s, want 1m", dec.delay)
	}
	dec = d.decide(&job{attempt: 1}, result{status: 429, retryAfter: now.Add(20 * time.Second).Format(http.TimeFormat)}, false, now)
	if dec.delay < 19*time.Second || dec.delay > 20*time.Second {
		t.Errorf("429 Retry-After as an HTTP date 20s ahead: delay %s", dec.delay)
	}

	// The last attempt's failure is final.
	dec = d.decide(&job{attempt: 3}, result{status: 500, body: []byte("boom")}, false, now)
	if dec.status != StatusDead || !strings.Contains(dec.lastError, "exhausted") || !strings.Contains(dec.lastError, "boom") {
		t.Errorf("HTTP 500 on the last attempt: %+v, want dead, exhausted, quoting the body", dec)
	}
	// Network errors retry; refused addresses are final; shutdown reschedules at once.
	dec = d.decide(&job{attempt: 1}, result{err: errors.New("connection refused")}, false, now)
	if dec.status != StatusPending || dec.kind != failure {
		t.Errorf("network error: %+v, want a retry counted as a failure", dec)
	}
	dec = d.decide(&job{attempt: 1}, result{err: &AddressError{Addr: netip.MustParseAddr("127.0.0.1"), Reason: "loopback"}}, false, now)
	if dec.status != StatusDead || dec.kind != neutral || !dec.refused {
		t.Errorf("refused address: %+v, want dead, neutral, refused", dec)
	}
	dec = d.decide(&job{attempt: 1}, result{err: errors.New("context canceled")}, true, now)
	if dec.status != StatusPending || dec.delay != 0 || dec.kind != neutral || !dec.interrupted {
		t.Errorf("interrupted: %+v, want pending at once, neutral", dec)
	}
	// A long body is quoted only in part.
	dec = d.decide(&job{attempt: 1}, result{status: 400, body: []byte(strings.Repeat("x", 10000))}, false, now)
	if len(dec.lastError) > 400 {
		t.Errorf("last error of %d bytes for a 10000-byte body", len(dec.lastError))
	}
}

func TestBreakerTransition(t *testing.T) {
	t.Parallel()
	c := BreakerConfig{FailureThreshold: 3, CoolDown: 10 * time.Second, PauseAfter: time.Hour}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	b := Breaker{}
	var pause bool
	for i := 1; i <= 2; i++ {
		b, pause = c.transition(b, failure, false, 0, t0.Add(time.Duration(i)*time.Second))
		if b.State != BreakerClosed || b.ConsecutiveFailures != i || pause {
			t.Fatalf("after %d failures: %+v pause=%v, want closed", i, b, pause)
		}
	}
	if !b.FailingSince.Equal(t0.Add(time.Second)) {
		t.Errorf("FailingSince = %s, want the first failure's time", b.FailingSince)
	}
	b, _ = c.transition(b, failure, false, 0, t0.Add(3*time.Second))
	if b.State != BreakerOpen || !b.OpenUntil.Equal(t0.Add(13*time.Second)) {
		t.Fatalf("third failure: %+v, want open until t0+13s", b)
	}
	// A straggler's failure while open changes only the count.
	openUntil := b.OpenUntil
	b, _ = c.transition(b, failure, false, 0, t0.Add(4*time.Second))
	if b.State != BreakerOpen || !b.OpenUntil.Equal(openUntil) || b.ConsecutiveFailures != 4 {
		t.Fatalf("straggler failure while open: %+v", b)
	}
	// The probe (claimed by SQL: half-open with a token) fails: open again, fresh cool-down.
	b.State, b.ProbeToken, b.ProbeExpiresAt = BreakerHalfOpen, uuid.New(), t0.Add(time.Minute)
	b, _ = c.transition(b, failure, true, 0, t0.Add(20*time.Second))
	if b.State != BreakerOpen || !b.OpenUntil.Equal(t0.Add(30*time.Second)) || b.ProbeToken != uuid.Nil {
		t.Fatalf("failed probe: %+v, want open until t0+30s, probe released", b)
	}
	// A neutral probe (e.g. a 410) releases the probe slot only.
	b.State, b.ProbeToken = BreakerHalfOpen, uuid.New()
	b2, _ := c.transition(b, neutral, true, 0, t0.Add(31*time.Second))
	if b2.State != BreakerOpen || b2.ProbeToken != uuid.Nil || b2.ConsecutiveFailures != b.ConsecutiveFailures {
		t.Fatalf("neutral probe: %+v", b2)
	}
	// Retry-After throttles the endpoint.
	b3, _ := c.transition(Breaker{}, failure, false, 5*time.Second, t0)
	if !b3.ThrottledUntil.Equal(t0.Add(5 * time.Second)) {
		t.Errorf("Retry-After 5s: ThrottledUntil %s", b3.ThrottledUntil)
	}
	// Failing for PauseAfter pauses.
	_, pause = c.transition(b, failure, false, 0, b.FailingSince.Add(time.Hour))
	if !pause {
		t.Error("a failure an hour after FailingSince did not ask for a pause")
	}
	// Any success closes and forgets.
	b, pause = c.transition(b, success, false, 0, t0.Add(time.Hour))
	if b.State != BreakerClosed || b.ConsecutiveFailures != 0 || !b.FailingSince.IsZero() || !b.OpenUntil.IsZero() || pause {
		t.Errorf("success: %+v, want closed and clean", b)
	}
	// PauseAfter < 0: never.
	never := BreakerConfig{FailureThreshold: 3, CoolDown: time.Second, PauseAfter: -1}
	if _, p := never.transition(Breaker{FailingSince: t0}, failure, false, 0, t0.Add(1000*time.Hour)); p {
		t.Error("PauseAfter < 0 paused")
	}
}

func TestDispatcherConfigValidation(t *testing.T) {
	t.Parallel()
	pool := &pgxpool.Pool{}
	for _, tc := range []struct {
		cfg   DispatcherConfig
		field string
	}{
		{DispatcherConfig{}, "Pool"},
		{DispatcherConfig{Pool: pool, Store: Config{Schema: `x"; drop table y`}}, "Config.Schema"},
		{DispatcherConfig{Pool: pool, Workers: -1}, "Workers"},
		{DispatcherConfig{Pool: pool, MaxInFlightPerEndpoint: -2}, "MaxInFlightPerEndpoint"},
		{DispatcherConfig{Pool: pool, RequestTimeout: -time.Second}, "RequestTimeout"},
		{DispatcherConfig{Pool: pool, RequestTimeout: 10 * time.Second, LeaseDuration: 10 * time.Second}, "LeaseDuration"},
		{DispatcherConfig{Pool: pool, RetryBaseDelay: time.Minute, RetryMaxDelay: time.Second}, "RetryMaxDelay"},
		{DispatcherConfig{Pool: pool, MaxAttempts: 5000}, "MaxAttempts"},
		{DispatcherConfig{Pool: pool, Breaker: BreakerConfig{FailureThreshold: -1}}, "Breaker.FailureThreshold"},
		{DispatcherConfig{Pool: pool, Breaker: BreakerConfig{CoolDown: -1}}, "Breaker.CoolDown"},
		{DispatcherConfig{Pool: pool, AllowNetworks: []netip.Prefix{{}}}, "AllowNetworks[0]"},
	} {
		_, err := NewDispatcher(tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("NewDispatcher(%+v) = %v, want an error naming %s", tc.cfg, err, tc.field)
		}
	}
	d, err := NewDispatcher(DispatcherConfig{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	c := d.cfg
	if c.Workers != DefaultWorkers || c.MaxInFlightPerEndpoint != DefaultMaxInFlightPerEndpoint ||
		c.RequestTimeout != DefaultRequestTimeout || c.LeaseDuration != DefaultRequestTimeout+DefaultLeaseMargin ||
		c.MaxAttempts != DefaultMaxAttempts || c.Breaker.FailureThreshold != DefaultFailureThreshold ||
		c.Breaker.PauseAfter != DefaultPauseAfter || c.DrainTimeout != DefaultRequestTimeout || c.ID == "" {
		t.Errorf("defaults not applied: %+v", c)
	}
	if _, err := NewStore(Config{Schema: "Bad-Name"}); err == nil || !strings.Contains(err.Error(), "Config.Schema") {
		t.Errorf("NewStore with a bad schema: %v", err)
	}
}

// FuzzGuard: whatever the address, check never panics; an IPv4 address and
// every IPv6 form that embeds it (mapped, compatible, translated, NAT64,
// 6to4) are refused alike whenever the IPv4 address is refused; and a
// metadata address is refused by a guard that allows everything else.
func FuzzGuard(f *testing.F) {
	for _, seed := range []string{
		"127.0.0.1", "10.0.0.1", "169.254.169.254", "168.63.129.16", "100.100.100.200", "192.0.0.192", "8.8.8.8",
		"::ffff:127.0.0.1", "::127.0.0.1", "::ffff:0:127.0.0.1", "64:ff9b::7f00:1", "64:ff9b:1:7f00:0:100::",
		"2002:7f00:1::", "2001:0:4136:e378:8000:63bf:80ff:fffe", "fd00:ec2::254", "2606:4700::5efe:7f00:1",
	} {
		b := netip.MustParseAddr(seed).As16()
		f.Add(b[:])
	}
	deny := guard{}
	everything := guard{allow: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")}}
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) != 16 {
			return
		}
		a := netip.AddrFrom16([16]byte(b))
		_ = deny.check(a)
		// The IPv4 address in the last four bytes, in every embedding form.
		v4 := netip.AddrFrom4([4]byte(b[12:]))
		refused := deny.check(v4) != nil
		b4 := v4.As4()
		for _, form := range []netip.Addr{
			netip.AddrFrom16([16]byte{10: 0xff, 11: 0xff, 12: b4[0], 13: b4[1], 14: b4[2], 15: b4[3]}),        // mapped
			netip.AddrFrom16([16]byte{12: b4[0], 13: b4[1], 14: b4[2], 15: b4[3]}),                            // compatible
			netip.AddrFrom16([16]byte{8: 0xff, 9: 0xff, 12: b4[0], 13: b4[1], 14: b4[2], 15: b4[3]}),          // translated
			netip.AddrFrom16([16]byte{1: 0x64, 2: 0xff, 3: 0x9b, 12: b4[0], 13: b4[1], 14: b4[2], 15: b4[3]}), // NAT64
			netip.AddrFrom16([16]byte{0: 0x20, 1: 0x02, 2: b4[0], 3: b4[1], 4: b4[2], 5: b4[3], 15: 1}),       // 6to4
		} {
			if refused && deny.check(form) == nil {
				t.Fatalf("%s is refused but %s, which embeds it, is allowed", v4, form)
			}
		}
		if _, meta := metadata[v4]; meta && everything.check(v4) == nil {
			t.Fatalf("metadata address %s allowed by an allow-everything list", v4)
		}
	})
}

// TestCredentialsNeverShown: RedactURL hides userinfo and credential query
// parameters and keeps the rest; Subscription's String, GoString and
// LogValue, ValidateURL's errors and a failed attempt's last_error never
// show a credential of the URL, although the request is sent to it.
func TestCredentialsNeverShown(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"https://example.com/hooks?x=1", "https://example.com/hooks?x=1"},
		{"https://alice:s3cr3t@example.com/hooks", "https://REDACTED@example.com/hooks"},
		{"https://tok3n@example.com/hooks", "https://REDACTED@example.com/hooks"},
		{"https://example.com/h?token=abc&x=1&api_key=def&Access_Token=ghi", "https://example.com/h?token=REDACTED&x=1&api_key=REDACTED&Access_Token=REDACTED"},
		{"https://example.com/h?X-Amz-Credential=AKIA&X-Amz-Signature=ff&sig=zz&key=k&client_secret=c", "https://example.com/h?X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED&sig=REDACTED&key=REDACTED&client_secret=REDACTED"},
		{"https://example.com/h?password=p%20w&flag", "https://example.com/h?password=REDACTED&flag"},
		{"https://u:p@exa mple.com/%zz", "(a URL that does not parse, 28 bytes)"},
	} {
		if got := RedactURL(tc.in); got != tc.want {
			t.Errorf("RedactURL(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}

	const secretURL = "http://alice:pw-SECRET1@127.0.0.1:1/hooks?token=SECRET2&x=1"
	leaks := func(what, s string) {
		t.Helper()
		for _, secret := range []string{"alice", "SECRET1", "SECRET2", "whsec_SECRET3"} {
			if strings.Contains(s, secret) {
				t.Errorf("%s shows %q: %s", what, secret, s)
			}
		}
	}
	sub := Subscription{URL: secretURL, Secrets: []string{"whsec_SECRET3"}, EventTypes: []string{"order.*"}}
	var logs strings.Builder
	slog.New(slog.NewTextHandler(&logs, nil)).Info("sub", "sub", sub)
	for what, s := range map[string]string{
		"%v": fmt.Sprintf("%v", sub), "%+v": fmt.Sprintf("%+v", sub), "%#v": fmt.Sprintf("%#v", sub), "%s": fmt.Sprint(sub),
		"%v of a pointer": fmt.Sprintf("%v", &sub), "an Overview": fmt.Sprintf("%+v", Overview{Subscription: sub}), "slog": logs.String(),
	} {
		leaks(what, s)
		if !strings.Contains(s, "127.0.0.1") {
			t.Errorf("%s does not show the endpoint: %s", what, s)
		}
	}
	for _, bad := range []string{"http://alice:pw-SECRET1@/hooks?token=SECRET2", "http://alice:pw-SECRET1@h/x?token=SECRET2#frag", "http://alice:pw-SECRET1@h/%zz?token=SECRET2"} {
		err := ValidateURL(bad)
		if err == nil {
			t.Fatalf("ValidateURL(%q) accepted it", bad)
		}
		leaks("ValidateURL's error", err.Error())
	}

	// The attempt fails to connect (nothing listens on port 1); its error,
	// recorded as last_error and logged, names the endpoint redacted.
	d := testDispatcher(t, func(c *DispatcherConfig) {
		c.AllowNetworks = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	})
	res := d.send(t.Context(), &job{url: secretURL, secrets: []string{mustSecret(t)}, webhookID: "msg_1", attempt: 1})
	if res.err == nil {
		t.Fatal("an attempt to a closed port succeeded")
	}
	dec := d.decide(&job{attempt: 1}, res, false, time.Now())
	leaks("last_error", dec.lastError)
	if !strings.Contains(dec.lastError, "REDACTED") {
		t.Errorf("last_error %q does not name the endpoint", dec.lastError)
	}
}

func mustSecret(t *testing.T) string {
	t.Helper()
	s, err := NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	return s
}
