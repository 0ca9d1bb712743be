package backoff_test

import (
	"math"
	"testing"
	"time"

	"github.com/oncely/oncely/internal/backoff"
)

func TestCeilingDoublesAndCaps(t *testing.T) {
	t.Parallel()
	p := backoff.Policy{Base: 100 * time.Millisecond, Max: 5 * time.Second}
	for _, tc := range []struct {
		n    int
		want time.Duration
	}{
		{-3, 100 * time.Millisecond}, // n < 1 is treated as the first retry
		{0, 100 * time.Millisecond},
		{1, 100 * time.Millisecond},
		{2, 200 * time.Millisecond},
		{3, 400 * time.Millisecond},
		{4, 800 * time.Millisecond},
		{5, 1600 * time.Millisecond},
		{6, 3200 * time.Millisecond},
		{7, 5 * time.Second}, // 6.4s capped
		{8, 5 * time.Second},
		{1000, 5 * time.Second}, // no overflow for large n
	} {
		if got := p.Ceiling(tc.n); got != tc.want {
			t.Errorf("Ceiling(%d) = %s, want %s", tc.n, got, tc.want)
		}
	}
}

func TestCeilingBaseAboveMax(t *testing.T) {
	t.Parallel()
	p := backoff.Policy{Base: 10 * time.Second, Max: time.Second}
	for n := 1; n <= 5; n++ {
		if got := p.Ceiling(n); got != time.Second {
			t.Errorf("Ceiling(%d) = %s, want the cap 1s", n, got)
		}
	}
}

func TestCeilingIsMonotonic(t *testing.T) {
	t.Parallel()
	p := backoff.Policy{Base: 3 * time.Millisecond, Max: time.Minute}
	prev := time.Duration(0)
	for n := 1; n <= 200; n++ {
		c := p.Ceiling(n)
		if c < prev || c > p.Max || c <= 0 {
			t.Fatalf("Ceiling(%d) = %s after %s: want non-decreasing, positive, at most %s", n, c, prev, p.Max)
		}
		prev = c
	}
	if prev != p.Max {
		t.Errorf("Ceiling(200) = %s, want the cap %s", prev, p.Max)
	}
}

func TestDelayWithinCeilingAndJittered(t *testing.T) {
	t.Parallel()
	p := backoff.Policy{Base: 10 * time.Millisecond, Max: time.Second}
	const samples = 2000
	for _, n := range []int{1, 2, 4, 7, 8, 50} {
		ceiling := p.Ceiling(n)
		seen := map[time.Duration]bool{}
		var lowHalf, highHalf int
		for range samples {
			d := p.Delay(n)
			if d < 0 || d > ceiling {
				t.Fatalf("Delay(%d) = %s, outside [0, %s]", n, d, ceiling)
			}
			seen[d] = true
			if d < ceiling/2 {
				lowHalf++
			} else {
				highHalf++
			}
		}
		// Full jitter: many distinct values spread over the whole range, not a
		// constant and not a narrow band near the ceiling ("equal jitter").
		// With 2000 uniform samples over millions of nanoseconds, fewer than
		// 1000 distinct values or a half with under 20% of the samples would
		// happen with negligible probability.
		if len(seen) < samples/2 {
			t.Errorf("Delay(%d): only %d distinct values in %d samples; want jitter", n, len(seen), samples)
		}
		if lowHalf < samples/5 || highHalf < samples/5 {
			t.Errorf("Delay(%d): %d samples below %s and %d above; want them spread over [0, %s]",
				n, lowHalf, ceiling/2, highHalf, ceiling)
		}
	}
}

func TestDelayZeroPolicy(t *testing.T) {
	t.Parallel()
	var p backoff.Policy
	for n := range 5 {
		if d := p.Delay(n); d != 0 {
			t.Errorf("zero Policy: Delay(%d) = %s, want 0", n, d)
		}
	}
}

func TestHugeCapDoesNotOverflow(t *testing.T) {
	t.Parallel()
	p := backoff.Policy{Base: time.Second, Max: math.MaxInt64}
	for n := 1; n < 200; n++ {
		if c := p.Ceiling(n); c <= 0 || c < p.Ceiling(n-1) {
			t.Fatalf("Ceiling(%d) = %d: overflowed or shrank", n, c)
		}
		if d := p.Delay(n); d < 0 {
			t.Fatalf("Delay(%d) = %d", n, d)
		}
	}
}
