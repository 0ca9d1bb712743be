package migrations

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/internal/sqlident"
)

// FS holds the SQL files, under sql/. It is exported for tools that apply the
// files themselves (goose, atlas, a psql loop).
//
//go:embed sql/*.sql
var FS embed.FS

// versionTable records applied versions inside the configured schema.
const versionTable = "oncely_migrations"

// Migration is one versioned step of oncely's schema.
type Migration struct {
	Version int
	Name    string
	Up      string // SQL text of NNNN_name.up.sql
	Down    string // SQL text of NNNN_name.down.sql
}

// MigrationStatus tells whether a migration has been applied to a schema.
type MigrationStatus struct {
	Migration
	Applied   bool
	AppliedAt time.Time // database time; zero when not applied
}

// Beginner starts transactions; *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Config configures a Migrator.
type Config struct {
	// Schema is the schema oncely's tables live in. Default "oncely".
	Schema string
	// Logger receives one line per applied or reverted migration.
	// Default: discard.
	Logger *slog.Logger
}

// Migrator applies and reverts oncely's migrations in one schema.
type Migrator struct {
	db         Beginner
	schema     string
	logger     *slog.Logger
	migrations []Migration
	q          queries
}

type queries struct {
	createSchema, createVersions, selectApplied, insertVersion, deleteVersion, searchPath string
	versions, versionsExist                                                               string
}

// New returns a Migrator for db. It fails if the schema name is not valid.
func New(db Beginner, cfg Config) (*Migrator, error) {
	if db == nil {
		return nil, errors.New("migrations: db is nil")
	}
	schema := cmp.Or(cfg.Schema, sqlident.DefaultSchema)
	if err := sqlident.ValidateSchema("migrations: Config.Schema", schema); err != nil {
		return nil, err
	}
	all, err := All()
	if err != nil {
		return nil, err
	}
	versions := sqlident.Table(schema, versionTable)
	return &Migrator{
		db:         db,
		schema:     schema,
		logger:     cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler)),
		migrations: all,
		q: queries{
			createSchema: "CREATE SCHEMA IF NOT EXISTS " + sqlident.Quote(schema),
			createVersions: "CREATE TABLE IF NOT EXISTS " + versions + ` (
				version    integer     PRIMARY KEY,
				name       text        NOT NULL,
				applied_at timestamptz NOT NULL DEFAULT now())`,
			selectApplied: "SELECT version, applied_at FROM " + versions,
			insertVersion: "INSERT INTO " + versions + " (version, name) VALUES ($1, $2)",
			deleteVersion: "DELETE FROM " + versions + " WHERE version = $1",
			searchPath:    "SET LOCAL search_path TO " + sqlident.Quote(schema),
			versions:      versions,
			versionsExist: "SELECT to_regclass($1) IS NOT NULL",
		},
	}, nil
}

// Schema returns the schema this migrator manages.
func (m *Migrator) Schema() string { return m.schema }

