package consumer

import (
	"context"
	"fmt"
	"io"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// databaseFailed tells the database being away from a statement refused, for
// the statements oncely runs itself (BEGIN, the claim, savepoints, COMMIT).
func TestDatabaseFailed(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"deferred constraint at commit", &pgconn.PgError{Severity: "ERROR", Code: "23505"}, false},
		{"serialization failure, wrapped", fmt.Errorf("commit: %w", &pgconn.PgError{Severity: "ERROR", Code: "40001"}), false},
		{"commit of an aborted transaction", fmt.Errorf("commit: %w", pgx.ErrTxCommitRollback), false},
		{"savepoint in an aborted transaction", &pgconn.PgError{Severity: "ERROR", Code: "25P02"}, false},
		{"invalid byte sequence", &pgconn.PgError{Severity: "ERROR", Code: "22021"}, false},
		{"server shutting down", &pgconn.PgError{Severity: "FATAL", Code: "57P01"}, true},
		{"too many connections", &pgconn.PgError{Severity: "FATAL", Code: "53300"}, true},
		{"cannot connect now", &pgconn.PgError{Severity: "FATAL", Code: "57P03"}, true},
		{"connection lost", io.ErrUnexpectedEOF, true},
		{"context cancelled", fmt.Errorf("commit: %w", context.Canceled), true},
	} {
		if got := databaseFailed(tc.err); got != tc.want {
			t.Errorf("%s: databaseFailed(%v) = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}
