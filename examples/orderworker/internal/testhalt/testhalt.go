// Package testhalt holds the orderworker's TEST-ONLY crash points of
// POST /orders. The variable Env arms one: POST /orders then stops there,
// logs a line that starts with "ONCELY_TEST", and hangs until the client's
// connection closes, when it aborts without committing or answering. The
// tests kill the worker (SIGKILL) while it hangs. Never set it in production.
package testhalt

import (
	"fmt"
	"log/slog"
	"net/http"

	"github.com/oncely/oncely/idempotency"
)

// Env names the variable that arms a crash point.
const Env = "ONCELY_TEST_ORDERS_HALT"

// The crash points.
const (
	// BeforeCommit: after the handler enqueued the order in the request's
	// transaction, before the middleware records the response and commits.
	BeforeCommit = "before-commit"
	// AfterCommit: after the commit, before the response's first byte is
	// written.
	AfterCommit = "after-commit"
)

// Parse reads the crash point from Env; "" when unset.
func Parse(getenv func(string) string) (string, error) {
	switch s := getenv(Env); s {
	case "", BeforeCommit, AfterCommit:
		return s, nil
	default:
		return "", fmt.Errorf("%q: want %s or %s (test only)", s, BeforeCommit, AfterCommit)
	}
}

// Wrap returns require(h), POST /orders behind the idempotency middleware,
// with the crash point armed when point is not "". The middleware writes
// the response only after its commit, so hanging in the first WriteHeader
// of a fresh 202 inside it is before the commit, and outside it after.
// Replays and refusals pass.
func Wrap(point string, require func(http.Handler) http.Handler, h http.Handler, log *slog.Logger) http.Handler {
	switch point {
	case "":
		return require(h)
	case BeforeCommit:
		h = halting(h, log, point)
	}
	log.Warn("ONCELY_TEST: "+Env+" is set: POST /orders hangs at the crash point; for tests only", "point", point)
	out := require(h)
	if point == AfterCommit {
		out = halting(out, log, point)
	}
	return out
}

func halting(next http.Handler, log *slog.Logger, point string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		next.ServeHTTP(&haltWriter{ResponseWriter: w, r: r, log: log, point: point}, r)
	})
}

type haltWriter struct {
	http.ResponseWriter
	r     *http.Request
	log   *slog.Logger
	point string
}

// WriteHeader of a fresh 202 logs the line the tests wait for, hangs until
// the client's connection is gone, and then aborts the request: no
// response, and, before the commit, no commit.
func (hw *haltWriter) WriteHeader(status int) {
	if status == http.StatusAccepted && hw.Header().Get(idempotency.ReplayedHeader) == "" {
		hw.log.Warn("ONCELY_TEST: POST /orders halted", "point", hw.point, "key", hw.r.Header.Get(idempotency.DefaultHeader))
		<-hw.r.Context().Done()
		panic(http.ErrAbortHandler)
	}
	hw.ResponseWriter.WriteHeader(status)
}
