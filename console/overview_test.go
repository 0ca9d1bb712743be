package console

import (
	"testing"
	"time"

	"github.com/oncely/oncely/dlq"
)

// The trend compares the lag now with the oldest sample of the last
// trendWindow that knows the partition; samples closer than minLagGap are
// not kept, and samples older than lagKept are dropped.
func TestLagTrend(t *testing.T) {
	var h lagHistory
	t0 := time.Date(2026, 1, 2, 10, 0, 0, 0, time.UTC)
	row := func(p int32, lag int64) lagRow { return lagRow{Group: "g", Topic: "t", Partition: p, Lag: lag} }
	h.record(t0, []lagRow{row(0, 100)})
	h.record(t0.Add(time.Second), []lagRow{row(0, 5000), row(1, 7)}) // too close: not kept
	h.record(t0.Add(10*time.Minute), []lagRow{row(0, 400), row(1, 10)})

	now := t0.Add(12 * time.Minute)
	rows := []lagRow{row(0, 250), row(1, 4), row(2, 9), {Group: "g", Topic: "t", Partition: 3, Err: "unknown"}}
	h.trend(now, rows)
	if rows[0].Trend != 150 || rows[0].Since != 12*time.Minute {
		t.Errorf("partition 0: trend %+d since %s, want +150 since 12m (against the first sample)", rows[0].Trend, rows[0].Since)
	}
	if rows[1].Trend != -6 || rows[1].Since != 2*time.Minute {
		t.Errorf("partition 1: trend %+d since %s, want -6 since 2m (its first sample)", rows[1].Trend, rows[1].Since)
	}
	if rows[2].Since != 0 || rows[3].Since != 0 {
		t.Errorf("no trend without an earlier sample or with an error: %+v %+v", rows[2], rows[3])
	}

	// 20 minutes on, the first sample is outside the window.
	rows = []lagRow{row(0, 0)}
	h.trend(t0.Add(20*time.Minute), rows)
	if rows[0].Trend != -400 || rows[0].Since != 10*time.Minute {
		t.Errorf("partition 0 at 20m: trend %+d since %s, want -400 since 10m", rows[0].Trend, rows[0].Since)
	}
	h.record(t0.Add(2*time.Hour), []lagRow{row(0, 1)})
	if len(h.samples) != 1 || h.span(t0.Add(2*time.Hour)) != 0 {
		t.Errorf("samples older than %s kept: %d samples", lagKept, len(h.samples))
	}
}

// Dead letters are counted per hour of the last 24 and per day of the last
// 14 by their last failure; older ones only in Older.
func TestDeadLetterTimes(t *testing.T) {
	now := time.Date(2026, 1, 15, 10, 30, 0, 0, time.UTC)
	tm := newTimes(now)
	tm.add(now.Add(-10*time.Minute), dlq.ClassPermanent)          // 10:00 hour, today
	tm.add(now.Add(-20*time.Minute), dlq.ClassPermanent)          // 10:00 hour, today
	tm.add(now.Add(-3*time.Hour), dlq.ClassMaxAttempts)           // 07:00 hour, today
	tm.add(now.Add(-30*time.Hour), dlq.ClassUndecodable)          // not in the hours; 2026-01-14
	tm.add(now.Add(-20*24*time.Hour), dlq.ClassPanic)             // older
	tm.add(now.Add(-23*time.Hour-10*time.Minute), dlq.ClassPanic) // 2026-01-14 11:20, in the first of the 24 hours
	hours, days := nonEmpty(tm.Hours), nonEmpty(tm.Days)
	if len(hours) != 3 || hours[0].At.Hour() != 11 || hours[0].Counts[dlq.ClassPanic] != 1 ||
		hours[1].At.Hour() != 7 || hours[1].Counts[dlq.ClassMaxAttempts] != 1 ||
		hours[2].At.Hour() != 10 || hours[2].Counts[dlq.ClassPermanent] != 2 || hours[2].Total != 2 {
		t.Errorf("hours: %+v", hours)
	}
	if len(days) != 2 || days[0].At.Day() != 14 || days[0].Total != 2 || days[1].At.Day() != 15 || days[1].Total != 3 {
		t.Errorf("days: %+v", days)
	}
	if tm.Older != 1 {
		t.Errorf("older: %d, want 1", tm.Older)
	}
}
