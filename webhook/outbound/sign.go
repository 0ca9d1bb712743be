package outbound

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// The request headers. webhook-id, webhook-timestamp and webhook-signature
// are the Standard Webhooks headers (https://www.standardwebhooks.com/);
// webhook-attempt and webhook-event-type are informational and not signed.
const (
	HeaderID        = "webhook-id"         // the delivery's id: the same on every attempt and after a redrive
	HeaderTimestamp = "webhook-timestamp"  // this attempt's send time, unix seconds
	HeaderSignature = "webhook-signature"  // "v1,<base64>" per secret, space-separated
	HeaderAttempt   = "webhook-attempt"    // 1 for the first attempt, counting across crashes; reset by a redrive
	HeaderEventType = "webhook-event-type" // Event.Type
)

// Secret sizes accepted (the Standard Webhooks recommendation), in bytes
// after base64 decoding.
const (
	MinSecretBytes = 24
	MaxSecretBytes = 64
)

const secretPrefix = "whsec_"

// decodeSecrets returns the HMAC keys of "whsec_<base64>" secrets. Errors name
// the secret's position, never its value.
func decodeSecrets(secrets []string) ([][]byte, error) {
	if len(secrets) > MaxSecrets {
		return nil, fmt.Errorf("%d secrets, at most %d", len(secrets), MaxSecrets)
	}
	keys := make([][]byte, len(secrets))
	for i, s := range secrets {
		b64, ok := strings.CutPrefix(s, secretPrefix)
		if !ok {
			return nil, fmt.Errorf("secret %d: want %q followed by base64", i, secretPrefix)
		}
		key, err := base64.StdEncoding.DecodeString(b64)
		if err != nil {
			return nil, fmt.Errorf("secret %d: want %q followed by base64: %w", i, secretPrefix, err)
		}
		if len(key) < MinSecretBytes || len(key) > MaxSecretBytes {
			return nil, fmt.Errorf("secret %d: %d bytes, want %d to %d", i, len(key), MinSecretBytes, MaxSecretBytes)
		}
		keys[i] = key
	}
	return keys, nil
}

// Sign returns the webhook-signature header value of a request: for each
// secret ("whsec_" + base64), "v1," + base64(HMAC-SHA256(key, webhookID + "."
// + timestamp + "." + body)), where key is the base64-decoded secret and
// timestamp is ts in unix seconds; the signatures are separated by spaces.
func Sign(secrets []string, webhookID string, ts time.Time, body []byte) (string, error) {
	keys, err := decodeSecrets(secrets)
	if err != nil {
		return "", fmt.Errorf("outbound: sign: %w", err)
	}
	return sign(keys, webhookID, strconv.FormatInt(ts.Unix(), 10), body), nil
}

func sign(keys [][]byte, id, ts string, body []byte) string {
	var sb strings.Builder
	for i, k := range keys {
		m := hmac.New(sha256.New, k)
		m.Write([]byte(id))
		m.Write([]byte{'.'})
		m.Write([]byte(ts))
		m.Write([]byte{'.'})
		m.Write(body)
		if i > 0 {
			sb.WriteByte(' ')
		}
		sb.WriteString("v1,")
		sb.WriteString(base64.StdEncoding.EncodeToString(m.Sum(nil)))
	}
	return sb.String()
}
