package dlq

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/twmb/franz-go/pkg/kgo"
)

// Prefix starts the name of every header oncely adds to a dead-letter record.
const Prefix = "oncely-dlq-"

// Header names on dead-letter records. They are part of oncely's stable
// format: tools may rely on them.
const (
	HeaderTopic        = Prefix + "topic"         // source topic
	HeaderPartition    = Prefix + "partition"     // source partition, decimal
	HeaderOffset       = Prefix + "offset"        // source offset, decimal
	HeaderTimestamp    = Prefix + "timestamp"     // source record timestamp, RFC 3339 (UTC, nanoseconds)
	HeaderGroup        = Prefix + "group"         // consumer group that gave up
	HeaderMessageID    = Prefix + "message-id"    // dedup id
	HeaderAttempts     = Prefix + "attempts"      // handler runs, decimal (0: never handed to the handler)
	HeaderFirstFailure = Prefix + "first-failure" // RFC 3339
	HeaderLastFailure  = Prefix + "last-failure"  // RFC 3339
	HeaderErrorClass   = Prefix + "error-class"   // a Class
	HeaderError        = Prefix + "error"         // error message, at most MaxErrorLen bytes
	HeaderTraceParent  = Prefix + "traceparent"   // W3C trace context of the last attempt
	HeaderTraceState   = Prefix + "tracestate"    //
	// HeaderOriginalTraceParent keeps the source record's traceparent: the
	// dead-letter record's own traceparent names the dead-letter send span.
	HeaderOriginalTraceParent = Prefix + "original-traceparent"

	// HeaderStub marks a stub dead-letter record: the full copy was too
	// large for the dead-letter topic, so the value and the original
	// headers were left out; its value says how large they were. A stub
	// cannot be redriven: produce the record again from its source.
	HeaderStub = Prefix + "stub"

	// HeaderRedrive marks a redriven record; its value names the
	// dead-letter record it came from (topic/partition/offset).
	HeaderRedrive = "oncely-redrive"
	// HeaderMessageIDDefault is the header that carries a message's dedup id.
	HeaderMessageIDDefault = "message-id"
)

// MaxErrorLen bounds the error message stored in a dead-letter record.
const MaxErrorLen = 1024

// Class says why a record was dead-lettered.
type Class string

// The error classes.
const (
	ClassUndecodable Class = "undecodable"  // the value could not be decoded
	ClassPermanent   Class = "permanent"    // the handler said retrying cannot help
	ClassMaxAttempts Class = "max_attempts" // transient errors until MaxAttempts
	ClassPanic       Class = "panic"        // the last of MaxAttempts attempts panicked
	ClassOversized   Class = "oversized"    // larger than the configured limit
	ClassCrashLoop   Class = "crash_loop"   // the process died while running it CrashLoopLimit times (Attempts: the deaths)
)

// Valid reports whether c is one of the defined classes.
func (c Class) Valid() bool {
	switch c {
	case ClassUndecodable, ClassPermanent, ClassMaxAttempts, ClassPanic, ClassOversized, ClassCrashLoop:
		return true
	}
	return false
}

// PermanentError marks an error that retrying cannot fix.
type PermanentError struct {
	Err   error
	Class Class // ClassPermanent or ClassUndecodable
}

func (e *PermanentError) Error() string {
	if e.Err == nil {
		return string(e.Class)
	}
	return e.Err.Error()
}

func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent marks err as permanent: the consumer dead-letters the record at
// once instead of retrying. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err, Class: ClassPermanent}
}

// Undecodable marks err as a decoding failure: the record is dead-lettered
// at once with class undecodable. Undecodable(nil) is nil.
func Undecodable(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err, Class: ClassUndecodable}
}

// PermanentClass returns the class of a permanent error anywhere in err's
// chain, and whether there is one.
func PermanentClass(err error) (Class, bool) {
	var pe *PermanentError
	if errors.As(err, &pe) {
		return pe.Class, true
	}
	return "", false
}

// Info is what a dead-letter record says about its source and failure.
type Info struct {
	Topic        string
	Partition    int32
	Offset       int64
	Timestamp    time.Time
	Group        string
	MessageID    string
	Attempts     int
	FirstFailure time.Time
	LastFailure  time.Time
	Class        Class
	Error        string
	TraceParent  string
	TraceState   string
}

