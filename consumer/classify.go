package consumer

import (
	"context"
	"errors"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A failed attempt is classified by what caused it:
//
//   - The database, unreachable: a refused, reset or dropped connection
//     outside the handler's own doing, an administrator's shutdown, too many
//     connections, another resource the server ran out of. It is nobody's
//     record: the attempt runs again, without limit and without spending an
//     attempt, while the partition fetches nothing more (infra).
//   - Contention with another transaction (isContention): runs again soon,
//     without spending an attempt.
//   - Everything else is the record's or its handler's doing, and spends an
//     attempt: an error the handler returned, a data or constraint error
//     (SQLSTATE classes 22 and 23, on a statement or a deferred constraint at
//     COMMIT), a statement the handler let fail before it returned nil (the
//     transaction was aborted, 25P02, and COMMIT rolled back), and a handler
//     that ran out of its own time (a statement cancelled by the handler's
//     own deadline, which makes pgx close the connection).

// infraCodes are the SQLSTATEs and classes that say the server, not the
// statement, failed.
func infraCode(code string) bool {
	switch {
	case strings.HasPrefix(code, "08"), // connection exception
		strings.HasPrefix(code, "53"),                     // insufficient resources: too many connections, disk full, out of memory
		code == "57P01", code == "57P02", code == "57P03", // admin shutdown, crash shutdown, cannot connect now
		code == "58000", code == "58030": // system error, I/O error
		return true
	}
	return false
}

// databaseFailed reports whether err, from a statement oncely itself ran
// (BEGIN, the claim, a savepoint, COMMIT), means the database is
// unreachable rather than that the transaction was refused.
func databaseFailed(err error) bool {
	if isContention(err) || errors.Is(err, pgx.ErrTxCommitRollback) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return infraCode(pgErr.Code) || pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC"
	}
	return true // no answer from the server: a network or connection error
}

// handlerDatabaseFailed reports whether err, returned by a handler that ran
// in ctx on tx, means the database became unreachable while it ran. A
// deadline or cancellation of the handler's own (ctx still live) is the
// handler's failure even though pgx closed the connection over it.
func handlerDatabaseFailed(ctx context.Context, err error, tx pgx.Tx) bool {
	if isContention(err) {
		return false
	}
	if ctx.Err() == nil && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && infraCode(pgErr.Code) {
		return true
	}
	return tx.Conn().IsClosed()
}
