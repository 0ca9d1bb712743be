// Package pgtest gives the library packages' own tests their Postgres and
// the helpers every test shares. It needs nothing but a server: DATABASE_URL
// when set, otherwise the local one (DefaultDatabaseURL). Every test gets its
// own schema, so tests run in parallel.
//
// Tests that need Kafka (kfake) or a Postgres container use
// internal/testenv instead, a module of its own: the module users import
// carries neither testcontainers nor kfake.
package pgtest

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/migrations"
)

// DefaultDatabaseURL is the server the tests use when DATABASE_URL is unset:
// the local one this project's machines and CI run (trust auth, database
// "test").
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// Main runs the package's tests, then checks that every goroutine they
// started has stopped. Use it from TestMain: os.Exit(pgtest.Main(m)).
func Main(m *testing.M) int {
	return CheckLeaks(m.Run())
}

// CheckLeaks turns a passing exit code into a failing one when goroutines
// are still running (unless ONCELY_GOLEAK=0). Every goroutine has an owner
// and a stop path; a Kafka client that a stopped consumer closes in the
// background (a leave or commit still in flight) is given its bounded time
// to finish, and anything alive after that leaked.
func CheckLeaks(code int) int {
	if code != 0 || os.Getenv("ONCELY_GOLEAK") == "0" {
		return code
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		err := goleak.Find()
		if err == nil {
			return code
		}
		if time.Now().After(deadline) {
			fmt.Fprintf(os.Stderr, "leaked goroutines: %v\n", err)
			return 1
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// DatabaseURL returns DATABASE_URL, or DefaultDatabaseURL when it is unset.
func DatabaseURL(testing.TB) string {
	return cmp.Or(os.Getenv("DATABASE_URL"), DefaultDatabaseURL)
}

// DB is a test's own schema in a Postgres.
type DB struct {
	URL    string // connection string of the server
	Schema string // the test's schema; the pool's search_path points at it
	Pool   *pgxpool.Pool
}

// Postgres creates a schema for the test in the tests' Postgres (see
// DatabaseURL), returns a pool whose search_path is that schema, and drops
// the schema when the test ends.
func Postgres(t testing.TB) *DB {
	t.Helper()
	return PostgresAt(t, DatabaseURL(t))
}

// PostgresAt is Postgres on the server at url.
func PostgresAt(t testing.TB, url string) *DB {
	t.Helper()
	schema := UniqueName("t")
	ctx := context.Background()
	admin, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatalf("pgtest: connect %s: %v", url, err)
	}
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+sqlident.Quote(schema)); err != nil {
		admin.Close()
		t.Fatalf("pgtest: create schema on %s: %v (set DATABASE_URL to a server the tests may use, "+
			"e.g. %s, or run `make test`, which sets it)", url, err, DefaultDatabaseURL)
	}
	pool, err := NewPool(ctx, url, schema, 8)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		pool.Close()
		defer admin.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP SCHEMA "+sqlident.Quote(schema)+" CASCADE"); err != nil {
			t.Logf("pgtest: drop schema %s: %v", schema, err)
		}
	})
	return &DB{URL: url, Schema: schema, Pool: pool}
}

// Migrate applies every migration to the test's schema and returns db.
func Migrate(tb testing.TB, db *DB) *DB {
	tb.Helper()
	m, err := migrations.New(db.Pool, migrations.Config{Schema: db.Schema})
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	if _, err := m.Up(context.Background()); err != nil {
		tb.Fatalf("pgtest: migrate %s: %v", db.Schema, err)
	}
	return db
}

// NewPool opens a pool whose connections use schema as their search_path.
// Unless url sets connect_timeout, connecting gives up after 10 s, so that
// a server that is away fails attempts instead of hanging them.
func NewPool(ctx context.Context, url, schema string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse database url: %w", err)
	}
	cfg.ConnConfig.ConnectTimeout = cmp.Or(cfg.ConnConfig.ConnectTimeout, 10*time.Second)
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = maxConns
	return pgxpool.NewWithConfig(ctx, cfg)
}

// UniqueName returns prefix followed by 12 random hex digits, usable as a
// schema, topic or group name.
func UniqueName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "_" + hex.EncodeToString(b[:])
}

// WaitFor polls cond every few milliseconds until it holds, failing the test
// when ctx ends first. Tests wait on conditions this way, never on sleeps.
func WaitFor(t testing.TB, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s", what)
		case <-tick.C:
		}
	}
}

// Eventually is WaitFor with a timeout instead of a context.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	WaitFor(t, ctx, what, cond)
}

// UnreachablePool returns a pool for tests that only construct things: it
// connects lazily, to a port where nothing listens, so it never reaches a
// server.
func UnreachablePool(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// SchemaNameValid is the tests' own reading of the documented rule for
// schema names, independent of package sqlident: lower-case ASCII letters,
// digits and underscores, not starting with a digit, at most 63 bytes, and
// not a system schema. Configuration fuzzers compare constructors with it.
func SchemaNameValid(s string) bool {
	for i, c := range []byte(s) {
		if !(c >= 'a' && c <= 'z' || c == '_' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return s != "" && len(s) <= 63 && !strings.HasPrefix(s, "pg_") && s != "information_schema"
}

// CheckConfigError checks a constructor's answer to a config against the
// test's own list of the config's invalid fields: it must succeed exactly
// when no field is invalid, and a refusal must name (as field extracts it
// from the message) one of the invalid fields.
func CheckConfigError(tb testing.TB, err error, invalid map[string]bool, field func(msg string) (string, bool)) {
	tb.Helper()
	var bad []string
	for name, b := range invalid {
		if b {
			bad = append(bad, name)
		}
	}
	if err == nil {
		if len(bad) > 0 {
			tb.Fatalf("a config with invalid fields %v was accepted", bad)
		}
		return
	}
	name, ok := field(err.Error())
	switch {
	case !ok:
		tb.Fatalf("the error %q names no field", err)
	case !invalid[name]:
		tb.Fatalf("the error %q names %s, which is valid (invalid: %v)", err, name, bad)
	}
}

// FieldMatch returns a field extractor for CheckConfigError: the last
// group of re's match in the message.
func FieldMatch(re *regexp.Regexp) func(msg string) (string, bool) {
	return func(msg string) (string, bool) {
		m := re.FindStringSubmatch(msg)
		if len(m) < 2 {
			return "", false
		}
		return m[len(m)-1], true
	}
}

// Signed returns v, or a negative value when bit i of mask is set.
// Configuration fuzzers derive several fields from one input and use it to
// make each of them negative on its own.
func Signed[T ~int | ~int64](mask uint32, i int, v T) T {
	if mask>>i&1 == 0 {
		return v
	}
	if v < 0 {
		return v
	}
	return -v - 1
}
