package idempotency_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/oncely/oncely/idempotency"
)

// memRequest sends a keyed POST to h in-process; contentLength is the
// request's declared length (-1: unknown, as a chunked body's).
func memRequest(h http.Handler, key, body string, contentLength int64, w http.ResponseWriter) *http.Request {
	r := httptest.NewRequestWithContext(idempotency.WithClient(context.Background(), "c"), http.MethodPost, "/orders", strings.NewReader(body))
	r.ContentLength = contentLength
	r.Header.Set("Idempotency-Key", key)
	h.ServeHTTP(w, r)
	return r
}

// TestHandlerReadsTheBody: the middleware reads the body for the
// fingerprint, and the handler still gets it whole (Body, ContentLength and
// GetBody), whatever its size and declared length; requests answered
// without the handler (replays, 422) reuse the middleware's read buffer,
// and that never shows in another request's body or fingerprint. The
// caller's request is left as it came but for its body, read to the end.
func TestHandlerReadsTheBody(t *testing.T) {
	t.Parallel()
	type seen struct {
		body, again string
		length      int64
	}
	var got seen
	m, err := idempotency.NewWithStore(newMemStore(true), idempotency.Config{MaxBodyBytes: 256 << 10})
	if err != nil {
		t.Fatal(err)
	}
	h := m.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			t.Errorf("handler: read body: %v", err)
		}
		got = seen{body: string(b), length: r.ContentLength}
		if rc, err := r.GetBody(); err != nil {
			t.Errorf("handler: GetBody: %v", err)
		} else if again, err := io.ReadAll(rc); err != nil {
			t.Errorf("handler: read GetBody: %v", err)
		} else {
			got.again = string(again)
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(b)
	}))
	big := strings.Repeat("0123456789abcdef", 8<<10) // 128 KiB: beyond the buffers the middleware reuses
	for _, tc := range []struct {
		name          string
		body          string
		contentLength int64 // the declared length, as sent
	}{
		{"empty", "", 0},
		{"small", `{"sku":"A-1","qty":1}`, 21},
		{"unknown length", strings.Repeat("u", 3000), -1},
		{"declared shorter than sent", "abcdefghij", 3},
		{"large", big, int64(len(big))},
		{"small after large", "xyz", 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "k-" + strings.ReplaceAll(tc.name, " ", "-")
			got = seen{}
			w := httptest.NewRecorder()
			r := memRequest(h, key, tc.body, tc.contentLength, w)
			if w.Code != http.StatusCreated || w.Body.String() != tc.body {
				t.Fatalf("first request: %d %q, want 201 echoing the body", w.Code, w.Body)
			}
			if want := (seen{tc.body, tc.body, int64(len(tc.body))}); got != want {
				t.Errorf("the handler saw body %d bytes, GetBody %d bytes, ContentLength %d; want %d bytes each",
					len(got.body), len(got.again), got.length, len(tc.body))
			}
			if r.ContentLength != tc.contentLength || r.GetBody != nil || r.Header.Get("Idempotency-Key") != key {
				t.Errorf("the caller's request was changed: ContentLength %d, GetBody set %v, key %q",
					r.ContentLength, r.GetBody != nil, r.Header.Get("Idempotency-Key"))
			}
			for range 3 {
				w := httptest.NewRecorder()
				memRequest(h, key, tc.body, tc.contentLength, w)
				if w.Code != http.StatusCreated || w.Body.String() != tc.body || w.Header().Get(idempotency.ReplayedHeader) != "true" {
					t.Fatalf("retry: %d %q, want the replay", w.Code, w.Body)
				}
			}
			other := tc.body + "!"
			if len(tc.body) > 0 {
				other = tc.body[:len(tc.body)-1] + "!" // the same length, its last byte differs
			}
			w = httptest.NewRecorder()
			memRequest(h, key, other, tc.contentLength, w)
			if w.Code != http.StatusUnprocessableEntity {
				t.Fatalf("the key with another body: %d %q, want 422", w.Code, w.Body)
			}
		})
	}
}

// TestHandlerBodyIsItsOwn: the body a handler reads is its own copy, not
// the buffer the middleware read it into: requests that the middleware
// answers meanwhile (here a replay, sent from inside the handler before it
// reads its body) reuse that buffer and must not change what it reads.
func TestHandlerBodyIsItsOwn(t *testing.T) {
	t.Parallel()
	m, err := idempotency.NewWithStore(newMemStore(true), idempotency.Config{})
	if err != nil {
		t.Fatal(err)
	}
	const mine, other = `{"body":"outer"}`, `{"body":"other"}`
	var h http.Handler
	h = m.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Idempotency-Key") == "outer" {
			replay := httptest.NewRecorder()
			memRequest(h, "other", other, int64(len(other)), replay)
			if replay.Header().Get(idempotency.ReplayedHeader) != "true" {
				t.Errorf("the request sent from the handler: %d %q, want a replay", replay.Code, replay.Body)
			}
		}
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(b)
	}))
	w := httptest.NewRecorder()
	memRequest(h, "other", other, int64(len(other)), w)
	w = httptest.NewRecorder()
	memRequest(h, "outer", mine, int64(len(mine)), w)
	if w.Code != http.StatusCreated || w.Body.String() != mine {
		t.Fatalf("the handler read %q (status %d), want its own body %q", w.Body, w.Code, mine)
	}
}

// TestReplayHeadersStayApart: the replayed header values share one array,
// and a handler in front of the middleware that adds values to them changes
// only the header it adds to. Values that it set before are replaced by the
// recorded ones, and its other headers stay.
func TestReplayHeadersStayApart(t *testing.T) {
	t.Parallel()
	m, err := idempotency.NewWithStore(newMemStore(true), idempotency.Config{})
	if err != nil {
		t.Fatal(err)
	}
	h := m.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Add("Link", "</a>; rel=a")
		w.Header().Add("Link", "</b>; rel=b")
		w.Header().Set("Location", "/orders/1")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"1"}`)
	}))
	first := httptest.NewRecorder()
	memRequest(h, "k", "{}", 2, first)
	if first.Code != http.StatusCreated {
		t.Fatalf("first request: %d", first.Code)
	}
	w := &appendingWriter{ResponseRecorder: httptest.NewRecorder()}
	w.Header().Set("Location", "/set-in-front")
	w.Header().Set("X-Front", "kept")
	memRequest(h, "k", "{}", 2, w)
	want := http.Header{
		"Content-Type":             {"application/json", "added"},
		"Link":                     {"</a>; rel=a", "</b>; rel=b", "added"},
		"Location":                 {"/orders/1", "added"},
		"X-Front":                  {"kept", "added"},
		"Content-Length":           {"10", "added"},
		idempotency.ReplayedHeader: {"true", "added"},
	}
	for k, vv := range want {
		if got := w.Header()[k]; !slices.Equal(got, vv) {
			t.Errorf("replayed %s = %q, want %q", k, got, vv)
		}
	}
	if w.Code != http.StatusCreated || !bytes.Equal(w.Body.Bytes(), []byte(`{"id":"1"}`)) {
		t.Errorf("replay: %d %q", w.Code, w.Body)
	}
}

// appendingWriter adds a value to every header when the status is written,
// as a handler in front of the middleware may.
type appendingWriter struct{ *httptest.ResponseRecorder }

func (w *appendingWriter) WriteHeader(code int) {
	for k := range w.Header() {
		w.Header()[k] = append(w.Header()[k], "added")
	}
	w.ResponseRecorder.WriteHeader(code)
}
