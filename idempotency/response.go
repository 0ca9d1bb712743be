package idempotency

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/textproto"
	"slices"
	"strconv"
	"strings"
)

// ErrResponseTooLarge is returned by the recorder's Write once a handler's
// response body exceeds Config.MaxResponseBytes. The request's transaction is
// then rolled back and the client gets a 500.
var ErrResponseTooLarge = errors.New("idempotency: response body exceeds Config.MaxResponseBytes")

// recorder is the http.ResponseWriter the handler writes to: it keeps the
// status, headers and body in memory until the transaction has committed.
// It deliberately implements neither http.Flusher nor http.Hijacker (and has
// no Unwrap): nothing may reach the client before the commit.
type recorder struct {
	header http.Header
	sent   http.Header // snapshot of header taken when the status was set, like net/http
	status int
	body   bytes.Buffer
	max    int64
	err    error
}

func newRecorder(maxBody int64) *recorder {
	return &recorder{header: make(http.Header), max: maxBody}
}

func (rw *recorder) Header() http.Header { return rw.header }

func (rw *recorder) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code)) // as net/http does
	}
	if rw.status != 0 || code < 200 {
		// A second call is ignored as net/http ignores it. Informational
		// responses (1xx) are neither forwarded nor recorded: nothing
		// reaches the client before the commit.
		return
	}
	rw.status = code
	rw.sent = rw.header.Clone()
}

func (rw *recorder) Write(p []byte) (int, error) {
	if rw.status == 0 {
		rw.WriteHeader(http.StatusOK)
	}
	if !bodyAllowed(rw.status) {
		return 0, http.ErrBodyNotAllowed
	}
	if rw.err != nil {
		return 0, rw.err
	}
	if int64(rw.body.Len())+int64(len(p)) > rw.max {
		rw.err = ErrResponseTooLarge
		return 0, rw.err
	}
	return rw.body.Write(p)
}

// finish completes the response as net/http would: status 200 if the
// handler set none, and a sniffed Content-Type if it set none (so that the
// recorded Content-Type is the one the first client saw).
func (rw *recorder) finish() {
	if rw.status == 0 {
		rw.WriteHeader(http.StatusOK)
	}
	if _, set := rw.sent["Content-Type"]; !set && rw.body.Len() > 0 && rw.sent.Get("Transfer-Encoding") == "" {
		b := rw.body.Bytes()
		rw.sent.Set("Content-Type", http.DetectContentType(b[:min(len(b), 512)]))
	}
}

// selected returns the headers to record, in a stable order: one (name,
// value) pair per value of every header in allow.
func (rw *recorder) selected(allow map[string]bool) (names, values []string) {
	hop := map[string]bool{} // headers the response's Connection header names: hop-by-hop
	for _, v := range rw.sent.Values("Connection") {
		for _, name := range strings.Split(v, ",") {
			hop[textproto.CanonicalMIMEHeaderKey(strings.TrimSpace(name))] = true
		}
	}
	var buf [16]string // the keys of most responses fit
	keys, n := buf[:0], 0
	for k, vv := range rw.sent {
		if allow[k] && !hop[k] {
			keys = append(keys, k)
			n += len(vv)
		}
	}
	slices.Sort(keys)
	nv := make([]string, 0, 2*n) // the names, then the values: never nil (empty arrays, not NULL)
	names, values = nv[:0:n], nv[n:n]
	for _, k := range keys {
		for _, v := range rw.sent[k] {
			names = append(names, k)
			values = append(values, v)
		}
	}
	return names, values
}

// writeTo sends the recorded response, with every header the handler set.
func (rw *recorder) writeTo(w http.ResponseWriter) {
	h := w.Header()
	for k, vv := range rw.sent {
		h[k] = vv
	}
	writeBody(w, rw.status, rw.body.Bytes())
}

// writeReplay sends a stored response: its status, its recorded headers and
// its body byte for byte, marked with Idempotent-Replayed: true.
func writeReplay(w http.ResponseWriter, status int, names, values []string, body []byte) {
	h := w.Header()
	for _, n := range names {
		h.Del(n) // recorded values replace any set by outer handlers
	}
	// Every value set here shares one array: each header's slice is capped
	// at its own values, so appending to one (here, or later by an outer
	// handler) copies it rather than overwriting the next.
	vals := make([]string, 0, len(names)+2)
	set := func(k, v string) {
		vals = append(vals, v)
		h[k] = vals[len(vals)-1 : len(vals) : len(vals)]
	}
	for i, n := range names {
		k := textproto.CanonicalMIMEHeaderKey(n)
		if vv, ok := h[k]; ok {
			h[k] = append(vv, values[i]) // a second value of a header set above
			continue
		}
		set(k, values[i])
	}
	set(ReplayedHeader, "true")
	if bodyAllowed(status) {
		set("Content-Length", strconv.Itoa(len(body)))
	} else {
		h.Del("Content-Length")
	}
	send(w, status, body)
}

// writeBody sends status and body with their Content-Length.
func writeBody(w http.ResponseWriter, status int, body []byte) {
	if bodyAllowed(status) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	} else {
		w.Header().Del("Content-Length")
	}
	send(w, status, body)
}

// send writes status and body (none where status allows none).
func send(w http.ResponseWriter, status int, body []byte) {
	if !bodyAllowed(status) {
		body = nil
	}
	w.WriteHeader(status)
	_, _ = w.Write(body) // the client may be gone; nothing left to do about it
}

func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

// problem writes an RFC 9457 problem details response (the format the IETF
// Idempotency-Key draft uses for its errors).
func problem(w http.ResponseWriter, status int, detail string) {
	body, _ := json.Marshal(struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}{"about:blank", http.StatusText(status), status, detail})
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	writeBody(w, status, body)
}
