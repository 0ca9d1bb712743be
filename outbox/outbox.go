package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncely/oncely/internal/pending"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/internal/telemetry"
)

// DefaultShards is the number of shards messages are spread over.
const DefaultShards = 64

// MessageIDHeader is the header that carries a message's id.
const MessageIDHeader = "message-id"

// Header is a record header.
type Header struct {
	Key   string
	Value []byte
}

// MaxIDLen bounds a caller-supplied message id in bytes.
const MaxIDLen = 1024

// Message is an event to publish.
type Message struct {
	// ID is the message id. Empty: a new UUIDv7. Set it to an id the
	// message already has (a webhook provider's delivery id, say): a second
	// Enqueue of an id that is still in the outbox is skipped and reported
	// as Duplicate, and downstream inboxes dedup any republish.
	ID      string
	Topic   string // required
	Key     []byte // messages with equal (Topic, Key) are published in commit order
	Value   []byte
	Headers []Header
	// Context, when set, is the context whose span the message's trace
	// continues, in place of Enqueue's ctx: one Enqueue that carries the
	// events of a whole batch of consumed messages gives each event the
	// trace of its own message (consumer.Message.Context).
	Context context.Context
}

// Config configures an Outbox.
type Config struct {
	// Schema holds the outbox table (package migrations). Default "oncely".
	Schema string
	// Shards is the number of shards, which bounds how many relays can
	// publish in parallel. All enqueuers and relays of a schema must agree;
	// change it only while nothing is pending. Default 64.
	Shards int
}

// Outbox enqueues messages into the outbox table.
type Outbox struct {
	schema  string
	shards  int
	channel string
	table   string
	insert  string
	lock    string
	delete  string
}

// New returns an Outbox.
func New(cfg Config) (*Outbox, error) {
	schema := cmp.Or(cfg.Schema, sqlident.DefaultSchema)
	if err := sqlident.ValidateSchema("outbox: Config.Schema", schema); err != nil {
		return nil, err
	}
	if cfg.Shards < 0 || cfg.Shards > 1<<16 {
		return nil, fmt.Errorf("outbox: Config.Shards: %d is outside 1..65536", cfg.Shards)
	}
	t := sqlident.Table(schema, "outbox")
	return &Outbox{
		schema:  schema,
		shards:  cmp.Or(cfg.Shards, DefaultShards),
		channel: "oncely_outbox_" + schema,
		table:   t,
		// Headers travel flattened; each message takes its slice [hs:he].
		insert: `INSERT INTO ` + t + ` (message_id, topic, key, value, header_keys, header_values, shard)
			SELECT u.id, u.topic, u.key, u.value, ($7::text[])[u.hs:u.he], ($8::bytea[])[u.hs:u.he], u.shard
			FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::int[], $6::int[], $9::int[])
			     WITH ORDINALITY AS u(id, topic, key, value, shard, hs, he, n)
			ORDER BY u.n
			ON CONFLICT (message_id) DO NOTHING
			RETURNING message_id`,
		// Sorted, so two transactions locking overlapping key sets cannot
		// deadlock on each other.
		delete: `DELETE FROM ` + t + ` WHERE id IN (SELECT id FROM ` + t + `
			WHERE sent_at < now() - make_interval(secs => $1) ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED)`,
		lock: `SELECT pg_advisory_xact_lock(k) FROM (SELECT DISTINCT unnest($1::bigint[]) AS k ORDER BY 1) s`,
	}, nil
}

// Enqueued is a message as it was stored.
type Enqueued struct {
	MessageID string
	Shard     int
	// Duplicate: a message with this id was already in the outbox (or
	// earlier in the same call); nothing was stored for this one.
	Duplicate bool
}

// Enqueue stores msgs in the caller's transaction, in order, in one round
// trip, and returns their message ids. Each message gets a UUIDv7
// message-id header and, when ctx (or the message's Context) carries a span,
// the W3C trace context. The messages are published after tx commits; if it
// rolls back, nothing is.
//
// Enqueue waits while another open transaction has enqueued a message with
// one of the same (topic, key) pairs: that is what keeps per-key order equal
// to commit order. Keep enqueuing transactions short.
//
// Inside a consumer batch (a consumer.Handler run in batch mode), messages
// without an ID are not sent at once: their ids and shards are assigned now,
// and they are written with those of the batch's other records, in one
// statement, just before the batch commits, their per-key locks taken then
// in sorted order. A record whose handler fails takes its messages with it.
// Messages with an ID are written at once, so that Duplicate can be told.
func (o *Outbox) Enqueue(ctx context.Context, tx pgx.Tx, msgs ...Message) ([]Enqueued, error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	q := pending.From(ctx)
	for _, m := range msgs {
		if m.ID != "" {
			q = nil
		}
	}
	rows, out, err := o.prepare(ctx, msgs)
	if err != nil {
		return nil, err
	}
	if q != nil {
		for _, r := range rows {
			q.Add(o, r)
		}
		return out, nil
	}
	stored, err := o.write(ctx, tx, rows)
	if err != nil {
		return nil, err
	}
	for i := range out {
		out[i].Duplicate = !stored[out[i].MessageID]
		delete(stored, out[i].MessageID) // a repeat within the call is a duplicate
	}
	return out, nil
}

