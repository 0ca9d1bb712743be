package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// Message is a record handed to a Handler.
type Message struct {
	// ID is the dedup id (see Config.KeyFunc and Config.MessageIDHeader).
	ID        string
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []kgo.RecordHeader
	Timestamp time.Time
	// Attempt counts handler runs for this record in this process, from 1.
	Attempt int
	// Record is the underlying franz-go record. Do not modify it.
	Record *kgo.Record

	ctx    context.Context // carries the attempt's process span
	failed error           // set by Fail
}

// Context returns a context that carries the message's own "process" span,
// for what a BatchHandler does for this message alone: an outbox message
// enqueued with it (outbox.Message.Context) continues the message's trace.
// A Handler's ctx is that context already.
func (m *Message) Context() context.Context {
	if m.ctx == nil {
		return context.Background()
	}
	return m.ctx
}

// Fail marks the message failed with err, from a BatchHandler that wrote
// none of its effects: the batch commits without it (its inbox claim is
// released in the same transaction), and the message is retried or
// dead-lettered alone, on the record path, as if a Handler had returned err
// (dlq.Permanent and dlq.Undecodable dead-letter it at once). It lets a
// batch handler set aside a poison message without failing the batch. A
// later message with the same key in the batch is not held back: fail it
// too where per-key order matters. Outside a BatchHandler it does nothing.
func (m *Message) Fail(err error) {
	if err == nil {
		err = errors.New("consumer: message failed by its batch handler")
	}
	m.failed = err
}

func newMessage(rec *kgo.Record, id string, attempt int) *Message {
	return &Message{
		ID: id, Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset,
		Key: rec.Key, Value: rec.Value, Headers: rec.Headers, Timestamp: rec.Timestamp,
		Attempt: attempt, Record: rec,
	}
}

// Header returns the value of the first header named key.
func (m *Message) Header(key string) (string, bool) {
	for _, h := range m.Headers {
		if h.Key == key {
			return string(h.Value), true
		}
	}
	return "", false
}

// PanicError is the error recorded for a handler that panicked.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("consumer: handler panicked: %v", e.Value) }

// Stats are a consumer's counters since it was created.
type Stats struct {
	Processed      int64 // records whose handler ran and committed
	Duplicates     int64 // records skipped because their id was already in the inbox
	Retries        int64 // failed attempts that were retried
	DeadLettered   int64 // records written to a dead-letter topic and recorded in the inbox
	DeadLetterErrs int64 // failed dead-letter produces (each retried)
	OffsetCommits  int64 // successful offset commit requests
	Batches        int64 // batch transactions committed (batch mode)
	PartitionsHeld int64 // partitions assigned to the member right now, each with a live worker
	// Concurrency is how many transactions the member runs at once right
	// now: Config.Concurrency, or its share of Config.GroupConcurrency.
	Concurrency int64
	// Contention counts records whose transaction lost to another one
	// (deadlock, serialization failure, lock timeout) and ran again; they
	// spend no attempt and are never dead-lettered for it.
	Contention int64
	// CrashProbes counts partitions that started in probe because their
	// previous owner died (see Config.CrashLoopLimit).
	CrashProbes int64
	// CrashLoops counts records dead-lettered because the process died
	// while running them CrashLoopLimit times (class crash_loop).
	CrashLoops int64
	// TurnWaits counts transactions that waited, in the process, for
	// another transaction of this member that shares a conflict key
	// (Config.ConflictKeys) to end, rather than in Postgres.
	TurnWaits int64
}
