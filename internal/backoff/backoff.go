// Package backoff computes retry delays: exponential growth from a base,
// capped, with full jitter (a uniformly random delay between zero and the
// capped exponential value), so that many workers failing together do not
// retry in lockstep.
package backoff

import (
	"math"
	"math/rand/v2"
	"time"
)

// Policy is an exponential backoff with full jitter.
type Policy struct {
	Base time.Duration // delay ceiling of the first retry
	Max  time.Duration // cap of the ceiling
}

// Ceiling returns the upper bound of the delay before retry number n
// (n >= 1): min(Max, Base * 2^(n-1)).
func (p Policy) Ceiling(n int) time.Duration {
	if n < 1 {
		n = 1
	}
	d := p.Base
	for i := 1; i < n && d < p.Max; i++ {
		if d > p.Max/2 {
			return p.Max // doubling would pass the cap (or overflow)
		}
		d *= 2
	}
	return min(d, p.Max)
}

// Delay returns a random delay in [0, Ceiling(n)].
func (p Policy) Delay(n int) time.Duration {
	c := p.Ceiling(n)
	if c <= 0 {
		return 0
	}
	if c == math.MaxInt64 {
		return rand.N(c)
	}
	return rand.N(c + 1)
}