// WritePending writes the messages Enqueue queued in a consumer batch.
func (o *Outbox) WritePending(ctx context.Context, tx pgx.Tx, items []any) error {
	rows := make([]*row, len(items))
	for i, it := range items {
		rows[i] = it.(*row)
	}
	_, err := o.write(ctx, tx, rows)
	return err
}

// row is a message ready to be written.
type row struct {
	id, topic  string
	key, value []byte
	shard      int32
	lock       int64 // 0: no key, no lock
	hkeys      []string
	hvals      [][]byte
}

// prepare checks msgs and turns them into rows: ids assigned, shards and
// lock ids computed, headers (message id, trace context) added.
func (o *Outbox) prepare(ctx context.Context, msgs []Message) ([]*row, []Enqueued, error) {
	rows, out := make([]*row, len(msgs)), make([]Enqueued, len(msgs))
	traceparent, tracestate := telemetry.TraceContext(ctx)
	carrier := map[string]string{"traceparent": traceparent, "tracestate": tracestate}
	for i, m := range msgs {
		if err := ValidateTopic(m.Topic); err != nil {
			return nil, nil, fmt.Errorf("outbox: enqueue: message %d: %w", i, err)
		}
		id := m.ID
		if id == "" {
			u, err := uuid.NewV7()
			if err != nil {
				return nil, nil, fmt.Errorf("outbox: enqueue: message id: %w", err)
			}
			id = u.String()
		} else if len(id) > MaxIDLen {
			return nil, nil, fmt.Errorf("outbox: enqueue: message %d: id of %d bytes exceeds %d", i, len(id), MaxIDLen)
		}
		r := &row{id: id, topic: m.Topic, key: m.Key, value: m.Value}
		if m.Key != nil {
			r.shard = int32(keyHash(m.Topic, m.Key) % uint64(o.shards))
			r.lock = lockID(o.schema, m.Topic, m.Key)
		} else {
			r.shard = int32(fnvString(id) % uint64(o.shards)) // no order to keep: spread
		}
		out[i] = Enqueued{MessageID: id, Shard: int(r.shard)}
		add := func(k string, v []byte) { r.hkeys, r.hvals = append(r.hkeys, k), append(r.hvals, v) }
		add(MessageIDHeader, []byte(id))
		tc := carrier
		if m.Context != nil {
			tp, ts := telemetry.TraceContext(m.Context)
			tc = map[string]string{"traceparent": tp, "tracestate": ts}
		}
		for _, k := range []string{"traceparent", "tracestate"} {
			if v := tc[k]; v != "" && !hasHeader(m.Headers, k) {
				add(k, []byte(v))
			}
		}
		for _, hd := range m.Headers {
			if hd.Key == MessageIDHeader {
				return nil, nil, fmt.Errorf("outbox: enqueue: message %d sets the %s header, which the outbox assigns", i, MessageIDHeader)
			}
			add(hd.Key, hd.Value)
		}
		rows[i] = r
	}
	return rows, out, nil
}

// write inserts rows in one round trip: the per-key locks (sorted), the
// multi-row insert, the notification. It returns the ids it stored (not
// those already in the outbox).
func (o *Outbox) write(ctx context.Context, tx pgx.Tx, rows []*row) (map[string]bool, error) {
	n := len(rows)
	var (
		ids          = make([]string, n)
		topics       = make([]string, n)
		keys, values = make([][]byte, n), make([][]byte, n)
		shards       = make([]int32, n)
		hstart, hend = make([]int32, n), make([]int32, n)
		locks        []int64
		hkeys        []string
		hvals        [][]byte
	)
	for i, r := range rows {
		ids[i], topics[i], keys[i], values[i], shards[i] = r.id, r.topic, r.key, r.value, r.shard
		if r.key != nil {
			locks = append(locks, r.lock)
		}
		hstart[i] = int32(len(hkeys) + 1) // SQL arrays count from 1
		hkeys, hvals = append(hkeys, r.hkeys...), append(hvals, r.hvals...)
		hend[i] = int32(len(hkeys))
	}
	b := &pgx.Batch{}
	if len(locks) > 0 {
		b.Queue(o.lock, locks)
	}
	stored := make(map[string]bool, n)
	b.Queue(o.insert, ids, topics, keys, values, shards, hstart, hkeys, hvals, hend).Query(func(rows pgx.Rows) error {
		var id string
		_, err := pgx.ForEachRow(rows, []any{&id}, func() error { stored[id] = true; return nil })
		return err
	})
	if w := pending.WakesFrom(ctx); w != nil {
		w.Add(o.channel) // the consumer notifies after its commit
	} else {
		b.Queue(`SELECT pg_notify($1, '')`, o.channel)
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("outbox: enqueue: %w", err)
	}
	return stored, nil
}