// Headers returns info as oncely headers.
func (info *Info) Headers() []kgo.RecordHeader {
	h := []kgo.RecordHeader{
		{Key: HeaderTopic, Value: []byte(info.Topic)},
		{Key: HeaderPartition, Value: []byte(strconv.FormatInt(int64(info.Partition), 10))},
		{Key: HeaderOffset, Value: []byte(strconv.FormatInt(info.Offset, 10))},
		{Key: HeaderTimestamp, Value: []byte(formatTime(info.Timestamp))},
		{Key: HeaderGroup, Value: []byte(info.Group)},
		{Key: HeaderMessageID, Value: []byte(info.MessageID)},
		{Key: HeaderAttempts, Value: []byte(strconv.Itoa(info.Attempts))},
		{Key: HeaderFirstFailure, Value: []byte(formatTime(info.FirstFailure))},
		{Key: HeaderLastFailure, Value: []byte(formatTime(info.LastFailure))},
		{Key: HeaderErrorClass, Value: []byte(info.Class)},
		{Key: HeaderError, Value: []byte(Truncate(info.Error, MaxErrorLen))},
	}
	if info.TraceParent != "" {
		h = append(h, kgo.RecordHeader{Key: HeaderTraceParent, Value: []byte(info.TraceParent)})
	}
	if info.TraceState != "" {
		h = append(h, kgo.RecordHeader{Key: HeaderTraceState, Value: []byte(info.TraceState)})
	}
	return h
}

