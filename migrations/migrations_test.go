package migrations_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/migrations"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// testCtx returns a context that ends before the test's deadline, so a hung
// database call fails the test instead of the whole binary.
func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func newMigrator(t *testing.T, db migrations.Beginner, schema string) *migrations.Migrator {
	t.Helper()
	m, err := migrations.New(db, migrations.Config{Schema: schema})
	if err != nil {
		t.Fatalf("New(%q): %v", schema, err)
	}
	return m
}

func allMigrations(t *testing.T) []migrations.Migration {
	t.Helper()
	all, err := migrations.All()
	if err != nil {
		t.Fatalf("All: %v", err)
	}
	if len(all) == 0 {
		t.Fatal("All: no embedded migrations")
	}
	return all
}

func versions(ms []migrations.Migration) []int {
	out := make([]int, 0, len(ms))
	for _, m := range ms {
		out = append(out, m.Version)
	}
	return out
}

// tableExists reports whether schema.table exists, looked up in the catalog
// (not through search_path).
func tableExists(t *testing.T, ctx context.Context, pool *pgxpool.Pool, schema, table string) bool {
	t.Helper()
	var ok bool
	err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM information_schema.tables
		WHERE table_schema = $1 AND table_name = $2)`, schema, table).Scan(&ok)
	if err != nil {
		t.Fatalf("look up %s.%s: %v", schema, table, err)
	}
	return ok
}

type versionRow struct {
	Version   int
	Name      string
	AppliedAt time.Time
}

func versionRows(t *testing.T, ctx context.Context, pool *pgxpool.Pool, schema string) []versionRow {
	t.Helper()
	rows, err := pool.Query(ctx, "SELECT version, name, applied_at FROM "+
		sqlident.Table(schema, "oncely_migrations")+" ORDER BY version")
	if err != nil {
		t.Fatalf("read version table: %v", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[versionRow])
	if err != nil {
		t.Fatalf("read version table: %v", err)
	}
	return out
}

func countRows(t *testing.T, ctx context.Context, pool *pgxpool.Pool, schema, table string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+sqlident.Table(schema, table)).Scan(&n); err != nil {
		t.Fatalf("count %s.%s: %v", schema, table, err)
	}
	return n
}

// checkInboxShape asserts the inbox table's columns and primary key.
func checkInboxShape(t *testing.T, ctx context.Context, pool *pgxpool.Pool, schema string) {
	t.Helper()
	type column struct{ Name, Type, Nullable string }
	rows, err := pool.Query(ctx, `SELECT column_name::text, data_type::text, is_nullable::text
		FROM information_schema.columns
		WHERE table_schema = $1 AND table_name = 'inbox'
		ORDER BY ordinal_position`, schema)
	if err != nil {
		t.Fatalf("read inbox columns: %v", err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[column])
	if err != nil {
		t.Fatalf("read inbox columns: %v", err)
	}
	want := []column{
		{"consumer_group", "text", "NO"},
		{"message_id", "text", "NO"},
		{"topic", "text", "NO"},
		{"partition", "integer", "NO"},
		{"offset", "bigint", "NO"},
		{"outcome", "text", "NO"},
		{"processed_at", "timestamp with time zone", "NO"},
	}
	if !slices.Equal(got, want) {
		t.Errorf("%s.inbox columns:\n got %v\nwant %v", schema, got, want)
	}

	rows, err = pool.Query(ctx, `SELECT k.column_name::text
		FROM information_schema.table_constraints c
		JOIN information_schema.key_column_usage k
		  ON k.constraint_schema = c.constraint_schema AND k.constraint_name = c.constraint_name
		WHERE c.table_schema = $1 AND c.table_name = 'inbox' AND c.constraint_type = 'PRIMARY KEY'
		ORDER BY k.ordinal_position`, schema)
	if err != nil {
		t.Fatalf("read inbox primary key: %v", err)
	}
	pk, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("read inbox primary key: %v", err)
	}
	if want := []string{"consumer_group", "message_id"}; !slices.Equal(pk, want) {
		t.Errorf("%s.inbox primary key = %v, want %v", schema, pk, want)
	}
}

// freshSchema returns a schema name that does not exist yet and drops it (if
// a test created it) when the test ends.
func freshSchema(t *testing.T, db *pgtest.DB) string {
	t.Helper()
	schema := db.Schema + "_m"
	// Registered after pgtest.Postgres, so it runs before the pool is closed.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := db.Pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+sqlident.Quote(schema)+" CASCADE"); err != nil {
			t.Logf("drop schema %s: %v", schema, err)
		}
	})
	return schema
}

func TestAllEmbedded(t *testing.T) {
	t.Parallel()
	all := allMigrations(t)
	files, err := fs.Glob(migrations.FS, "sql/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 2*len(all) {
		t.Errorf("%d embedded files for %d migrations, want an up and a down file each", len(files), len(all))
	}
	for i, m := range all {
		if m.Version != i+1 {
			t.Errorf("migration %d has version %d, want contiguous versions from 1", i, m.Version)
		}
		if strings.TrimSpace(m.Up) == "" || strings.TrimSpace(m.Down) == "" {
			t.Errorf("migration %04d_%s: empty up or down SQL", m.Version, m.Name)
		}
		for _, dir := range []string{"up", "down"} {
			name := path.Join("sql", fmt.Sprintf("%04d_%s.%s.sql", m.Version, m.Name, dir))
			body, err := fs.ReadFile(migrations.FS, name)
			if err != nil {
				t.Errorf("migration %d: %v", m.Version, err)
				continue
			}
			want := m.Up
			if dir == "down" {
				want = m.Down
			}
			if string(body) != want {
				t.Errorf("%s differs from Migration.%s", name, dir)
			}
		}
	}
}

func TestUpAppliesAllAndRecordsVersions(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := testCtx(t)
	all := allMigrations(t)
	m := newMigrator(t, db.Pool, db.Schema)
	if m.Schema() != db.Schema {
		t.Errorf("Schema() = %q, want %q", m.Schema(), db.Schema)
	}
	if tableExists(t, ctx, db.Pool, db.Schema, "inbox") {
		t.Fatal("inbox exists before Up")
	}

	applied, err := m.Up(ctx)
	if err != nil {
		t.Fatalf("Up: %v", err)
	}
	if got, want := versions(applied), versions(all); !slices.Equal(got, want) {
		t.Errorf("Up applied %v, want %v", got, want)
	}

	rows := versionRows(t, ctx, db.Pool, db.Schema)
	if len(rows) != len(all) {
		t.Fatalf("version table has %d rows, want %d: %v", len(rows), len(all), rows)
	}
	var dbNow time.Time
	if err := db.Pool.QueryRow(ctx, "SELECT now()").Scan(&dbNow); err != nil {
		t.Fatal(err)
	}
	for i, r := range rows {
		if r.Version != all[i].Version || r.Name != all[i].Name {
			t.Errorf("version row %d = %d %q, want %d %q", i, r.Version, r.Name, all[i].Version, all[i].Name)
		}
		if d := dbNow.Sub(r.AppliedAt); d < 0 || d > time.Minute {
			t.Errorf("version %d applied_at %s is not just before database now %s", r.Version, r.AppliedAt, dbNow)
		}
	}
	checkInboxShape(t, ctx, db.Pool, db.Schema)
}

func TestUpTwiceIsNoop(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := testCtx(t)
	m := newMigrator(t, db.Pool, db.Schema)
	if _, err := m.Up(ctx); err != nil {
		t.Fatalf("first Up: %v", err)
	}
	// Data in the inbox must survive a second Up (nothing is re-created).
	if _, err := db.Pool.Exec(ctx, "INSERT INTO "+sqlident.Table(db.Schema, "inbox")+
		" (consumer_group, message_id) VALUES ('g', 'm1'), ('g', 'm2')"); err != nil {
		t.Fatalf("insert into inbox: %v", err)
	}
	before := versionRows(t, ctx, db.Pool, db.Schema)

	for i := range 2 {
		again, err := newMigrator(t, db.Pool, db.Schema).Up(ctx)
		if err != nil {
			t.Fatalf("Up #%d: %v", i+2, err)
		}
		if len(again) != 0 {
			t.Errorf("Up #%d applied %v, want nothing", i+2, versions(again))
		}
	}

	if after := versionRows(t, ctx, db.Pool, db.Schema); !slices.Equal(after, before) {
		t.Errorf("version table changed by a no-op Up:\nbefore %v\n after %v", before, after)
	}
	if n := countRows(t, ctx, db.Pool, db.Schema, "inbox"); n != 2 {
		t.Errorf("inbox has %d rows after a second Up, want the 2 inserted before", n)
	}
}

func TestStatusBeforeAndAfterUp(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := testCtx(t)
	all := allMigrations(t)
	m := newMigrator(t, db.Pool, db.Schema)

	st, err := m.Status(ctx)
	if err != nil {
		t.Fatalf("Status before Up: %v", err)
	}
	if len(st) != len(all) {
		t.Fatalf("Status lists %d migrations, want %d", len(st), len(all))
	}
	for i, s := range st {
		if s.Version != all[i].Version || s.Name != all[i].Name {
			t.Errorf("status %d is %04d_%s, want %04d_%s", i, s.Version, s.Name, all[i].Version, all[i].Name)
		}
		if s.Applied || !s.AppliedAt.IsZero() {
			t.Errorf("before Up: %04d applied=%v at %s, want not applied and zero time", s.Version, s.Applied, s.AppliedAt)
		}
	}

	var start time.Time
	if err := db.Pool.QueryRow(ctx, "SELECT now()").Scan(&start); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil {
		t.Fatalf("Up: %v", err)
	}
	var end time.Time
	if err := db.Pool.QueryRow(ctx, "SELECT now()").Scan(&end); err != nil {
		t.Fatal(err)
	}

	st, err = m.Status(ctx)
	if err != nil {
		t.Fatalf("Status after Up: %v", err)
	}
	if len(st) != len(all) {
		t.Fatalf("Status lists %d migrations, want %d", len(st), len(all))
	}
	for _, s := range st {
		if !s.Applied {
			t.Errorf("after Up: %04d not applied", s.Version)
		}
		// applied_at is database time, taken inside Up's transaction.
		if s.AppliedAt.Before(start) || s.AppliedAt.After(end) {
			t.Errorf("after Up: %04d applied at %s, want within database times [%s, %s]", s.Version, s.AppliedAt, start, end)
		}
	}
}

func TestDownRevertsAndUpAgain(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := testCtx(t)
	all := allMigrations(t)
	m := newMigrator(t, db.Pool, db.Schema)
	if _, err := m.Up(ctx); err != nil {
		t.Fatalf("Up: %v", err)
	}

	// Down to the newest version reverts nothing.
	latest := all[len(all)-1].Version
	none, err := m.Down(ctx, latest)
	if err != nil {
		t.Fatalf("Down(%d): %v", latest, err)
	}
	if len(none) != 0 {
		t.Errorf("Down(%d) reverted %v, want nothing", latest, versions(none))
	}
	if !tableExists(t, ctx, db.Pool, db.Schema, "inbox") {
		t.Fatalf("inbox gone after Down(%d)", latest)
	}

	reverted, err := m.Down(ctx, 0)
	if err != nil {
		t.Fatalf("Down(0): %v", err)
	}
	want := versions(all)
	slices.Reverse(want) // newest first
	if got := versions(reverted); !slices.Equal(got, want) {
		t.Errorf("Down(0) reverted %v, want %v", got, want)
	}
	if tableExists(t, ctx, db.Pool, db.Schema, "inbox") {
		t.Error("inbox still exists after Down(0)")
	}
	if rows := versionRows(t, ctx, db.Pool, db.Schema); len(rows) != 0 {
		t.Errorf("version table after Down(0) = %v, want empty", rows)
	}
	st, err := m.Status(ctx)
	if err != nil {
		t.Fatalf("Status: %v", err)
	}
	for _, s := range st {
		if s.Applied {
			t.Errorf("after Down(0): %04d still reported applied", s.Version)
		}
	}

	// A second Down(0) has nothing left to revert.
	if again, err := m.Down(ctx, 0); err != nil || len(again) != 0 {
		t.Errorf("second Down(0) = %v, %v; want nothing, nil", versions(again), err)
	}

	applied, err := m.Up(ctx)
	if err != nil {
		t.Fatalf("Up after Down: %v", err)
	}
	if got := versions(applied); !slices.Equal(got, versions(all)) {
		t.Errorf("Up after Down applied %v, want %v", got, versions(all))
	}
	checkInboxShape(t, ctx, db.Pool, db.Schema)
	if rows := versionRows(t, ctx, db.Pool, db.Schema); len(rows) != len(all) {
		t.Errorf("version table after Up again has %d rows, want %d", len(rows), len(all))
	}
}

func TestDownNegativeTarget(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := testCtx(t)
	m := newMigrator(t, db.Pool, db.Schema)
	if _, err := m.Up(ctx); err != nil {
		t.Fatalf("Up: %v", err)
	}
	if got, err := m.Down(ctx, -1); err == nil {
		t.Fatalf("Down(-1) = %v, nil; want an error", versions(got))
	}
	if !tableExists(t, ctx, db.Pool, db.Schema, "inbox") {
		t.Error("Down(-1) dropped the inbox")
	}
}

// TestConcurrentUp releases 8 migrators at once on a schema that does not
// exist yet: the advisory lock must serialize them so that every call
// succeeds and each migration is applied exactly once.
func TestConcurrentUp(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := testCtx(t)
	all := allMigrations(t)
	schema := freshSchema(t, db)
	const n = 8
	// A pool of its own with room for every caller, so they really run at once.
	pool, err := pgtest.NewPool(ctx, db.URL, db.Schema, n+1)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	migrators := make([]*migrations.Migrator, n)
	for i := range migrators {
		migrators[i] = newMigrator(t, pool, schema)
	}
	start := make(chan struct{})
	results := make([][]migrations.Migration, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, m := range migrators {
		wg.Go(func() {
			<-start
			results[i], errs[i] = m.Up(ctx)
		})
	}
	close(start)
	wg.Wait()

	appliedBy := map[int]int{}
	for i := range n {
		if errs[i] != nil {
			t.Errorf("Up #%d: %v", i, errs[i])
		}
		for _, m := range results[i] {
			appliedBy[m.Version]++
		}
	}
	for _, m := range all {
		if appliedBy[m.Version] != 1 {
			t.Errorf("migration %04d reported applied by %d callers, want exactly 1", m.Version, appliedBy[m.Version])
		}
	}
	if len(appliedBy) != len(all) {
		t.Errorf("applied versions %v, want %v", appliedBy, versions(all))
	}
	if rows := versionRows(t, ctx, db.Pool, schema); len(rows) != len(all) {
		t.Errorf("version table has %d rows, want %d: %v", len(rows), len(all), rows)
	}
	checkInboxShape(t, ctx, db.Pool, schema)
}

// TestUpWaitsForLock holds the migration lock in an open transaction (a
// migrator running on that transaction) and checks that a second migrator
// waits on it, then finds nothing left to do once the first commits.
func TestUpWaitsForLock(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := testCtx(t)
	all := allMigrations(t)

	outer, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer outer.Rollback(context.Background())
	// Up on a pgx.Tx runs in a savepoint; the transaction-level advisory lock
	// stays held until outer ends.
	first, err := newMigrator(t, outer, db.Schema).Up(ctx)
	if err != nil {
		t.Fatalf("Up inside a transaction: %v", err)
	}
	if !slices.Equal(versions(first), versions(all)) {
		t.Fatalf("Up inside a transaction applied %v, want %v", versions(first), versions(all))
	}
	var outerPID uint32
	if err := outer.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&outerPID); err != nil {
		t.Fatal(err)
	}
	var classID, objID uint32
	err = outer.QueryRow(ctx, `SELECT classid, objid FROM pg_locks
		WHERE locktype = 'advisory' AND pid = $1 AND granted`, outerPID).Scan(&classID, &objID)
	if err != nil {
		t.Fatalf("the open transaction holds no advisory lock after Up: %v", err)
	}

	type result struct {
		applied []migrations.Migration
		err     error
	}
	done := make(chan result, 1)
	go func() {
		applied, err := newMigrator(t, db.Pool, db.Schema).Up(ctx)
		done <- result{applied, err}
	}()

	// The second Up must be waiting for the same advisory lock.
	pgtest.WaitFor(t, ctx, "a second Up waiting for the migration lock", func() bool {
		var waiting bool
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks
			WHERE locktype = 'advisory' AND classid = $1 AND objid = $2 AND NOT granted)`,
			classID, objID).Scan(&waiting)
		if err != nil {
			t.Fatalf("read pg_locks: %v", err)
		}
		return waiting
	})
	select {
	case r := <-done:
		t.Fatalf("second Up returned while the lock was held: %v, %v", versions(r.applied), r.err)
	default:
	}

	if err := outer.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("second Up: %v", r.err)
	}
	if len(r.applied) != 0 {
		t.Errorf("second Up applied %v after the first committed, want nothing", versions(r.applied))
	}
	if rows := versionRows(t, ctx, db.Pool, db.Schema); len(rows) != len(all) {
		t.Errorf("version table has %d rows, want %d", len(rows), len(all))
	}
}

