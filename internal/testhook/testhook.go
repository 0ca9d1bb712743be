// Package testhook holds the named crash and pause points that oncely's own
// tests arm. The hooks travel in the context given to Run, so they cost a nil
// check when unarmed and cannot be set from outside this module.
package testhook

import (
	"context"
	"errors"

	"github.com/twmb/franz-go/pkg/kgo"
)

// ErrCrash, returned by a hook, makes the component behave as if its process
// died at that point: it stops at once and commits nothing more (no offsets,
// no marks), and Run returns an error wrapping ErrCrash.
var ErrCrash = errors.New("testhook: simulated crash")

// Consumer holds the consumer's hook points. Nil fields are skipped.
type Consumer struct {
	// AfterCommit runs after a record's database transaction committed and
	// before its offset is marked for commit.
	AfterCommit func(rec *kgo.Record) error
	// AfterDeadLetter runs after a record's dead-letter produce was
	// acknowledged and the inbox recorded it, before its offset is marked.
	AfterDeadLetter func(rec *kgo.Record) error
	// AfterRetryCopy runs where a broker source hands a failed record back
	// as a copy (package rabbitconsumer's retry queue): after the copy was
	// confirmed, before the original is acknowledged.
	AfterRetryCopy func(rec *kgo.Record) error
}

type consumerKey struct{}

// WithConsumer returns ctx carrying h.
func WithConsumer(ctx context.Context, h *Consumer) context.Context {
	return context.WithValue(ctx, consumerKey{}, h)
}

// ConsumerFrom returns the hooks in ctx, or an empty set.
func ConsumerFrom(ctx context.Context) *Consumer {
	if h, ok := ctx.Value(consumerKey{}).(*Consumer); ok && h != nil {
		return h
	}
	return &Consumer{}
}

// Relay holds the outbox relay's hook points. Nil fields are skipped.
type Relay struct {
	// AfterProduce runs after a batch was acknowledged by the broker and
	// before its rows are marked sent.
	AfterProduce func(n int) error
}

type relayKey struct{}

// WithRelay returns ctx carrying h.
func WithRelay(ctx context.Context, h *Relay) context.Context {
	return context.WithValue(ctx, relayKey{}, h)
}

// RelayFrom returns the hooks in ctx, or an empty set.
func RelayFrom(ctx context.Context) *Relay {
	if h, ok := ctx.Value(relayKey{}).(*Relay); ok && h != nil {
		return h
	}
	return &Relay{}
}
