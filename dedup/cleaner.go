package dedup

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/oncely/oncely/internal/sqlident"
)

// MinRetention is the shortest retention a Cleaner accepts. See the package
// documentation for the rule that sets a real retention.
const MinRetention = time.Hour

// CleanerConfig configures a Cleaner.
type CleanerConfig struct {
	// Schema holds the inbox table. Default "oncely".
	Schema string
	// Retention is how long a row is kept after processed_at. Required, at
	// least MinRetention; it must exceed the source topics' retention plus
	// the largest consumer lag (see the package documentation).
	Retention time.Duration
	// Group limits the cleaner to one consumer group. Default: all groups.
	Group string
	// BatchSize bounds the rows deleted per statement. Default 1000.
	BatchSize int
	// Interval is the pause between passes of Run. Default 1 minute.
	Interval time.Duration
	// Logger receives a line per pass that deleted rows. Default: discard.
	Logger *slog.Logger
}

// Cleaner deletes inbox rows older than the retention.
type Cleaner struct {
	cfg    CleanerConfig
	db     DBTX
	delete string
}

// NewCleaner returns a Cleaner over db (usually a *pgxpool.Pool).
func NewCleaner(db DBTX, cfg CleanerConfig) (*Cleaner, error) {
	if db == nil {
		return nil, fmt.Errorf("dedup: cleaner: db is nil")
	}
	cfg.Schema = cmp.Or(cfg.Schema, sqlident.DefaultSchema)
	if err := sqlident.ValidateSchema("dedup: CleanerConfig.Schema", cfg.Schema); err != nil {
		return nil, err
	}
	if cfg.Retention < MinRetention {
		return nil, fmt.Errorf("dedup: CleanerConfig.Retention: %s is below the minimum %s (it must exceed topic retention plus maximum consumer lag)", cfg.Retention, MinRetention)
	}
	if cfg.BatchSize < 0 || cfg.Interval < 0 {
		return nil, fmt.Errorf("dedup: CleanerConfig.BatchSize and CleanerConfig.Interval must not be negative")
	}
	cfg.BatchSize = cmp.Or(cfg.BatchSize, 1000)
	cfg.Interval = cmp.Or(cfg.Interval, time.Minute)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	t := sqlident.Table(cfg.Schema, "inbox")
	// Database time decides age; SKIP LOCKED keeps two cleaners (or a
	// cleaner and a claim) from waiting on each other.
	return &Cleaner{cfg: cfg, db: db, delete: `DELETE FROM ` + t + ` WHERE (consumer_group, message_id) IN (
		SELECT consumer_group, message_id FROM ` + t + `
		WHERE processed_at < now() - make_interval(secs => $1)
		  AND ($2 = '' OR consumer_group = $2)
		ORDER BY processed_at
		LIMIT $3
		FOR UPDATE SKIP LOCKED)`}, nil
}

// DeleteExpired deletes expired rows in batches of BatchSize until none are
// left, and returns how many it deleted.
func (c *Cleaner) DeleteExpired(ctx context.Context) (int64, error) {
	var total int64
	for {
		tag, err := c.db.Exec(ctx, c.delete, c.cfg.Retention.Seconds(), c.cfg.Group, c.cfg.BatchSize)
		if err != nil {
			return total, fmt.Errorf("dedup: delete expired: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(c.cfg.BatchSize) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// Run deletes expired rows every Interval until ctx is done. Errors are
// logged and the next pass tries again; Run returns nil when ctx ends.
func (c *Cleaner) Run(ctx context.Context) error {
	t := time.NewTicker(c.cfg.Interval)
	defer t.Stop()
	for {
		n, err := c.DeleteExpired(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			c.cfg.Logger.Error("oncely inbox cleanup failed", "err", err)
		case n > 0:
			c.cfg.Logger.Info("oncely inbox cleanup", "deleted", n, "retention", c.cfg.Retention)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
