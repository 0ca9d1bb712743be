package ratelog

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) { c.mu.Lock(); defer c.mu.Unlock(); c.t = c.t.Add(d) }

func lines(buf *bytes.Buffer) []string {
	s := strings.TrimSpace(buf.String())
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

// A burst of one kind writes one record per interval, and the next record
// says how many were held back; another kind is not held back by it.
func TestLimiterOnePerIntervalPerKind(t *testing.T) {
	var buf bytes.Buffer
	clk := &clock{t: time.Unix(1000, 0)}
	l := New(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{ReplaceAttr: dropTime})), time.Second)
	l.now = clk.now
	ctx := context.Background()

	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l.Warn(ctx, "database down", "err", "refused")
		}()
	}
	wg.Wait()
	l.Warn(ctx, "broker down")
	if got := lines(&buf); len(got) != 2 || !strings.Contains(got[0], `msg="database down"`) || strings.Contains(got[0], SuppressedKey) ||
		!strings.Contains(got[1], `msg="broker down"`) {
		t.Fatalf("after a burst of 50 and another kind: %q, want one line of each kind", got)
	}

	buf.Reset()
	clk.add(999 * time.Millisecond)
	l.Warn(ctx, "database down", "err", "refused")
	if got := lines(&buf); len(got) != 0 {
		t.Fatalf("within the interval: %q, want nothing", got)
	}
	clk.add(time.Millisecond)
	l.Warn(ctx, "database down", "err", "refused")
	got := lines(&buf)
	if len(got) != 1 || !strings.Contains(got[0], "suppressed=50") || !strings.Contains(got[0], "err=refused") {
		t.Fatalf("after the interval: %q, want one line with suppressed=50 (49 of the burst and 1 since)", got)
	}

	buf.Reset()
	clk.add(time.Second)
	l.Warn(ctx, "database down")
	if got := lines(&buf); len(got) != 1 || strings.Contains(got[0], SuppressedKey) {
		t.Fatalf("nothing held back: %q, want a line without a count", got)
	}
}

// Records below the logger's level are not counted as held back.
func TestLimiterDisabledLevel(t *testing.T) {
	var buf bytes.Buffer
	l := New(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelError})), time.Hour)
	l.Warn(context.Background(), "x")
	l.Log(context.Background(), slog.LevelError, "x", "x")
	if got := lines(&buf); len(got) != 1 || strings.Contains(got[0], SuppressedKey) {
		t.Fatalf("%q, want the one ERROR line, without a count", got)
	}
}

func dropTime(_ []string, a slog.Attr) slog.Attr {
	if a.Key == slog.TimeKey {
		return slog.Attr{}
	}
	return a
}
