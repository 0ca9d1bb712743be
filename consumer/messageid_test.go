package consumer

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/twmb/franz-go/pkg/kgo"
)

func TestMessageID(t *testing.T) {
	t.Parallel()
	rec := &kgo.Record{Topic: "orders", Partition: 3, Offset: 42, Headers: []kgo.RecordHeader{
		{Key: "trace", Value: []byte("x")}, {Key: "message-id", Value: []byte("m-1")}, {Key: "msg", Value: []byte("alt")},
	}}
	for _, tc := range []struct {
		name    string
		cfg     Config
		rec     *kgo.Record
		want    string
		wantErr string
	}{
		{"header", Config{}, rec, "m-1", ""},
		{"custom header", Config{MessageIDHeader: "msg"}, rec, "alt", ""},
		{"fallback", Config{MessageIDHeader: "absent"}, rec, "orders/3/42", ""},
		{"empty header falls back", Config{}, &kgo.Record{Topic: "t", Partition: 0, Offset: 7,
			Headers: []kgo.RecordHeader{{Key: "message-id"}}}, "t/0/7", ""},
		{"key func wins", Config{KeyFunc: func(r *kgo.Record) (string, error) { return "k-" + r.Topic, nil }}, rec, "k-orders", ""},
		{"key func error", Config{KeyFunc: func(*kgo.Record) (string, error) { return "", errors.New("bad") }}, rec, "", "key func: bad"},
		{"key func panics", Config{KeyFunc: func(*kgo.Record) (string, error) { panic("nil map") }}, rec, "", "handler panicked: nil map"},
		{"key func empty", Config{KeyFunc: func(*kgo.Record) (string, error) { return "", nil }}, rec, "", "empty id"},
		{"other casing", Config{}, &kgo.Record{Topic: "t", Offset: 7, Headers: []kgo.RecordHeader{{Key: "Message-ID", Value: []byte("m-2")}}}, "m-2", ""},
		{"not UTF-8", Config{}, &kgo.Record{Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte{0xff, 0x01}}}}, "", `"\xff\x01" is not valid UTF-8`},
		{"NUL byte", Config{}, &kgo.Record{Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte("a\x00b")}}}, "", `"a\x00b" is not valid`},
		{"too long", Config{}, &kgo.Record{Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(strings.Repeat("x", MaxMessageIDLen+1))}}}, "", "exceeds"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.setDefaults()
			c := &Consumer{cfg: tc.cfg}
			got, err := c.messageID(tc.rec)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("messageID = %q, %v; want error containing %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("messageID = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

// FuzzMessageID: whatever the headers, the dedup id is the first non-empty
// message-id header (in any casing) when there is one, else
// topic/partition/offset; it is never empty, never longer than
// MaxMessageIDLen, and always UTF-8 without NUL (other ids are errors).
func FuzzMessageID(f *testing.F) {
	f.Add("message-id", "m-1", "other", "x", int64(3))
	f.Add("message-id", "", "message-id", "second", int64(0))
	f.Add("Message-Id", "case", "", "", int64(-1))
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string, off int64) {
		rec := &kgo.Record{Topic: "t", Partition: 1, Offset: off,
			Headers: []kgo.RecordHeader{{Key: k1, Value: []byte(v1)}, {Key: k2, Value: []byte(v2)}}}
		var cfg Config
		cfg.setDefaults()
		c := &Consumer{cfg: cfg}
		id, err := c.messageID(rec)
		want := fmt.Sprintf("t/1/%d", off)
		switch {
		case strings.EqualFold(k1, "message-id") && v1 != "":
			want = v1
		case strings.EqualFold(k2, "message-id") && v2 != "":
			want = v2
		}
		if len(want) > MaxMessageIDLen || !utf8.ValidString(want) || strings.Contains(want, "\x00") {
			if err == nil {
				t.Fatalf("id of %d bytes accepted", len(want))
			}
			return
		}
		if err != nil || id != want || id == "" {
			t.Fatalf("messageID = %q, %v; want %q", id, err, want)
		}
	})
}
