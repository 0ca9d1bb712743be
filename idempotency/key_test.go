package idempotency

import (
	"bytes"
	"errors"
	"net/http"
	"strings"
	"testing"
)

func TestParseKey(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("k", 255)
	for _, tc := range []struct {
		name   string
		values []string
		want   string // "" = an error is expected
	}{
		{"uuid", []string{"8e03978e-40d5-43e8-bc93-6894a57f9324"}, "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{"sf-string", []string{`"8e03978e-40d5-43e8-bc93-6894a57f9324"`}, "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{"sf-string with spaces and escapes", []string{`"a b \"c\" \\d"`}, `a b "c" \d`},
		{"surrounding whitespace", []string{" \tabc\t "}, "abc"},
		{"visible ASCII", []string{"!#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"}, "!#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"},
		{"bare with inner quote", []string{`ab"c`}, `ab"c`},
		{"at the length limit", []string{long}, long},
		{"quoted at the limit", []string{`"` + long + `"`}, long},

		{"missing", nil, ""},
		{"two fields", []string{"a", "b"}, ""},
		{"empty", []string{""}, ""},
		{"blank", []string{"   "}, ""},
		{"empty sf-string", []string{`""`}, ""},
		{"inner space", []string{"a b"}, ""},
		{"comma-joined fields", []string{"a, b"}, ""},
		{"control byte", []string{"a\x01b"}, ""},
		{"DEL", []string{"a\x7fb"}, ""},
		{"non-ASCII", []string{"clé"}, ""},
		{"too long", []string{long + "k"}, ""},
		{"quoted too long", []string{`"` + long + `k"`}, ""},
		{"unterminated", []string{`"abc`}, ""},
		{"lone quote", []string{`"`}, ""},
		{"after closing quote", []string{`"abc"d`}, ""},
		{"bad escape", []string{`"a\bc"`}, ""},
		{"trailing backslash", []string{`"abc\`}, ""},
		{"tab inside quotes", []string{"\"a\tb\""}, ""},
	} {
		got, err := parseKey(tc.values, 255)
		switch {
		case tc.want == "" && err == nil:
			t.Errorf("%s: parseKey(%q) = %q, want an error", tc.name, tc.values, got)
		case tc.want == "" && !errors.Is(err, errInvalidKey):
			t.Errorf("%s: parseKey(%q) error %v does not wrap errInvalidKey", tc.name, tc.values, err)
		case tc.want != "" && (err != nil || got != tc.want):
			t.Errorf("%s: parseKey(%q) = %q, %v; want %q", tc.name, tc.values, got, err, tc.want)
		}
	}
}

// FuzzParseKey checks the key parser's contract on arbitrary header values:
// it never panics; an accepted key is non-empty, within the limit and
// printable ASCII (so it is valid UTF-8 without NUL, storable as text);
// quoting an accepted key and parsing it again gives it back; a bare value
// that is accepted is the key itself.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{
		"8e03978e-40d5-43e8-bc93-6894a57f9324", `"quoted"`, `"a \"b\" \\c"`, "", `"`, `""`,
		"a b", "\x00", `"a\b"`, "  x  ", `"x"y`, "é", strings.Repeat("z", 70),
	} {
		f.Add(s, 64)
	}
	f.Fuzz(func(t *testing.T, v string, maxLen int) {
		maxLen = 1 + (maxLen%MaxKeyLengthLimit+MaxKeyLengthLimit)%MaxKeyLengthLimit
		key, err := parseKey([]string{v}, maxLen)
		if err != nil {
			if !errors.Is(err, errInvalidKey) {
				t.Fatalf("parseKey(%q) error %v does not wrap errInvalidKey", v, err)
			}
			return
		}
		if key == "" || len(key) > maxLen {
			t.Fatalf("parseKey(%q, %d) = %q: empty or over the limit", v, maxLen, key)
		}
		for i := 0; i < len(key); i++ {
			if key[i] < 0x20 || key[i] > 0x7e {
				t.Fatalf("parseKey(%q) = %q: byte 0x%02x is not printable ASCII", v, key, key[i])
			}
		}
		if again, err := parseKey([]string{quoteKey(key)}, maxLen); err != nil || again != key {
			t.Fatalf("parseKey(quoteKey(%q)) = %q, %v; want the key back", key, again, err)
		}
		if trimmed := strings.Trim(v, " \t"); !strings.HasPrefix(trimmed, `"`) && key != trimmed {
			t.Fatalf("parseKey(%q) = %q, want the bare value %q", v, key, trimmed)
		}
	})
}

func TestFingerprint(t *testing.T) {
	t.Parallel()
	base := fingerprint("POST", "/orders", false, "", []byte(`{"a":1}`))
	if len(base) != 32 {
		t.Fatalf("fingerprint is %d bytes, want 32", len(base))
	}
	if again := fingerprint("POST", "/orders", false, "x=1", []byte(`{"a":1}`)); !bytes.Equal(again, base) {
		t.Error("the query changed the fingerprint although IgnoreQuery is set")
	}
	// A request without a query hashes as before the query was covered,
	// so keys recorded by an older version still replay.
	if noQuery := fingerprint("POST", "/orders", true, "", []byte(`{"a":1}`)); !bytes.Equal(noQuery, base) {
		t.Error("an empty query changed the fingerprint")
	}
	for name, fp := range map[string][]byte{
		"method":                fingerprint("PATCH", "/orders", false, "", []byte(`{"a":1}`)),
		"path":                  fingerprint("POST", "/orders/", false, "", []byte(`{"a":1}`)),
		"JSON whitespace":       fingerprint("POST", "/orders", false, "", []byte(`{"a": 1}`)),
		"query":                 fingerprint("POST", "/orders", true, "x=1", []byte(`{"a":1}`)),
		"field boundary (path)": fingerprint("POS", "T/orders", false, "", []byte(`{"a":1}`)),
	} {
		if bytes.Equal(fp, base) {
			t.Errorf("a different %s gives the same fingerprint", name)
		}
	}
	if lockKey("s", "ab", "c") == lockKey("s", "a", "bc") {
		t.Error("lockKey does not separate scope from key")
	}
}

func TestRecorder(t *testing.T) {
	t.Parallel()
	rec := newRecorder(10)
	rec.Header().Set("X-Before", "1")
	rec.WriteHeader(http.StatusEarlyHints) // informational: ignored
	if n, err := rec.Write([]byte("<html>")); n != 6 || err != nil {
		t.Fatalf("Write = %d, %v", n, err)
	}
	rec.Header().Set("X-After", "1") // after the status: not sent, as with net/http
	rec.WriteHeader(http.StatusTeapot)
	if _, err := rec.Write([]byte("12345")); !errors.Is(err, ErrResponseTooLarge) {
		t.Errorf("Write over the limit: %v, want ErrResponseTooLarge", err)
	}
	rec.finish()
	if rec.status != http.StatusOK {
		t.Errorf("status %d, want 200 (implied by the first Write)", rec.status)
	}
	if got := rec.sent.Get("Content-Type"); got != "text/html; charset=utf-8" {
		t.Errorf("sniffed Content-Type %q", got)
	}
	if rec.sent.Get("X-Before") != "1" || rec.sent.Get("X-After") != "" {
		t.Errorf("sent headers %v: want the snapshot taken at the status", rec.sent)
	}
	names, values := rec.selected(map[string]bool{"Content-Type": true, "X-After": true})
	if len(names) != 1 || names[0] != "Content-Type" || values[0] != "text/html; charset=utf-8" {
		t.Errorf("selected = %v %v", names, values)
	}

	nc := newRecorder(10)
	nc.WriteHeader(http.StatusNoContent)
	if _, err := nc.Write([]byte("x")); !errors.Is(err, http.ErrBodyNotAllowed) {
		t.Errorf("Write after 204: %v, want http.ErrBodyNotAllowed", err)
	}
}

func TestDefaultStoreStatus(t *testing.T) {
	t.Parallel()
	for status, want := range map[int]bool{
		200: true, 201: true, 204: true, 303: true, 400: true, 404: true, 422: true,
		408: false, 409: false, 425: false, 429: false, 500: false, 502: false, 503: false,
	} {
		if got := DefaultStoreStatus(status); got != want {
			t.Errorf("DefaultStoreStatus(%d) = %v, want %v", status, got, want)
		}
	}
}
