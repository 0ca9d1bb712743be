package redisstore

// DecodeResponse reads a record's resp field, for tests that look at what
// the store wrote.
var DecodeResponse = decodeResponse

// EncodeResponse is encodeResponse, for its round-trip test.
var EncodeResponse = encodeResponse
