// Package ratelog rate-limits repeated log records: while a database or a
// broker is down, a worker's retry loops would otherwise write the same
// warning many times a second. A Limiter lets the first record of a kind
// through, then at most one per interval, and the record it lets through
// says how many of its kind it held back since the previous one.
package ratelog

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// DefaultInterval is the interval of a Limiter made with New(log, 0).
const DefaultInterval = 10 * time.Second

// SuppressedKey is the attribute of a record let through after others of
// its kind were held back: how many were.
const SuppressedKey = "suppressed"

// Limiter writes at most one record per kind per interval to a logger. It
// is safe for concurrent use.
type Limiter struct {
	log      *slog.Logger
	interval time.Duration
	now      func() time.Time

	mu    sync.Mutex
	kinds map[string]*kind
}

type kind struct {
	last       time.Time
	suppressed int
}

// New returns a Limiter writing to log, one record per kind per interval
// (DefaultInterval when interval is 0).
func New(log *slog.Logger, interval time.Duration) *Limiter {
	if interval <= 0 {
		interval = DefaultInterval
	}
	return &Limiter{log: log, interval: interval, now: time.Now, kinds: map[string]*kind{}}
}

// Warn logs msg at WARN level unless a record of the same kind went out
// less than an interval ago; the kind is msg itself.
func (l *Limiter) Warn(ctx context.Context, msg string, args ...any) {
	l.Log(ctx, slog.LevelWarn, msg, msg, args...)
}

// Log logs msg at level unless a record of kind went out less than an
// interval ago, in which case it only counts it. A record let through after
// held-back ones carries their count as SuppressedKey.
func (l *Limiter) Log(ctx context.Context, level slog.Level, kind, msg string, args ...any) {
	if !l.log.Enabled(ctx, level) {
		return
	}
	n, ok := l.allow(kind)
	if !ok {
		return
	}
	if n > 0 {
		args = append(args, SuppressedKey, n)
	}
	l.log.Log(ctx, level, msg, args...)
}

// allow reports whether a record of name may go out now, and how many were
// held back since the last one that did.
func (l *Limiter) allow(name string) (suppressed int, ok bool) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	k := l.kinds[name]
	if k == nil {
		l.kinds[name] = &kind{last: now}
		return 0, true
	}
	if now.Sub(k.last) < l.interval {
		k.suppressed++
		return 0, false
	}
	suppressed, k.suppressed, k.last = k.suppressed, 0, now
	return suppressed, true
}
