package consumer

import (
	"context"
	"fmt"
	"io"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestConnectionFailed(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"deferred constraint", &pgconn.PgError{Severity: "ERROR", Code: "23505"}, false},
		{"serialization failure, wrapped", fmt.Errorf("commit: %w", &pgconn.PgError{Severity: "ERROR", Code: "40001"}), false},
		{"server shutting down", &pgconn.PgError{Severity: "FATAL", Code: "57P01"}, true},
		{"connection lost", io.ErrUnexpectedEOF, true},
		{"context cancelled", fmt.Errorf("commit: %w", context.Canceled), true},
	} {
		if got := connectionFailed(tc.err); got != tc.want {
			t.Errorf("%s: connectionFailed(%v) = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}
