package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// ParkedRow is an outbox row the relay parked: the broker refused it for a
// reason that retrying would not change (see Relay). It stays in the outbox,
// unpublished, with the later rows of its (topic, key) held behind it, until
// [Outbox.Retry] or [Outbox.Discard].
type ParkedRow struct {
	ID        int64 // the outbox row id, which Retry and Discard take
	MessageID string
	Topic     string
	Key       []byte
	Size      int64 // bytes of key, value and headers
	Error     string
	ParkedAt  time.Time
	Held      int64 // later rows of the same (topic, key) waiting behind it
}

// ErrNotParked is returned by Retry and Discard for an id that is not a
// parked row (never was, or already retried, discarded or published).
var ErrNotParked = errors.New("outbox: no parked row with this id")

// Parked lists parked rows, oldest first, at most limit (0: all).
func (o *Outbox) Parked(ctx context.Context, db DBTX, limit int) ([]ParkedRow, error) {
	return o.ParkedAfter(ctx, db, 0, limit)
}

// ParkedAfter lists the parked rows whose id is above after, oldest first,
// at most limit (0: all): a page of Parked, the next one starting after the
// last id returned.
//
// The rows held behind each parked row are counted in one pass over the
// pending rows (a hash join), not by a query per parked row: with a large
// backlog, a per-row count walks the shard's pending rows once for every
// parked row listed.
func (o *Outbox) ParkedAfter(ctx context.Context, db DBTX, after int64, limit int) ([]ParkedRow, error) {
	if limit < 0 {
		return nil, fmt.Errorf("outbox: parked: limit %d is negative", limit)
	}
	var lim *int
	if limit > 0 {
		lim = &limit
	}
	rows, err := db.Query(ctx, `WITH p AS MATERIALIZED (
			SELECT id, message_id, topic, key, shard,
				coalesce(octet_length(key), 0) + coalesce(octet_length(value), 0)
					+ coalesce((SELECT sum(octet_length(k)) FROM unnest(header_keys) k), 0)
					+ coalesce((SELECT sum(octet_length(v)) FROM unnest(header_values) v), 0) AS size,
				coalesce(error, '') AS error, parked_at
			FROM `+o.table+` WHERE parked_at IS NOT NULL AND sent_at IS NULL AND id > $2 ORDER BY id LIMIT $1),
		held AS (
			SELECT p.id, count(*) AS n FROM p JOIN `+o.table+` h ON h.shard = p.shard AND h.topic = p.topic AND h.key = p.key
				AND h.id > p.id AND h.sent_at IS NULL AND h.parked_at IS NULL
			GROUP BY p.id)
		SELECT p.id, p.message_id, p.topic, p.key, p.size, p.error, p.parked_at, coalesce(held.n, 0)
		FROM p LEFT JOIN held ON held.id = p.id ORDER BY p.id`, lim, after)
	if err != nil {
		return nil, fmt.Errorf("outbox: parked: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ParkedRow])
	if err != nil {
		return nil, fmt.Errorf("outbox: parked: %w", err)
	}
	return out, nil
}

// Retry un-parks the row id: a relay publishes it again, and the rows of its
// (topic, key) held behind it after it, in order. If the broker still
// refuses it, it is parked again. Fix the cause first (raise the topic's
// max.message.bytes, create the topic, grant the ACL).
func (o *Outbox) Retry(ctx context.Context, db DBTX, id int64) error {
	n, err := o.unpark(ctx, db, "outbox: retry", `UPDATE `+o.table+` SET parked_at = NULL, error = NULL
		WHERE id = $2 AND parked_at IS NOT NULL AND sent_at IS NULL RETURNING id`, id)
	if err == nil && n == 0 {
		return fmt.Errorf("%w %d", ErrNotParked, id)
	}
	return err
}

// RetryAll un-parks every parked row, as Retry does, and returns how many.
func (o *Outbox) RetryAll(ctx context.Context, db DBTX) (int64, error) {
	return o.unpark(ctx, db, "outbox: retry all", `UPDATE `+o.table+` SET parked_at = NULL, error = NULL
		WHERE parked_at IS NOT NULL AND sent_at IS NULL RETURNING id`)
}

// Discard deletes the parked row id for good: it is never published, and
// the rows of its (topic, key) held behind it flow. Downstream consumers
// never see it; keep a copy (Parked) if anyone needs it.
func (o *Outbox) Discard(ctx context.Context, db DBTX, id int64) error {
	n, err := o.unpark(ctx, db, "outbox: discard", `DELETE FROM `+o.table+`
		WHERE id = $2 AND parked_at IS NOT NULL AND sent_at IS NULL RETURNING id`, id)
	if err == nil && n == 0 {
		return fmt.Errorf("%w %d", ErrNotParked, id)
	}
	return err
}

// unpark runs change (an UPDATE or DELETE ... RETURNING id, taking the
// notification channel as $1) and wakes the relays in the same statement.
func (o *Outbox) unpark(ctx context.Context, db DBTX, op, change string, args ...any) (int64, error) {
	var n int64
	err := db.QueryRow(ctx, `WITH c AS (`+change+`)
		SELECT count(*), (SELECT pg_notify($1, '')) FROM c`, append([]any{o.channel}, args...)...).Scan(&n, nil)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", op, err)
	}
	return n, nil
}
