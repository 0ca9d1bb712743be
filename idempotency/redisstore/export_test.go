package redisstore

import "github.com/oncely/oncely/idempotency"

// DecodeResponse reads a record's resp field, for tests that look at what
// the store wrote.
func DecodeResponse(b []byte) (idempotency.StoredResponse, error) { return decodeResponse(string(b)) }

// EncodeResponse is encodeResponse, for its round-trip test.
var EncodeResponse = encodeResponse
