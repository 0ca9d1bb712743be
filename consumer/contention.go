package consumer

import (
	"errors"
	"hash/fnv"
	"slices"
	"strconv"
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

// conflictHash maps a conflict key to its advisory lock id. Keys are scoped
// to the schema of oncely's tables: consumers that share it share keys,
// whatever their group. The namespace keeps the ids apart from the
// outbox's per-key locks; a collision of two keys only makes their
// transactions take turns.
func conflictHash(schema, key string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("oncely-conflict\x00"))
	_, _ = h.Write([]byte(schema))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(key))
	return int64(h.Sum64() >> 1)
}

// lockIDs returns keys sorted and without duplicates, in a slice of its own:
// the order in which a transaction takes its locks, and what it holds in
// the member's conflictGate.
func lockIDs(keys []int64) []int64 {
	if len(keys) == 0 {
		return nil
	}
	keys = slices.Clone(keys) // a batch that runs again locks the same keys
	slices.Sort(keys)
	return slices.Compact(keys)
}

// conflictLocks returns the statement that locks ids (from lockIDs), for the
// round trip that begins the transaction, or nothing when there are none.
func conflictLocks(ids []int64) []dedup.Statement {
	if len(ids) == 0 {
		return nil
	}
	return []dedup.Statement{{SQL: conflictLock, Args: []any{ids}}}
}

// setLockTimeout bounds a transaction's lock waits (Config.BatchLockTimeout).
const setLockTimeout = `SELECT set_config('lock_timeout', $1, true)`

// serialWindow is how long a consumer without conflict keys runs its
// transactions one at a time, group-wide, after one of them last lost to
// contention.
const serialWindow = 10 * time.Second

// serial reports whether the consumer is in its serial window.
func (c *Consumer) serial() bool {
	return c.cfg.ConflictKeys == nil && time.Now().UnixNano() < c.serialUntil.Load()
}

// lostToContention opens (or extends) the serial window of a consumer
// without conflict keys. Without keys nothing tells which transactions
// conflict, so after a loss all of them take one group-wide lock: the
// group's transactions take turns, as transactions sharing a conflict key
// would, until contention has not been seen for serialWindow; members whose
// window is closed lose to it in turn and join it.
func (c *Consumer) lostToContention() {
	if c.cfg.ConflictKeys != nil {
		return
	}
	was := c.serial()
	c.serialUntil.Store(time.Now().Add(serialWindow).UnixNano())
	if !was {
		c.cfg.Logger.Info("oncely transactions lost to contention; running them one at a time, group-wide, until none has for a while (set ConflictKeys to run the others side by side)",
			"group", c.cfg.Group, "window", serialWindow)
	}
}

// groupLock is the lock id of the serial window.
func (c *Consumer) groupLock() []int64 {
	return []int64{conflictHash(c.cfg.Schema, "oncely-serial\x00"+c.cfg.Group)}
}

// locking returns the lock ids of a record's transaction, from the lock ids
// of its conflict keys: those, or in the serial window the group-wide
// lock's. The transaction takes them in the round trip that begins it
// (conflictLocks), after its turn in the member's conflictGate.
func (c *Consumer) locking(locks []int64) []int64 {
	if c.serial() {
		return c.groupLock()
	}
	return lockIDs(locks)
}

// batchLocking is locking for a batch transaction, with what else its first
// round trip sends: outside the serial window a batch without conflict keys
// bounds its lock waits instead.
func (c *Consumer) batchLocking(locks []int64) ([]int64, []dedup.Statement) {
	switch {
	case c.cfg.ConflictKeys != nil:
		ids := lockIDs(locks)
		return ids, conflictLocks(ids)
	case c.serial():
		ids := c.groupLock()
		return ids, conflictLocks(ids)
	case c.cfg.BatchLockTimeout <= 0:
		return nil, nil
	}
	return nil, []dedup.Statement{{SQL: setLockTimeout, Args: []any{strconv.FormatInt(c.cfg.BatchLockTimeout.Milliseconds(), 10) + "ms"}}}
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
		dst = append(dst, conflictHash(c.cfg.Schema, k))
	}
	return dst, nil
}