// lockID is the advisory lock that serializes the enqueuers of one (topic,
// key) in one schema. The schema is part of it: outboxes of two schemas in
// one database never wait on each other.
func lockID(schema, topic string, key []byte) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("oncely-outbox\x00"))
	_, _ = h.Write([]byte(schema))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(topic))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write(key)
	return int64(h.Sum64() >> 1)
}

func fnvString(s string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(s))
	return h.Sum64()
}

func hasHeader(hs []Header, k string) bool {
	for _, h := range hs {
		if h.Key == k {
			return true
		}
	}
	return false
}

// keyHash is the 63-bit hash of (topic, key) that picks the shard. It is
// part of the storage format: do not change it.
func keyHash(topic string, key []byte) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(topic))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write(key)
	return h.Sum64() >> 1 // fits a bigint without sign games
}

// MaxTopicLen is the longest topic name Kafka accepts.
const MaxTopicLen = 249

// ValidateTopic reports why Kafka would refuse topic as a topic name: it
// must be 1 to 249 characters of ASCII letters, digits, '.', '_' and '-',
// and neither "." nor "..". Enqueue refuses such messages at once, since no
// broker would ever accept them.
func ValidateTopic(topic string) error {
	switch {
	case topic == "":
		return errors.New("no topic")
	case len(topic) > MaxTopicLen:
		return fmt.Errorf("topic name of %d bytes exceeds %d", len(topic), MaxTopicLen)
	case topic == "." || topic == "..":
		return fmt.Errorf("topic name %q is not allowed", topic)
	}
	for _, c := range []byte(topic) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("topic name %q has a character Kafka does not allow (want ASCII letters, digits, '.', '_', '-')", topic)
		}
	}
	return nil
}

// Status is the outbox's backlog.
type Status struct {
	// Pending rows wait to be published; rows held behind a parked row of
	// their (topic, key) count here.
	Pending       int64
	OldestPending time.Duration // age of the oldest pending message (database time); 0 when none
	Sent          int64         // sent rows not yet removed by retention
	Parked        int64         // rows the broker refused for good, waiting for Retry or Discard
}

// DBTX is a connection, pool or transaction.
type DBTX interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Status reports the backlog, for metrics and `oncely outbox status`.
func (o *Outbox) Status(ctx context.Context, db DBTX) (Status, error) {
	var s Status
	var oldest *time.Duration
	err := db.QueryRow(ctx, `SELECT
		count(*) FILTER (WHERE sent_at IS NULL AND parked_at IS NULL),
		now() - min(created_at) FILTER (WHERE sent_at IS NULL AND parked_at IS NULL),
		count(*) FILTER (WHERE sent_at IS NOT NULL),
		count(*) FILTER (WHERE parked_at IS NOT NULL AND sent_at IS NULL)
		FROM `+o.table).Scan(&s.Pending, &oldest, &s.Sent, &s.Parked)
	if err != nil {
		return s, fmt.Errorf("outbox: status: %w", err)
	}
	if oldest != nil {
		s.OldestPending = *oldest
	}
	return s, nil
}

// Execer runs a statement; *pgxpool.Pool and pgx.Tx satisfy it.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// DeleteSent deletes sent rows older than retention in batches of batch
// rows, using database time, and returns how many it deleted.
func (o *Outbox) DeleteSent(ctx context.Context, db Execer, retention time.Duration, batch int) (int64, error) {
	if retention < 0 || batch <= 0 {
		return 0, fmt.Errorf("outbox: delete sent: retention %s and batch %d must be non-negative and positive", retention, batch)
	}
	var total int64
	for {
		tag, err := db.Exec(ctx, o.delete, retention.Seconds(), batch)
		if err != nil {
			return total, fmt.Errorf("outbox: delete sent: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) || ctx.Err() != nil {
			return total, ctx.Err()
		}
	}
}
