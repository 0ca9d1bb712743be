package idempotency

import (
	"context"
	"fmt"
	"time"
)

// DeleteExpired deletes rows whose TTL has passed (by database time), in
// batches of Config.CleanupBatchSize until none are left, and returns how
// many it deleted. Expired rows are already ignored by requests (a request
// takes an expired key over), so cleanup only bounds the table's size.
//
// Only the Postgres store (New) has rows to delete; with another store
// DeleteExpired returns 0 at once (Redis expires its keys itself).
func (m *Middleware) DeleteExpired(ctx context.Context) (int64, error) {
	if m.pg == nil {
		return 0, nil
	}
	var total int64
	for {
		tag, err := m.pg.db.Exec(ctx, m.pg.q.deleteExpired, m.cfg.CleanupBatchSize)
		if err != nil {
			return total, fmt.Errorf("idempotency: delete expired: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(m.cfg.CleanupBatchSize) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// Run calls DeleteExpired at once and then every Config.CleanupInterval
// until ctx is done. Failures are logged and retried at the next pass. It
// returns nil when ctx ends. Run it on one or several replicas: concurrent
// passes skip each other's rows.
func (m *Middleware) Run(ctx context.Context) error {
	t := time.NewTicker(m.cfg.CleanupInterval)
	defer t.Stop()
	for {
		n, err := m.DeleteExpired(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			m.cfg.Logger.ErrorContext(ctx, "oncely idempotency cleanup failed", "err", err)
		case n > 0:
			m.cfg.Logger.InfoContext(ctx, "oncely idempotency cleanup", "deleted", n)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
