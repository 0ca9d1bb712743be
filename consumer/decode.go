package consumer

import (
	"bytes"
	"context"
	"encoding/json"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/dlq"
)

// TypedHandler processes a message whose value was decoded into a T.
type TypedHandler[T any] func(ctx context.Context, tx pgx.Tx, msg *Message, v T) error

// Decoded returns a Handler that decodes each message's value with decode
// and passes the result to h. A decode error dead-letters the record at once
// (class undecodable); h never sees it.
func Decoded[T any](decode func(value []byte) (T, error), h TypedHandler[T]) Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *Message) error {
		v, err := decode(msg.Value)
		if err != nil {
			return dlq.Undecodable(err)
		}
		return h(ctx, tx, msg, v)
	}
}

// JSON is Decoded with encoding/json. Unknown fields are an error, so a
// record of another schema is dead-lettered rather than half-read.
func JSON[T any](h TypedHandler[T]) Handler {
	return Decoded(DecodeJSON[T], h)
}

// DecodeJSON decodes value into a T as JSON does: unknown fields are an
// error. For BatchHandlers and ConflictKeys functions, which decode values
// themselves; mark its error dlq.Undecodable (Message.Fail) to dead-letter
// the message at once.
func DecodeJSON[T any](value []byte) (T, error) {
	var v T
	dec := json.NewDecoder(bytes.NewReader(value))
	dec.DisallowUnknownFields()
	err := dec.Decode(&v)
	return v, err
}
