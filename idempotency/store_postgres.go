package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncely/oncely/internal/sqlident"
)

// pgStore is the Postgres Store: each claim is an open transaction that
// holds the key's advisory lock and its row; the handler's writes join it
// (see Tx), and the response commits with them.
type pgStore struct {
	db     DB
	schema string
	q      queries
}

type queries struct {
	claim, load, record, deleteExpired string
}

func newPGStore(db DB, schema string) *pgStore {
	t := sqlident.Table(schema, "idempotency_keys")
	return &pgStore{db: db, schema: schema, q: queries{
		// One round trip decides the request's fate. The advisory
		// lock is the "in progress" marker: it is tried without
		// waiting (held = false: another open transaction owns the
		// key, 409) and lives exactly as long as this transaction.
		// Only then is the row inserted; claimed = false means a
		// committed row holds the key (replay or 422). A committed
		// row that has expired, or that holds no response (status 0:
		// only possible if a handler committed the transaction behind
		// the middleware's back), is taken over. The lock CTE is
		// materialized, so it runs once, before the insert reads it.
		claim: `WITH held_lock AS MATERIALIZED (
				SELECT pg_try_advisory_xact_lock($5::bigint) AS held
			), claimed AS (
				INSERT INTO ` + t + ` AS k (scope, key, fingerprint, expires_at)
				SELECT $1::text, $2::text, $3::bytea, now() + make_interval(secs => $4::float8)
				FROM held_lock WHERE held_lock.held
				ON CONFLICT (scope, key) DO UPDATE
				SET fingerprint = EXCLUDED.fingerprint, status = 0,
				    header_names = '{}', header_values = '{}', body = '',
				    created_at = now(), completed_at = NULL, expires_at = EXCLUDED.expires_at
				WHERE k.expires_at <= now() OR k.status = 0
				RETURNING 1
			)
			SELECT held, EXISTS (SELECT FROM claimed) FROM held_lock`,
		load: `SELECT fingerprint, status, header_names, header_values, body
			FROM ` + t + ` WHERE scope = $1 AND key = $2`,
		record: `UPDATE ` + t + `
			SET status = $3, header_names = $4, header_values = $5, body = $6, completed_at = now()
			WHERE scope = $1 AND key = $2 AND status = 0`,
		// Database time decides expiry; SKIP LOCKED steps over rows a
		// request is taking over or replaying right now.
		deleteExpired: `DELETE FROM ` + t + ` WHERE (scope, key) IN (
			SELECT scope, key FROM ` + t + `
			WHERE expires_at <= now()
			ORDER BY expires_at
			LIMIT $1
			FOR UPDATE SKIP LOCKED)`,
	}}
}

// Claim begins the request's transaction and claims the key as its first
// statement. The transaction stays open while the lease lives.
func (s *pgStore) Claim(ctx context.Context, scope, key string, fp []byte, ttl time.Duration) (Claim, error) {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return Claim{}, fmt.Errorf("begin: %w", err)
	}
	var held, claimed bool
	err = tx.QueryRow(ctx, s.q.claim, scope, key, fp, ttl.Seconds(), lockKey(s.schema, scope, key)).Scan(&held, &claimed)
	switch {
	case isBusy(err):
		rollback(ctx, tx)
		return Claim{State: ClaimBusy}, nil
	case err != nil:
		rollback(ctx, tx)
		return Claim{}, fmt.Errorf("claim key: %w", err)
	case !held:
		rollback(ctx, tx)
		return Claim{State: ClaimBusy}, nil
	case !claimed:
		return s.load(ctx, tx, scope, key)
	}
	return Claim{State: ClaimTaken, Lease: &pgLease{tx: tx, s: s, scope: scope, key: key}}, nil
}

// load reads the committed row that holds the key, and ends tx at once so
// that a replay to a slow client holds no lock.
func (s *pgStore) load(ctx context.Context, tx pgx.Tx, scope, key string) (Claim, error) {
	var r StoredResponse
	err := tx.QueryRow(ctx, s.q.load, scope, key).Scan(&r.Fingerprint, &r.Status, &r.Names, &r.Values, &r.Body)
	rollback(ctx, tx)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Claim{State: ClaimBusy}, nil // deleted by cleanup a moment ago: the retry runs afresh
	case err != nil:
		return Claim{}, fmt.Errorf("load response: %w", err)
	case r.Status == 0 || len(r.Names) != len(r.Values):
		return Claim{}, fmt.Errorf("load response: corrupt row: status %d, %d header names, %d values", r.Status, len(r.Names), len(r.Values))
	}
	return Claim{State: ClaimStored, Stored: r}, nil
}

type pgLease struct {
	tx         pgx.Tx
	s          *pgStore
	scope, key string
}

func (l *pgLease) Context(ctx context.Context) context.Context {
	return context.WithValue(ctx, txKey{}, pgx.Tx(ownedTx{l.tx}))
}

func (l *pgLease) Failed() bool { return l.tx.Conn().PgConn().TxStatus() == 'E' }

func (l *pgLease) Record(ctx context.Context, r StoredResponse) error {
	tag, err := l.tx.Exec(ctx, l.s.q.record, l.scope, l.key, r.Status, r.Names, r.Values, r.Body)
	if err == nil && tag.RowsAffected() != 1 {
		err = errors.New("the key row is gone")
	}
	if err == nil {
		err = l.tx.Commit(ctx)
	}
	if err != nil {
		return fmt.Errorf("record response: %w", err)
	}
	return nil
}

func (l *pgLease) Release(ctx context.Context) { rollback(ctx, l.tx) }

// isBusy reports a lock that could not be taken at once: lock_not_available
// (55P03, e.g. under a lock_timeout set for the role) or, under REPEATABLE
// READ or SERIALIZABLE defaults, a serialization failure (40001) against a
// concurrent request for the same key.
func isBusy(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "55P03" || pgErr.Code == "40001")
}

func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = tx.Rollback(ctx) // after a commit or a first rollback: ErrTxClosed
}
