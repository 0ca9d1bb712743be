package outbound

import (
	"fmt"
	"log/slog"
	"net/url"
	"strings"
)

// Redacted replaces a credential wherever an endpoint URL is shown.
const Redacted = "REDACTED"

// Subscription URLs may carry credentials the endpoint needs (user:password@
// or a token in the query): they are stored as given, since every request
// needs them, and never shown. RedactURL is how every message, error, log
// line, span and the CLI show a URL.

// secretParams are query parameter names (lower case) whose values are
// credentials; secretParts are substrings that make a name one.
var (
	secretParams = map[string]bool{
		"key": true, "sig": true, "code": true, "pass": true, "pwd": true, "jwt": true,
		"hmac": true, "sid": true, "session": true, "sessionid": true, "bearer": true,
	}
	secretParts = []string{"token", "secret", "passw", "signature", "credential", "apikey", "api_key", "api-key",
		"access_key", "accesskey", "auth", "private"}
)

// secretParam reports whether a query parameter of this name holds a
// credential.
func secretParam(name string) bool {
	n := strings.ToLower(name)
	if secretParams[n] {
		return true
	}
	for _, p := range secretParts {
		if strings.Contains(n, p) {
			return true
		}
	}
	return false
}

// RedactURL returns raw fit to be shown: its userinfo (user:password@) and
// the values of query parameters that hold credentials (token, access_token,
// api_key, key, sig, secret, password, signature, X-Amz-Credential and the
// like) become REDACTED. A URL that does not parse is not shown at all.
// Credentials elsewhere (a token as a path segment) are not recognised.
func RedactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Sprintf("(a URL that does not parse, %d bytes)", len(raw))
	}
	if u.User != nil {
		u.User = url.User(Redacted)
	}
	if u.RawQuery != "" {
		parts := strings.Split(u.RawQuery, "&")
		for i, p := range parts {
			name, _, hasValue := strings.Cut(p, "=")
			unescaped, err := url.QueryUnescape(name)
			if err != nil {
				unescaped = name
			}
			if hasValue && secretParam(unescaped) {
				parts[i] = name + "=" + Redacted
			}
		}
		u.RawQuery = strings.Join(parts, "&")
	}
	return u.String()
}

// String shows the subscription without its credentials: the URL redacted
// (RedactURL) and the number of secrets, never their values.
func (s Subscription) String() string {
	return fmt.Sprintf("{ID:%s URL:%s Secrets:%d EventTypes:%v Description:%q Disabled:%v PausedAt:%v PausedReason:%q}",
		s.ID, RedactURL(s.URL), len(s.Secrets), s.EventTypes, s.Description, s.Disabled, s.PausedAt, s.PausedReason)
}

// GoString is String, so that %#v hides the credentials too.
func (s Subscription) GoString() string { return "outbound.Subscription" + s.String() }

// LogValue shows the subscription in log/slog without its credentials.
func (s Subscription) LogValue() slog.Value {
	return slog.GroupValue(slog.String("id", s.ID.String()), slog.String("url", RedactURL(s.URL)),
		slog.Int("secrets", len(s.Secrets)), slog.Bool("disabled", s.Disabled))
}