// Up applies every pending migration in version order, in one transaction
// under the schema's advisory lock, and returns the ones it applied. When
// nothing is pending it returns an empty slice and changes nothing.
func (m *Migrator) Up(ctx context.Context) ([]Migration, error) {
	var done []Migration
	err := m.locked(ctx, func(tx pgx.Tx, applied map[int]time.Time) error {
		for _, mig := range m.migrations {
			if _, ok := applied[mig.Version]; ok {
				continue
			}
			if err := m.apply(ctx, tx, mig.Up); err != nil {
				return fmt.Errorf("migrations: up %04d_%s: %w", mig.Version, mig.Name, err)
			}
			if _, err := tx.Exec(ctx, m.q.insertVersion, mig.Version, mig.Name); err != nil {
				return fmt.Errorf("migrations: record %04d: %w", mig.Version, err)
			}
			done = append(done, mig)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, mig := range done {
		m.logger.Info("oncely migration applied", "schema", m.schema, "version", mig.Version, "name", mig.Name)
	}
	return done, nil
}

// Down reverts, newest first, every applied migration whose version is above
// target. Down(ctx, 0) reverts everything. It returns the reverted migrations.
func (m *Migrator) Down(ctx context.Context, target int) ([]Migration, error) {
	if target < 0 {
		return nil, fmt.Errorf("migrations: down: target version %d is negative", target)
	}
	var done []Migration
	err := m.locked(ctx, func(tx pgx.Tx, applied map[int]time.Time) error {
		for _, mig := range slices.Backward(m.migrations) {
			if _, ok := applied[mig.Version]; !ok || mig.Version <= target {
				continue
			}
			if err := m.apply(ctx, tx, mig.Down); err != nil {
				return fmt.Errorf("migrations: down %04d_%s: %w", mig.Version, mig.Name, err)
			}
			if _, err := tx.Exec(ctx, m.q.deleteVersion, mig.Version); err != nil {
				return fmt.Errorf("migrations: unrecord %04d: %w", mig.Version, err)
			}
			done = append(done, mig)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, mig := range done {
		m.logger.Info("oncely migration reverted", "schema", m.schema, "version", mig.Version, "name", mig.Name)
	}
	return done, nil
}

// Status lists every known migration and whether it is applied.
func (m *Migrator) Status(ctx context.Context) ([]MigrationStatus, error) {
	var out []MigrationStatus
	err := m.locked(ctx, func(_ pgx.Tx, applied map[int]time.Time) error {
		for _, mig := range m.migrations {
			at, ok := applied[mig.Version]
			out = append(out, MigrationStatus{Migration: mig, Applied: ok, AppliedAt: at})
		}
		return nil
	})
	return out, err
}

// Pending returns the migrations not applied to the schema yet, in version
// order: all of them when the schema or its version table does not exist.
// Unlike Status it only reads: it takes no lock and creates nothing, so it
// suits a start-up check by a role that may not change the schema.
func (m *Migrator) Pending(ctx context.Context) ([]Migration, error) {
	tx, err := m.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: begin: %w", err)
	}
	defer rollback(ctx, tx)
	var exists bool
	if err := tx.QueryRow(ctx, m.q.versionsExist, m.q.versions).Scan(&exists); err != nil {
		return nil, fmt.Errorf("migrations: read versions: %w", err)
	}
	applied := map[int]bool{}
	if exists {
		rows, err := tx.Query(ctx, m.q.selectApplied)
		if err != nil {
			return nil, fmt.Errorf("migrations: read versions: %w", err)
		}
		var v int
		var at time.Time
		if _, err := pgx.ForEachRow(rows, []any{&v, &at}, func() error { applied[v] = true; return nil }); err != nil {
			return nil, fmt.Errorf("migrations: read versions: %w", err)
		}
	}
	var out []Migration
	for _, mig := range m.migrations {
		if !applied[mig.Version] {
			out = append(out, mig)
		}
	}
	return out, nil
}

// locked runs fn in a transaction holding the schema's migration lock, with
// the schema and the version table created and the applied versions read.
func (m *Migrator) locked(ctx context.Context, fn func(tx pgx.Tx, applied map[int]time.Time) error) error {
	tx, err := m.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("migrations: begin: %w", err)
	}
	defer rollback(ctx, tx)

	// The lock comes first: CREATE SCHEMA IF NOT EXISTS itself races when two
	// sessions run it at once.
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", "oncely.migrations."+m.schema); err != nil {
		return fmt.Errorf("migrations: lock: %w", err)
	}
	for _, stmt := range []string{m.q.createSchema, m.q.createVersions} {
		if _, err := tx.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("migrations: prepare schema %q: %w", m.schema, err)
		}
	}
	rows, err := tx.Query(ctx, m.q.selectApplied)
	if err != nil {
		return fmt.Errorf("migrations: read versions: %w", err)
	}
	applied := make(map[int]time.Time)
	var (
		v  int
		at time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&v, &at}, func() error { applied[v] = at; return nil }); err != nil {
		return fmt.Errorf("migrations: read versions: %w", err)
	}
	if err := fn(tx, applied); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("migrations: commit: %w", err)
	}
	return nil
}

func (m *Migrator) apply(ctx context.Context, tx pgx.Tx, sql string) error {
	if _, err := tx.Exec(ctx, m.q.searchPath); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, sql)
	return err
}

func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = tx.Rollback(ctx) // after a commit this is a no-op returning ErrTxClosed
}

var fileRE = regexp.MustCompile(`^(\d{4})_([a-z0-9_]+)\.(up|down)\.sql$`)

// All returns the embedded migrations in version order. Every version must
// have both an up and a down file.
func All() ([]Migration, error) {
	entries, err := fs.ReadDir(FS, "sql")
	if err != nil {
		return nil, fmt.Errorf("migrations: read embedded files: %w", err)
	}
	byVersion := map[int]*Migration{}
	for _, e := range entries {
		mm := fileRE.FindStringSubmatch(e.Name())
		if mm == nil {
			return nil, fmt.Errorf("migrations: unexpected file %q", e.Name())
		}
		v, _ := strconv.Atoi(mm[1])
		body, err := fs.ReadFile(FS, "sql/"+e.Name())
		if err != nil {
			return nil, err
		}
		mig := byVersion[v]
		if mig == nil {
			mig = &Migration{Version: v, Name: mm[2]}
			byVersion[v] = mig
		} else if mig.Name != mm[2] {
			return nil, fmt.Errorf("migrations: version %04d has two names: %q and %q", v, mig.Name, mm[2])
		}
		if mm[3] == "up" {
			mig.Up = string(body)
		} else {
			mig.Down = string(body)
		}
	}
	out := make([]Migration, 0, len(byVersion))
	for _, mig := range byVersion {
		if mig.Up == "" || mig.Down == "" {
			return nil, fmt.Errorf("migrations: version %04d_%s needs both .up.sql and .down.sql", mig.Version, mig.Name)
		}
		out = append(out, *mig)
	}
	slices.SortFunc(out, func(a, b Migration) int { return a.Version - b.Version })
	return out, nil
}
