package consumer

import (
	"errors"
	"hash/fnv"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/internal/backoff"
)

// Contention is what two transactions that want the same rows do to each
// other: Postgres breaks a deadlock by failing one of them (40P01), refuses
// a serializable transaction that raced another (40001), or gives up
// waiting for a lock after lock_timeout (55P03). None of it is the record's
// fault: a contention failure is retried at once, after a short jittered
// pause, without spending the record's attempts, and never dead-letters it.
func isContention(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case "40P01", "40001", "55P03":
		return true
	}
	return false
}

// contentionBackoff spaces the retries of a transaction that lost to
// contention: the transaction it lost to usually commits within
// milliseconds, and waiting longer only keeps the record's partition idle.
var contentionBackoff = backoff.Policy{Base: 2 * time.Millisecond, Max: 200 * time.Millisecond}

// conflictLock takes one transaction-scoped advisory lock per distinct
// conflict key, in ascending order, in one statement. Every transaction
// that locks its keys through it, before its handler touches any row, takes
// its locks in one global order, so two of them can wait on each other but
// never deadlock; and a handler that only writes rows covered by its keys
// never waits on a row lock held by another such transaction.
const conflictLock = `SELECT pg_advisory_xact_lock(k) FROM (SELECT DISTINCT unnest($1::bigint[]) AS k ORDER BY 1) s`

// conflictHash maps a conflict key to its advisory lock id. The namespace
// keeps the ids apart from the outbox's per-key locks; a collision of two
// keys only makes their transactions take turns.
func conflictHash(key string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("oncely-conflict\x00"))
	_, _ = h.Write([]byte(key))
	return int64(h.Sum64() >> 1)
}

// conflictLocks returns the statement that locks keys, for the round trip
// that begins the transaction, or nothing when there are no keys.
func conflictLocks(keys []int64) []dedup.Statement {
	if len(keys) == 0 {
		return nil
	}
	slices.Sort(keys)
	return []dedup.Statement{{SQL: conflictLock, Args: []any{slices.Compact(keys)}}}
}

// conflictKeys runs Config.ConflictKeys for msg and appends the lock ids of
// its keys to dst. A panic in it is returned as a *PanicError: the record
// failed, as if its handler had panicked.
func (c *Consumer) conflictKeys(dst []int64, msg *Message) (_ []int64, err error) {
	if c.cfg.ConflictKeys == nil {
		return dst, nil
	}
	defer recoverPanic(&err)
	for _, k := range c.cfg.ConflictKeys(msg) {
		dst = append(dst, conflictHash(k))
	}
	return dst, nil
}
