package redisstore

import (
	"encoding/binary"
	"reflect"
	"strconv"
	"testing"

	"github.com/oncely/oncely/idempotency"
)

// FuzzDecodeResponse: decodeResponse reads a record as a reference decoder
// built on encoding/binary's Uvarint reads it (the same records refused,
// the same responses returned), never panics, and what it returns encodes
// back to a record that decodes to the same response.
func FuzzDecodeResponse(f *testing.F) {
	f.Add(encodeResponse(nil, idempotency.StoredResponse{Fingerprint: []byte{1, 2}, Status: 201,
		Names: []string{"Content-Type", "Link", "Link"}, Values: []string{"text/plain", "a", "b"}, Body: []byte("made")}))
	f.Add(encodeResponse(nil, idempotency.StoredResponse{Status: 204}))
	for _, bad := range []string{"", "201", "\x03201\x00\x00\x05Name", "\x03201\x00\x80", "\x03201\x00\xff\xff\xff\xff\xff\xff\xff\xff\xff\x02"} {
		f.Add([]byte(bad))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := decodeResponse(string(b))
		want, ok := referenceDecode(b)
		if (err == nil) != ok {
			t.Fatalf("decodeResponse(%q): error %v; the reference decoder accepts it: %v", b, err, ok)
		}
		if err != nil {
			return
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("decodeResponse(%q) = %+v, the reference decoder %+v", b, got, want)
		}
		again, err := decodeResponse(string(encodeResponse(nil, got)))
		if err != nil || !reflect.DeepEqual(again, got) {
			t.Fatalf("re-encoded %+v decodes to %+v, %v", got, again, err)
		}
	})
}

// referenceDecode decodes a record field by field with binary.Uvarint.
func referenceDecode(b []byte) (idempotency.StoredResponse, bool) {
	next := func() ([]byte, bool) {
		n, k := binary.Uvarint(b)
		if k <= 0 || uint64(len(b)-k) < n {
			return nil, false
		}
		f := b[k : k+int(n)]
		b = b[k+int(n):]
		return f, true
	}
	st, ok1 := next()
	fp, ok2 := next()
	body, ok3 := next()
	status, err := strconv.Atoi(string(st))
	if !ok1 || !ok2 || !ok3 || err != nil || status < 100 || status > 999 {
		return idempotency.StoredResponse{}, false
	}
	r := idempotency.StoredResponse{Fingerprint: append([]byte{}, fp...), Status: status, Names: []string{}, Values: []string{}, Body: append([]byte{}, body...)}
	for len(b) > 0 {
		name, ok1 := next()
		value, ok2 := next()
		if !ok1 || !ok2 {
			return idempotency.StoredResponse{}, false
		}
		r.Names, r.Values = append(r.Names, string(name)), append(r.Values, string(value))
	}
	return r, true
}
