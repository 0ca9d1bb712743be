package redisstore

import (
	"errors"

	"github.com/oncely/oncely/idempotency"
)

// DecodeRecord reads a key's value as the store wrote it for a recorded
// response, for tests that look at what the store wrote.
func DecodeRecord(v string) (idempotency.StoredResponse, error) {
	if v == "" || v[0] != tagRecorded {
		return idempotency.StoredResponse{}, errors.New("not a recorded response")
	}
	return decodeResponse(v[1:])
}

// DecodeResponse and EncodeResponse are decodeResponse and encodeResponse,
// for their round-trip test.
func DecodeResponse(b []byte) (idempotency.StoredResponse, error) { return decodeResponse(string(b)) }

func EncodeResponse(r idempotency.StoredResponse) []byte { return encodeResponse(nil, r) }