func formatTime(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// Truncate shortens s to at most n bytes without splitting a UTF-8 sequence.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// ErrNotDeadLetter is wrapped by Decode for a record without oncely's
// dead-letter headers.
var ErrNotDeadLetter = errors.New("dlq: not a dead-letter record")

// Decode reads the oncely headers of a dead-letter record. It fails, naming
// the header, when a required header is missing or malformed.
func Decode(headers []kgo.RecordHeader) (*Info, error) {
	get := func(k string) (string, bool) {
		for _, h := range headers {
			if h.Key == k {
				return string(h.Value), true
			}
		}
		return "", false
	}
	var info Info
	var missing []string
	str := func(k string, dst *string) {
		v, ok := get(k)
		if !ok {
			missing = append(missing, k)
		}
		*dst = v
	}
	str(HeaderTopic, &info.Topic)
	str(HeaderGroup, &info.Group)
	str(HeaderMessageID, &info.MessageID)
	str(HeaderError, &info.Error)
	var class, part, off, attempts, ts, first, last string
	str(HeaderErrorClass, &class)
	str(HeaderPartition, &part)
	str(HeaderOffset, &off)
	str(HeaderAttempts, &attempts)
	str(HeaderTimestamp, &ts)
	str(HeaderFirstFailure, &first)
	str(HeaderLastFailure, &last)
	if len(missing) == len([]string{HeaderTopic, HeaderGroup, HeaderMessageID, HeaderError, HeaderErrorClass,
		HeaderPartition, HeaderOffset, HeaderAttempts, HeaderTimestamp, HeaderFirstFailure, HeaderLastFailure}) {
		return nil, ErrNotDeadLetter
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("dlq: decode: missing headers %s", strings.Join(missing, ", "))
	}
	info.TraceParent, _ = get(HeaderTraceParent)
	info.TraceState, _ = get(HeaderTraceState)
	info.Class = Class(class)
	if !info.Class.Valid() {
		return nil, fmt.Errorf("dlq: decode: header %s: unknown class %q", HeaderErrorClass, class)
	}
	p, err := strconv.ParseInt(part, 10, 32)
	if err != nil || p < 0 {
		return nil, fmt.Errorf("dlq: decode: header %s: invalid partition %q", HeaderPartition, part)
	}
	info.Partition = int32(p)
	if info.Offset, err = strconv.ParseInt(off, 10, 64); err != nil || info.Offset < 0 {
		return nil, fmt.Errorf("dlq: decode: header %s: invalid offset %q", HeaderOffset, off)
	}
	if info.Attempts, err = strconv.Atoi(attempts); err != nil || info.Attempts < 0 {
		return nil, fmt.Errorf("dlq: decode: header %s: invalid attempt count %q", HeaderAttempts, attempts)
	}
	for _, f := range []struct {
		key string
		v   string
		dst *time.Time
	}{{HeaderTimestamp, ts, &info.Timestamp}, {HeaderFirstFailure, first, &info.FirstFailure}, {HeaderLastFailure, last, &info.LastFailure}} {
		t, err := time.Parse(time.RFC3339Nano, f.v)
		if err != nil {
			return nil, fmt.Errorf("dlq: decode: header %s: invalid time %q", f.key, f.v)
		}
		*f.dst = t
	}
	if info.MessageID == "" {
		return nil, fmt.Errorf("dlq: decode: header %s is empty", HeaderMessageID)
	}
	return &info, nil
}

// HeaderPolicy decides which original headers a dead-letter record keeps.
type HeaderPolicy struct {
	// IDHeader is the header that carries the dedup id; it is always kept,
	// and set to the dedup id when the source record lacks it.
	// Default "message-id".
	IDHeader string
	// Allow, when non-empty, is the allow-list of header keys to copy
	// (case-insensitive). When empty, every header is copied except the
	// sensitive-looking ones.
	Allow []string
}

// sensitive are substrings of header keys (lower-cased, underscores read as
// dashes) that are never copied.
var sensitive = []string{"authorization", "cookie", "token", "secret", "password", "passwd", "api-key", "apikey",
	"credential", "signature", "session", "jwt", "bearer", "private-key", "privatekey"}

// isSensitive reports whether a lower-cased header key looks like it carries
// a credential: it contains one of sensitive, or a dash-separated word
// "auth" (X-Auth, but not author).
func isSensitive(k string) bool {
	k = strings.ReplaceAll(k, "_", "-")
	for _, s := range sensitive {
		if strings.Contains(k, s) {
			return true
		}
	}
	return slices.Contains(strings.Split(k, "-"), "auth")
}

// alwaysKept are copied whatever the policy says.
var alwaysKept = []string{HeaderMessageIDDefault, "traceparent", "tracestate"}

// Keep reports whether a header with this key is copied.
func (p HeaderPolicy) Keep(key string) bool {
	k := strings.ToLower(key)
	if p.IDHeader != "" && key == p.IDHeader {
		return true
	}
	for _, a := range alwaysKept {
		if k == a {
			return true
		}
	}
	if strings.HasPrefix(k, Prefix) || k == HeaderRedrive {
		return false // oncely's own headers are written afresh
	}
	if isSensitive(k) {
		return false
	}
	if len(p.Allow) == 0 {
		return true
	}
	for _, a := range p.Allow {
		if strings.EqualFold(a, key) {
			return true
		}
	}
	return false
}

// NewRecord builds the dead-letter record for src: same key and value, the
// headers that pass policy, the message-id header set to the dedup id, and
// info's oncely headers.
func NewRecord(topic string, src *kgo.Record, info *Info, policy HeaderPolicy) *kgo.Record {
	idHeader := cmp.Or(policy.IDHeader, HeaderMessageIDDefault)
	headers := make([]kgo.RecordHeader, 0, len(src.Headers)+14)
	hasID := false
	for _, h := range src.Headers {
		if !policy.Keep(h.Key) {
			continue
		}
		hasID = hasID || h.Key == idHeader
		headers = append(headers, h)
	}
	if !hasID {
		headers = append(headers, kgo.RecordHeader{Key: idHeader, Value: []byte(info.MessageID)})
	}
	return &kgo.Record{
		Topic:   topic,
		Key:     src.Key,
		Value:   src.Value,
		Headers: append(headers, info.Headers()...),
	}
}

// maxStubKey bounds the key a stub keeps.
const maxStubKey = 1024

// Stub returns the stub of a dead-letter record full that its topic refused
// as too large: the oncely-dlq-* headers (where, when, what failed), the
// dedup id header and the trace context, the key if under 1 KiB, no value,
// and HeaderStub saying what was left out. A dead letter must always be
// written: a partition never waits forever on a record that cannot be.
func Stub(full *kgo.Record, idHeader string) *kgo.Record {
	idHeader = cmp.Or(idHeader, HeaderMessageIDDefault)
	stub := &kgo.Record{Topic: full.Topic}
	dropped := len(full.Value)
	for _, h := range full.Headers {
		switch {
		case strings.HasPrefix(h.Key, Prefix) || h.Key == idHeader || h.Key == "traceparent" || h.Key == "tracestate":
			stub.Headers = append(stub.Headers, h)
		default:
			dropped += len(h.Key) + len(h.Value)
		}
	}
	if len(full.Key) <= maxStubKey {
		stub.Key = full.Key
	} else {
		dropped += len(full.Key)
	}
	stub.Headers = append(stub.Headers, kgo.RecordHeader{Key: HeaderStub, Value: fmt.Appendf(nil,
		"the dead-letter topic refused the full copy as too large: %d bytes of value, key and original headers left out", dropped)})
	return stub
}

// DefaultTopic names the dead-letter topic of a source topic: "<topic>.dlq".
func DefaultTopic(source string) string { return source + ".dlq" }
