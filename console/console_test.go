package console

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
)

func TestNewNamesTheMissingField(t *testing.T) {
	if _, err := New(Config{}); err == nil || !strings.Contains(err.Error(), "Config.Pool") {
		t.Errorf("New without a pool: %v, want an error naming Config.Pool", err)
	}
}

func TestSensitiveHeaders(t *testing.T) {
	for name, want := range map[string]bool{"Authorization": true, "X-Api-Token": true, "Cookie": true, "stripe-signature": true,
		"X-Client-Secret": true, "message-id": false, "traceparent": false, "content-type": false} {
		if got := sensitive(name); got != want {
			t.Errorf("sensitive(%q) = %v, want %v", name, got, want)
		}
	}
}

// The confirmation carries the dry run's last offset per partition, and
// reads it back exactly.
func TestUptoRoundTrip(t *testing.T) {
	entries := []dlq.Entry{{Record: &kgo.Record{Partition: 0, Offset: 4}}, {Record: &kgo.Record{Partition: 2, Offset: 9}},
		{Record: &kgo.Record{Partition: 0, Offset: 7}}}
	s := upto(entries)
	if s != "0:7,2:9" {
		t.Fatalf("upto = %q", s)
	}
	m, err := parseUpto(s)
	if err != nil || len(m) != 2 || m[0] != 7 || m[2] != 9 {
		t.Fatalf("parseUpto(%q) = %v, %v", s, m, err)
	}
	if _, err := parseUpto("0:x"); err == nil {
		t.Error("parseUpto accepted 0:x")
	}
}

func TestBearerToken(t *testing.T) {
	if _, err := BearerToken("short"); err == nil {
		t.Error("a 5-character token was accepted")
	}
	auth, err := BearerToken("0123456789abcdef-token")
	if err != nil {
		t.Fatal(err)
	}
	h := auth(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte(Identity(r.Context()))) }))
	for _, c := range []struct {
		header string
		code   int
	}{{"", 401}, {"Bearer wrong", 401}, {"Bearer 0123456789abcdef-token", 200}} {
		rec := httptest.NewRecorder()
		req := httptest.NewRequestWithContext(context.Background(), http.MethodGet, "/dlq", nil)
		if c.header != "" {
			req.Header.Set("Authorization", c.header)
		}
		h.ServeHTTP(rec, req)
		if rec.Code != c.code || (c.code == 200 && rec.Body.String() != "token") {
			t.Errorf("Authorization %q: %d %q, want %d", c.header, rec.Code, rec.Body.String(), c.code)
		}
	}
	// Signing in through the URL: a cookie, and a relative redirect that
	// drops the token and keeps the other parameters.
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequestWithContext(context.Background(), http.MethodGet, "/dlq?topic=t.dlq&token=0123456789abcdef-token", nil))
	if rec.Code != http.StatusSeeOther || rec.Header().Get("Location") != "dlq?topic=t.dlq" || !strings.Contains(rec.Header().Get("Set-Cookie"), "HttpOnly") {
		t.Errorf("sign-in: %d %v", rec.Code, rec.Header())
	}
}

// A query names its place by the source's parameter, and gives it back
// under the same one: ?topic= for Kafka (also when none is named), ?stream=
// for JetStream.
func TestQueryNamesItsPlace(t *testing.T) {
	for _, c := range []struct {
		query, where, values string
	}{
		{"topic=o.dlq&class=permanent", "topic", "class=permanent&topic=o.dlq"},
		{"stream=O_DLQ&class=permanent", "stream", "class=permanent&stream=O_DLQ"},
		{"class=permanent", "topic", "class=permanent"},
	} {
		v, err := url.ParseQuery(c.query)
		if err != nil {
			t.Fatal(err)
		}
		q := readDLQQuery(v)
		if q.Where() != c.where || q.Values().Encode() != c.values || !q.Selective() {
			t.Errorf("%s: where %q, values %q, selective %v; want %q, %q, true", c.query, q.Where(), q.Values().Encode(), q.Selective(), c.where, c.values)
		}
	}
	if q := readDLQQuery(url.Values{"stream": {"O_DLQ"}}); q.Selective() || q.place() != "stream O_DLQ" {
		t.Errorf("a stream alone: selective %v, place %q", q.Selective(), q.place())
	}
}
