package dlq_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
)

func sampleInfo() *dlq.Info {
	t0 := time.Date(2026, 11, 21, 10, 0, 0, 123, time.UTC)
	return &dlq.Info{Topic: "orders", Partition: 3, Offset: 99, Timestamp: t0, Group: "g", MessageID: "m-1",
		Attempts: 4, FirstFailure: t0.Add(time.Second), LastFailure: t0.Add(2 * time.Second), Class: dlq.ClassMaxAttempts,
		Error: "boom", TraceParent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", TraceState: "k=v"}
}

func TestHeadersRoundTrip(t *testing.T) {
	t.Parallel()
	in := sampleInfo()
	out, err := dlq.Decode(in.Headers())
	if err != nil {
		t.Fatal(err)
	}
	if *out != *in {
		t.Fatalf("round trip:\n got %+v\nwant %+v", out, in)
	}
	for _, h := range in.Headers() {
		if !strings.HasPrefix(h.Key, dlq.Prefix) {
			t.Errorf("header %q lacks the prefix %q", h.Key, dlq.Prefix)
		}
	}
}

func TestDecodeNamesTheBadHeader(t *testing.T) {
	t.Parallel()
	if _, err := dlq.Decode([]kgo.RecordHeader{{Key: "x", Value: []byte("y")}}); !errors.Is(err, dlq.ErrNotDeadLetter) {
		t.Errorf("plain record: %v, want ErrNotDeadLetter", err)
	}
	replace := func(key, value string) []kgo.RecordHeader {
		var out []kgo.RecordHeader
		for _, h := range sampleInfo().Headers() {
			if h.Key == key {
				if value == "<drop>" {
					continue
				}
				h.Value = []byte(value)
			}
			out = append(out, h)
		}
		return out
	}
	for _, tc := range []struct{ key, value string }{
		{dlq.HeaderPartition, "-1"}, {dlq.HeaderPartition, "x"}, {dlq.HeaderOffset, "1e3"},
		{dlq.HeaderAttempts, "-2"}, {dlq.HeaderErrorClass, "cosmic-ray"}, {dlq.HeaderTimestamp, "yesterday"},
		{dlq.HeaderLastFailure, ""}, {dlq.HeaderGroup, "<drop>"}, {dlq.HeaderMessageID, ""},
	} {
		_, err := dlq.Decode(replace(tc.key, tc.value))
		if err == nil || !strings.Contains(err.Error(), tc.key) {
			t.Errorf("%s=%q: error %v does not name the header", tc.key, tc.value, err)
		}
	}
}

func TestTruncateKeepsUTF8(t *testing.T) {
	t.Parallel()
	s := strings.Repeat("é", 600) // 2 bytes each
	got := dlq.Truncate(s, dlq.MaxErrorLen+1)
	if len(got) > dlq.MaxErrorLen+1 || !utf8.ValidString(got) {
		t.Fatalf("Truncate: %d bytes, valid %v", len(got), utf8.ValidString(got))
	}
	info := sampleInfo()
	info.Error = strings.Repeat("x", 5000)
	for _, h := range info.Headers() {
		if h.Key == dlq.HeaderError && len(h.Value) != dlq.MaxErrorLen {
			t.Errorf("error header is %d bytes, want %d", len(h.Value), dlq.MaxErrorLen)
		}
	}
}

func TestHeaderPolicy(t *testing.T) {
	t.Parallel()
	var open dlq.HeaderPolicy
	for key, keep := range map[string]bool{
		"Authorization": false, "cookie": false, "Set-Cookie": false, "x-api-key": false, "X-Auth-Token": false,
		"stripe-signature": false, "tenant": true, "message-id": true, "traceparent": true,
		dlq.HeaderTopic: false, dlq.HeaderRedrive: false,
	} {
		if got := open.Keep(key); got != keep {
			t.Errorf("default policy Keep(%q) = %v, want %v", key, got, keep)
		}
	}
	strict := dlq.HeaderPolicy{Allow: []string{"Tenant", "authorization"}, IDHeader: "msg-id"}
	for key, keep := range map[string]bool{"tenant": true, "region": false, "authorization": false, "msg-id": true, "tracestate": true} {
		if got := strict.Keep(key); got != keep {
			t.Errorf("allow-list Keep(%q) = %v, want %v", key, got, keep)
		}
	}
}

func TestNewRecord(t *testing.T) {
	t.Parallel()
	src := &kgo.Record{Topic: "orders", Key: []byte("k"), Value: []byte{0xff, 0x00},
		Headers: []kgo.RecordHeader{{Key: "cookie", Value: []byte("c")}, {Key: "tenant", Value: []byte("t")}}}
	info := sampleInfo()
	rec := dlq.NewRecord("orders.dlq", src, info, dlq.HeaderPolicy{})
	if rec.Topic != "orders.dlq" || string(rec.Key) != "k" || string(rec.Value) != "\xff\x00" {
		t.Fatalf("record %+v", rec)
	}
	got := map[string]string{}
	for _, h := range rec.Headers {
		got[h.Key] = string(h.Value)
	}
	if _, ok := got["cookie"]; ok || got["tenant"] != "t" || got["message-id"] != "m-1" {
		t.Errorf("headers %v", got)
	}
	if decoded, err := dlq.Decode(rec.Headers); err != nil || decoded.MessageID != "m-1" {
		t.Errorf("Decode = %+v, %v", decoded, err)
	}
}

// A dead-letter record keeps no credential-like header of the source
// record, whatever its spelling, under the default policy and under an
// allow-list that names them; the values appear nowhere in it.
func TestNewRecordDropsCredentials(t *testing.T) {
	t.Parallel()
	keys := []string{
		"Authorization", "PROXY-AUTHORIZATION", "x-authorization-context", "Cookie", "set-cookie",
		"X-Auth-Token", "x-amz-security-token", "X-Csrf-Token", "X-Api-Key", "x-apikey", "X_API_KEY", "api_key",
		"X-Auth", "x-jwt-assertion", "X-Bearer", "client_secret", "X-Webhook-Secret", "password", "db-passwd",
		"X-Credential", "Stripe-Signature", "webhook-signature", "X-Hub-Signature-256", "session-id", "Private-Key", "x-private_key",
	}
	src := &kgo.Record{Topic: "orders", Value: []byte("v"), Headers: []kgo.RecordHeader{{Key: "tenant", Value: []byte("t")}}}
	for i, k := range keys {
		src.Headers = append(src.Headers, kgo.RecordHeader{Key: k, Value: []byte(fmt.Sprintf("credential-value-%d", i))})
	}
	for name, policy := range map[string]dlq.HeaderPolicy{
		"default":    {},
		"allow-list": {Allow: append([]string{"tenant"}, keys...)},
	} {
		rec := dlq.NewRecord("orders.dlq", src, sampleInfo(), policy)
		kept := false
		for _, h := range rec.Headers {
			kept = kept || h.Key == "tenant"
			if strings.Contains(string(h.Value), "credential-value-") {
				t.Errorf("%s policy: header %q = %q carries a credential of the source record", name, h.Key, h.Value)
			}
		}
		if !kept {
			t.Errorf("%s policy dropped the plain header tenant", name)
		}
	}
}

func TestPermanentMarkers(t *testing.T) {
	t.Parallel()
	base := errors.New("bad amount")
	wrapped := fmt.Errorf("handler: %w", dlq.Permanent(base))
	if c, ok := dlq.PermanentClass(wrapped); !ok || c != dlq.ClassPermanent || !errors.Is(wrapped, base) {
		t.Errorf("Permanent through wrapping: %v %v", c, ok)
	}
	if c, ok := dlq.PermanentClass(dlq.Undecodable(base)); !ok || c != dlq.ClassUndecodable {
		t.Errorf("Undecodable: %v %v", c, ok)
	}
	if _, ok := dlq.PermanentClass(base); ok {
		t.Error("a plain error is not permanent")
	}
	if dlq.Permanent(nil) != nil || dlq.Undecodable(nil) != nil {
		t.Error("marking nil must stay nil")
	}
}

// FuzzDecode: any header set either decodes to an Info whose headers decode
// to the same Info, or fails with an error; it never panics.
func FuzzDecode(f *testing.F) {
	for _, h := range sampleInfo().Headers() {
		f.Add(h.Key, string(h.Value), "3", "99")
	}
	f.Fuzz(func(t *testing.T, key, value, part, off string) {
		headers := sampleInfo().Headers()
		for i := range headers {
			switch headers[i].Key {
			case key:
				headers[i].Value = []byte(value)
			case dlq.HeaderPartition:
				headers[i].Value = []byte(part)
			case dlq.HeaderOffset:
				headers[i].Value = []byte(off)
			}
		}
		info, err := dlq.Decode(headers)
		if err != nil {
			return
		}
		again, err := dlq.Decode(info.Headers())
		if err != nil {
			t.Fatalf("re-decode of %+v: %v", info, err)
		}
		if again.MessageID != info.MessageID || again.Partition != info.Partition || again.Offset != info.Offset || again.Class != info.Class {
			t.Fatalf("re-decode changed the info: %+v -> %+v", info, again)
		}
	})
}
