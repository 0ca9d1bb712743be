package outbound

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// BreakerState is the state of an endpoint's circuit breaker.
type BreakerState string

// Breaker states.
const (
	// BreakerClosed: attempts flow, up to MaxInFlightPerEndpoint at once.
	BreakerClosed BreakerState = "closed"
	// BreakerOpen: no attempt goes until OpenUntil; then one probe may.
	BreakerOpen BreakerState = "open"
	// BreakerHalfOpen: one probe attempt is in flight (until ProbeExpiresAt
	// at the latest); its outcome closes or reopens the breaker.
	BreakerHalfOpen BreakerState = "half_open"
)

// Breaker is an endpoint's circuit breaker, as stored. Zero times are unset.
type Breaker struct {
	SubscriptionID      uuid.UUID
	State               BreakerState
	ConsecutiveFailures int
	FailingSince        time.Time // first failure since the last success
	OpenedAt            time.Time
	OpenUntil           time.Time
	ProbeToken          uuid.UUID // lease token of the probe in flight; uuid.Nil when none
	ProbeExpiresAt      time.Time
	ThrottledUntil      time.Time // from a Retry-After: no attempt before this
	UpdatedAt           time.Time
}

// outcomeKind is what an attempt tells the breaker.
type outcomeKind int

const (
	// neutral: the attempt says nothing about the endpoint's health (a
	// terminal 4xx, a refused address, an attempt interrupted by shutdown).
	neutral outcomeKind = iota
	success
	failure
)

// transition applies one attempt's outcome to b at database time now and
// reports whether the subscription must be paused. probe says whether the
// attempt was the breaker's probe. It is a pure function: the rules in one
// place.
//
//   - success: closed, failure history cleared. Any success closes the
//     breaker, a straggler's included: the endpoint answered.
//   - failure of the probe: open again for a fresh cool-down.
//   - failure while closed: one more consecutive failure; at the threshold,
//     open for a cool-down.
//   - failure of a straggler while open or half-open (an attempt claimed
//     before the breaker opened): counted, state unchanged.
//   - neutral: nothing changes, except that a neutral probe releases the
//     probe slot so that the next probe may go at once.
//
// A Retry-After on a failure throttles the whole endpoint until then.
func (c BreakerConfig) transition(b Breaker, kind outcomeKind, probe bool, retryAfter time.Duration, now time.Time) (Breaker, bool) {
	if b.State == "" {
		b.State = BreakerClosed
	}
	switch kind {
	case success:
		b.State, b.ConsecutiveFailures = BreakerClosed, 0
		b.FailingSince, b.OpenedAt, b.OpenUntil = time.Time{}, time.Time{}, time.Time{}
		b.ProbeToken, b.ProbeExpiresAt = uuid.Nil, time.Time{}
		return b, false
	case neutral:
		if probe {
			b.ProbeToken, b.ProbeExpiresAt = uuid.Nil, time.Time{}
			if b.State == BreakerHalfOpen {
				b.State = BreakerOpen // with OpenUntil already passed: the next probe may go
			}
		}
		return b, false
	}
	b.ConsecutiveFailures++
	if b.FailingSince.IsZero() {
		b.FailingSince = now
	}
	if probe || (b.State == BreakerClosed && b.ConsecutiveFailures >= c.FailureThreshold) {
		b.State, b.OpenedAt, b.OpenUntil = BreakerOpen, now, now.Add(c.CoolDown)
		b.ProbeToken, b.ProbeExpiresAt = uuid.Nil, time.Time{}
	}
	if retryAfter > 0 && now.Add(retryAfter).After(b.ThrottledUntil) {
		b.ThrottledUntil = now.Add(retryAfter)
	}
	pause := c.PauseAfter > 0 && now.Sub(b.FailingSince) >= c.PauseAfter
	return b, pause
}

func nullTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

func nullUUID(u uuid.UUID) *uuid.UUID {
	if u == uuid.Nil {
		return nil
	}
	return &u
}

const breakerCols = `subscription_id, state, consecutive_failures, failing_since, opened_at, open_until,
	probe_token, probe_expires_at, throttled_until, updated_at`

func scanBreaker(row pgx.Row) (Breaker, error) {
	var (
		b                                               Breaker
		state                                           string
		failures                                        int32
		failingSince, openedAt, openUntil, probeExp, th *time.Time
		probe                                           *uuid.UUID
	)
	if err := row.Scan(&b.SubscriptionID, &state, &failures, &failingSince, &openedAt, &openUntil, &probe, &probeExp, &th, &b.UpdatedAt); err != nil {
		return Breaker{}, err
	}
	b.State, b.ConsecutiveFailures = BreakerState(state), int(failures)
	for _, p := range []struct {
		dst *time.Time
		src *time.Time
	}{{&b.FailingSince, failingSince}, {&b.OpenedAt, openedAt}, {&b.OpenUntil, openUntil}, {&b.ProbeExpiresAt, probeExp}, {&b.ThrottledUntil, th}} {
		if p.src != nil {
			*p.dst = *p.src
		}
	}
	if probe != nil {
		b.ProbeToken = *probe
	}
	return b, nil
}

// Breaker returns the circuit breaker of the subscription's endpoint. An
// endpoint that never failed has no stored row: it is reported closed.
func (s *Store) Breaker(ctx context.Context, db DBTX, subscriptionID uuid.UUID) (Breaker, error) {
	b, err := scanBreaker(db.QueryRow(ctx, `SELECT `+breakerCols+` FROM `+s.brks+` WHERE subscription_id = $1`, subscriptionID))
	if errors.Is(err, pgx.ErrNoRows) {
		return Breaker{SubscriptionID: subscriptionID, State: BreakerClosed}, nil
	}
	if err != nil {
		return Breaker{}, fmt.Errorf("outbound: breaker of %s: %w", subscriptionID, err)
	}
	return b, nil
}
