package idempotency

import (
	"bytes"
	"net/textproto"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/oncely/oncely/internal/pgtest"
)

// FuzzFingerprint: a fingerprint is 32 bytes and depends on exactly the
// fields it covers: two requests get the same fingerprint when, and only
// when, their method, escaped path, body and (unless IgnoreQuery) raw
// query are equal. Equal fingerprints for different fields would mean the
// encoding is ambiguous (SHA-256 collisions aside), and a retry with another
// body would replay the first request's response instead of answering 422.
func FuzzFingerprint(f *testing.F) {
	f.Add("POST", "/orders", "", []byte(`{"a":1}`), false, "POST", "/orders", "x=1", []byte(`{"a":1}`))
	f.Add("POST", "/orders", "", []byte(`{"a":1}`), true, "POST", "/orders", "x=1", []byte(`{"a":1}`))
	f.Add("POS", "T/orders", "", []byte(nil), false, "POST", "/orders", "", []byte{})
	f.Add("POST", "/a%2Fb", "", []byte("x"), false, "POST", "/a/b", "", []byte("x"))
	f.Add("PATCH", "/o", "a=1&b=2", []byte("{}"), true, "PATCH", "/o", "b=2&a=1", []byte("{}"))
	f.Add("POST", "/o?", "", []byte(""), true, "POST", "/o", "?", []byte(""))
	f.Fuzz(func(t *testing.T, m1, p1, q1 string, b1 []byte, withQuery bool, m2, p2, q2 string, b2 []byte) {
		fp1 := fingerprint(m1, p1, withQuery, q1, b1)
		fp2 := fingerprint(m2, p2, withQuery, q2, b2)
		if len(fp1) != 32 || len(fp2) != 32 {
			t.Fatalf("fingerprints of %d and %d bytes, want 32", len(fp1), len(fp2))
		}
		if again := fingerprint(m1, p1, withQuery, q1, bytes.Clone(b1)); !bytes.Equal(again, fp1) {
			t.Fatal("the fingerprint of the same request changed")
		}
		same := m1 == m2 && p1 == p2 && bytes.Equal(b1, b2) && (!withQuery || q1 == q2)
		if got := bytes.Equal(fp1, fp2); got != same {
			t.Fatalf("(%q %q %q %q) and (%q %q %q %q) with query %v: equal fingerprints %v, equal fields %v",
				m1, p1, q1, b1, m2, p2, q2, b2, withQuery, got, same)
		}
	})
}

// tokenRE is RFC 9110's token: what header names and methods are made of.
var tokenRE = regexp.MustCompile("^[!#$%&'*+\\-.^_`|~0-9A-Za-z]+$")

// configInvalidFields is the test's own reading of Config's documented
// rules: the fields New must refuse.
func configInvalidFields(cfg Config) map[string]bool {
	header := cfg.Header
	if header == "" {
		header = DefaultHeader
	}
	bad := map[string]bool{
		"Schema":           cfg.Schema != "" && !pgtest.SchemaNameValid(cfg.Schema),
		"Header":           !tokenRE.MatchString(header),
		"MaxKeyLength":     cfg.MaxKeyLength < 0 || cfg.MaxKeyLength > MaxKeyLengthLimit,
		"Methods":          cfg.Methods != nil && len(cfg.Methods) == 0,
		"MaxBodyBytes":     cfg.MaxBodyBytes < 0 || cfg.MaxBodyBytes > MaxBytesLimit,
		"MaxResponseBytes": cfg.MaxResponseBytes < 0 || cfg.MaxResponseBytes > MaxBytesLimit,
		"TTL":              cfg.TTL < 0 || (cfg.TTL > 0 && cfg.TTL < time.Second),
		"RetryAfter":       cfg.RetryAfter < 0,
		"CommitTimeout":    cfg.CommitTimeout < 0,
		"CleanupInterval":  cfg.CleanupInterval < 0,
		"CleanupBatchSize": cfg.CleanupBatchSize < 0,
	}
	for _, m := range cfg.Methods {
		bad["Methods"] = bad["Methods"] || !tokenRE.MatchString(m)
	}
	for _, h := range cfg.ReplayHeaders {
		switch textproto.CanonicalMIMEHeaderKey(h) {
		case "Content-Length", "Transfer-Encoding", "Connection", "Keep-Alive", "Proxy-Connection",
			"Proxy-Authenticate", "Proxy-Authorization", "Te", "Trailer", "Upgrade", ReplayedHeader:
			bad["ReplayHeaders"] = true
		}
		bad["ReplayHeaders"] = bad["ReplayHeaders"] || !tokenRE.MatchString(h)
	}
	return bad
}

var configErrorFieldRE = regexp.MustCompile(`^idempotency: Config\.([A-Za-z]+)[: ]`)

// list splits a comma-separated fuzz input: "" is nil, "-" an empty list.
func list(s string) []string {
	switch s {
	case "":
		return nil
	case "-":
		return []string{}
	}
	return strings.Split(s, ",")
}

// FuzzConfig: New never panics; it accepts a config exactly when every field
// is valid, and a refusal names a field that is invalid. Schema names with
// quotes, semicolons or spaces are always refused.
func FuzzConfig(f *testing.F) {
	pool := pgtest.UnreachablePool(f)
	f.Add("", "", 0, "", int64(0), "", int64(0), int64(0), 0)
	f.Add("oncely", "Idempotency-Key", 255, "POST,PATCH", int64(1<<20), "Content-Type,Location", int64(time.Hour), int64(time.Second), 10)
	f.Add(`x"; drop table y`, "Bad Header", -1, "-", int64(-1), "content-length", int64(time.Millisecond), int64(-1), -1)
	f.Add("pg_x", "X-Key", 1025, "GET,PO ST", int64(1<<30), "Idempotent-Replayed,X-A", int64(-time.Second), int64(0), 0)
	f.Fuzz(func(t *testing.T, schema, header string, maxKey int, methods string, maxBody int64, replay string, ttl, retryAfter int64, batch int) {
		cfg := Config{Schema: schema, Header: header, MaxKeyLength: maxKey, Methods: list(methods),
			MaxBodyBytes: maxBody, MaxResponseBytes: maxBody / 2, ReplayHeaders: list(replay),
			TTL: time.Duration(ttl), RetryAfter: time.Duration(retryAfter), CommitTimeout: time.Duration(retryAfter) * 10,
			CleanupBatchSize: batch, CleanupInterval: time.Duration(ttl) / 100}
		m, err := New(pool, cfg)
		if err == nil && (m == nil || strings.ContainsAny(schema, "\"'; \\")) {
			t.Fatalf("New accepted the schema name %q, or returned nothing", schema)
		}
		pgtest.CheckConfigError(t, err, configInvalidFields(cfg), pgtest.FieldMatch(configErrorFieldRE))
	})
}