func TestNewRejectsInvalidSchema(t *testing.T) {
	t.Parallel()
	var pool *pgxpool.Pool // New must refuse before touching the database
	for _, schema := range []string{
		`x"; drop table y`,
		"Upper",
		"pg_catalog",
		strings.Repeat("s", 64),
		"1st",
		"a-b",
	} {
		m, err := migrations.New(pool, migrations.Config{Schema: schema})
		if err == nil {
			t.Errorf("New(Schema: %q) = %v, nil; want an error", schema, m)
			continue
		}
		if !strings.Contains(err.Error(), "Config.Schema") {
			t.Errorf("New(Schema: %q) error %q does not name Config.Schema", schema, err)
		}
	}
}

func TestNewDefaults(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	m, err := migrations.New(db.Pool, migrations.Config{})
	if err != nil {
		t.Fatalf("New with an empty schema: %v", err)
	}
	if m.Schema() != sqlident.DefaultSchema {
		t.Errorf("default Schema() = %q, want %q", m.Schema(), sqlident.DefaultSchema)
	}
	if _, err := migrations.New(nil, migrations.Config{}); err == nil {
		t.Error("New(nil) succeeded, want an error")
	}
}

func TestUpLogsEachMigration(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := testCtx(t)
	all := allMigrations(t)
	var buf bytes.Buffer
	var mu sync.Mutex
	logger := slog.New(slog.NewTextHandler(lockedWriter{&mu, &buf}, nil))
	m, err := migrations.New(db.Pool, migrations.Config{Schema: db.Schema, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil { // no-op: no new lines
		t.Fatal(err)
	}
	mu.Lock()
	out := buf.String()
	mu.Unlock()
	if got := strings.Count(out, "oncely migration applied"); got != len(all) {
		t.Errorf("logged %d 'applied' lines, want %d:\n%s", got, len(all), out)
	}
	if !strings.Contains(out, "schema="+db.Schema) {
		t.Errorf("log does not name the schema:\n%s", out)
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// TestEmbeddedFilesWithPlainClient applies the .up.sql files the way goose or
// a psql loop would: a plain connection whose search_path is the target
// schema, one file after another, no migrator involved.
func TestEmbeddedFilesWithPlainClient(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := testCtx(t)
	cfg, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["search_path"] = db.Schema // PGOPTIONS='-c search_path=...'
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())

	ups, err := fs.Glob(migrations.FS, "sql/*.up.sql")
	if err != nil || len(ups) == 0 {
		t.Fatalf("glob up files: %v, %v", ups, err)
	}
	slices.Sort(ups) // NNNN_ prefix: lexical order is version order
	for _, name := range ups {
		body, err := fs.ReadFile(migrations.FS, name)
		if err != nil {
			t.Fatal(err)
		}
		// No arguments: pgx uses the simple protocol, which runs a file of
		// several statements like psql -f does.
		if _, err := conn.Exec(ctx, string(body)); err != nil {
			t.Fatalf("apply %s: %v", name, err)
		}
	}
	if !tableExists(t, ctx, db.Pool, db.Schema, "inbox") {
		t.Fatalf("inbox not created in %s by the plain client", db.Schema)
	}
	checkInboxShape(t, ctx, db.Pool, db.Schema)

	// The defaults work for a minimal insert through the unqualified name.
	var outcome string
	var partition int32
	var offset int64
	err = conn.QueryRow(ctx, `INSERT INTO inbox (consumer_group, message_id) VALUES ('g', 'm')
		RETURNING outcome, partition, "offset"`).Scan(&outcome, &partition, &offset)
	if err != nil {
		t.Fatalf("insert: %v", err)
	}
	if outcome != "processed" || partition != -1 || offset != -1 {
		t.Errorf("defaults: outcome=%q partition=%d offset=%d, want processed -1 -1", outcome, partition, offset)
	}
	// The outcome is constrained.
	_, err = conn.Exec(ctx, `INSERT INTO inbox (consumer_group, message_id, outcome) VALUES ('g', 'x', 'bogus')`)
	if err == nil {
		t.Error("inbox accepted outcome 'bogus'")
	}

	downs, err := fs.Glob(migrations.FS, "sql/*.down.sql")
	if err != nil || len(downs) != len(ups) {
		t.Fatalf("glob down files: %v, %v", downs, err)
	}
	slices.Sort(downs)
	for _, name := range slices.Backward(downs) {
		body, err := fs.ReadFile(migrations.FS, name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, string(body)); err != nil {
			t.Fatalf("apply %s: %v", name, err)
		}
	}
	if tableExists(t, ctx, db.Pool, db.Schema, "inbox") {
		t.Error("inbox still exists after the .down.sql files")
	}
}

// TestUpOnCancelledContext checks that a failed Up leaves nothing behind.
func TestUpOnCancelledContext(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	m := newMigrator(t, db.Pool, db.Schema)
	applied, err := m.Up(ctx)
	if err == nil || !errors.Is(err, context.Canceled) {
		t.Fatalf("Up on a cancelled context = %v, %v; want context.Canceled", versions(applied), err)
	}
	if tableExists(t, testCtx(t), db.Pool, db.Schema, "inbox") {
		t.Error("inbox created by an Up that failed")
	}
}

// TestPendingReadsOnly: Pending lists every migration of a schema that does
// not exist without creating it, and the ones above a Down's target after it.
func TestPendingReadsOnly(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := testCtx(t)
	all := allMigrations(t)
	schema := db.Schema + "_pending"
	m := newMigrator(t, db.Pool, schema)

	pending, err := m.Pending(ctx)
	if err != nil {
		t.Fatalf("Pending on a missing schema: %v", err)
	}
	if !slices.Equal(versions(pending), versions(all)) {
		t.Errorf("Pending on a missing schema = %v, want all %v", versions(pending), versions(all))
	}
	var exists bool
	if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Errorf("Pending created schema %q", schema)
	}
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+sqlident.Quote(schema)+" CASCADE")
	})

	if _, err := m.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if pending, err = m.Pending(ctx); err != nil || len(pending) != 0 {
		t.Errorf("Pending after Up = %v, %v; want none", versions(pending), err)
	}
	if _, err := m.Down(ctx, all[1].Version); err != nil {
		t.Fatal(err)
	}
	if pending, err = m.Pending(ctx); err != nil || !slices.Equal(versions(pending), versions(all[2:])) {
		t.Errorf("Pending after Down to %d = %v, %v; want %v", all[1].Version, versions(pending), err, versions(all[2:]))
	}
}
