package idempotency

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// errInvalidKey is the cause of every refusal of a key header (400).
var errInvalidKey = errors.New("invalid idempotency key")

// parseKey returns the idempotency key carried by the values of the key
// header field. Exactly one field line is accepted. Its value is either
//
//   - a bare key: 1*(visible ASCII, 0x21-0x7E), as Stripe-style clients send
//     it (`Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`), or
//   - a Structured Field string (RFC 8941 sf-string), as the IETF
//     Idempotency-Key draft specifies it
//     (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`): printable
//     ASCII (0x20-0x7E) between double quotes, with \" and \\ as the only
//     escapes. The key is the unescaped content, so `"abc"` and `abc` are
//     the same key.
//
// Leading and trailing spaces and tabs around the value are ignored. The key
// must not be empty and must be at most maxLen bytes long.
func parseKey(values []string, maxLen int) (string, error) {
	switch len(values) {
	case 0:
		return "", fmt.Errorf("%w: missing", errInvalidKey)
	case 1:
	default:
		return "", fmt.Errorf("%w: %d header fields, want exactly one", errInvalidKey, len(values))
	}
	v := strings.Trim(values[0], " \t")
	var key string
	if strings.HasPrefix(v, `"`) {
		k, err := parseSFString(v)
		if err != nil {
			return "", err
		}
		key = k
	} else {
		for i := 0; i < len(v); i++ {
			if c := v[i]; c < 0x21 || c > 0x7e {
				return "", fmt.Errorf("%w: byte 0x%02x at offset %d (a bare key is visible ASCII; quote it to include spaces)", errInvalidKey, c, i)
			}
		}
		key = v
	}
	if key == "" {
		return "", fmt.Errorf("%w: empty", errInvalidKey)
	}
	if len(key) > maxLen {
		return "", fmt.Errorf("%w: %d bytes long, the limit is %d", errInvalidKey, len(key), maxLen)
	}
	return key, nil
}

// parseSFString parses an RFC 8941 sf-string that makes up all of v.
func parseSFString(v string) (string, error) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		switch c := v[i]; {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", fmt.Errorf("%w: bad escape at offset %d of the quoted key", errInvalidKey, i-1)
			}
			b.WriteByte(v[i])
		case c == '"':
			if i != len(v)-1 {
				return "", fmt.Errorf("%w: characters after the closing quote", errInvalidKey)
			}
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("%w: byte 0x%02x at offset %d of the quoted key", errInvalidKey, c, i)
		default:
			b.WriteByte(c)
		}
	}
	return "", fmt.Errorf("%w: no closing quote", errInvalidKey)
}

// quoteKey returns key as an sf-string; parseKey reverses it.
func quoteKey(key string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(key); i++ {
		if key[i] == '"' || key[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(key[i])
	}
	b.WriteByte('"')
	return b.String()
}

// maxScopeLen bounds a scope, so that (scope, key) always fits a btree index
// entry (Postgres refuses entries above about 2.7 kB).
const maxScopeLen = 1024

// checkScope reports whether a client name can be stored as the scope.
func checkScope(scope string) error {
	switch {
	case len(scope) > maxScopeLen:
		return fmt.Errorf("idempotency: the client name (Config.Scope or WithClient) has %d bytes, the limit is %d", len(scope), maxScopeLen)
	case !utf8.ValidString(scope):
		return errors.New("idempotency: the client name (Config.Scope or WithClient) is not valid UTF-8")
	case strings.IndexByte(scope, 0) >= 0:
		return errors.New("idempotency: the client name (Config.Scope or WithClient) contains a NUL byte")
	}
	return nil
}

// fingerprintVersion is hashed first, so that a future change of what the
// fingerprint covers can never match an old one by accident.
const fingerprintVersion = "oncely.idempotency.fingerprint.v1"

// fingerprint identifies a request's content: SHA-256 over the method, the
// escaped path, the raw query when withQuery is set and the query is not
// empty, and the SHA-256 of the raw body bytes exactly as received (never
// re-serialised: two JSON bodies that differ only in whitespace or key order
// are different requests). Fields are length-prefixed, so no two field lists
// hash alike; a request without a query hashes as it did before the query
// was covered, so its recorded rows still match.
func fingerprint(method, escapedPath string, withQuery bool, rawQuery string, body []byte) []byte {
	var buf [256]byte // fields are appended and hashed at once; short ones stay on the stack
	b := appendField(buf[:0], fingerprintVersion)
	b = appendField(b, method)
	b = appendField(b, escapedPath)
	if withQuery && rawQuery != "" {
		b = appendField(b, "?"+rawQuery)
	}
	sum := sha256.Sum256(body)
	fp := sha256.Sum256(append(b, sum[:]...))
	return fp[:]
}

// lockKey is the 64-bit transaction-scoped advisory lock that marks (scope,
// key) as in progress in schema. A hash collision between two keys in flight
// at the same moment makes one of them answer 409 once; with 64 bits that is
// negligible.
func lockKey(schema, scope, key string) int64 {
	var buf [256]byte
	b := appendField(buf[:0], "oncely.idempotency.lock")
	b = appendField(b, schema)
	b = appendField(b, scope)
	b = appendField(b, key)
	sum := sha256.Sum256(b)
	return int64(binary.BigEndian.Uint64(sum[:]))
}

// appendField appends s with its length as 8 big-endian bytes before it, so
// that no two field lists hash alike.
func appendField(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint64(b, uint64(len(s)))
	return append(b, s...)
}
