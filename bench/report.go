package main

import (
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"
)

// report prints the results table, then the targets with pass or fail.
func report(out io.Writer, o options, modes []string, results map[string]result) {
	rate := func(m string) float64 {
		if r, ok := results[m]; ok && r.err == nil {
			return r.rate()
		}
		return 0
	}
	ratio := func(m, base string) string {
		if m == base || rate(m) == 0 || rate(base) == 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f", rate(m)/rate(base))
	}

	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\trecords\tseconds\trecords/s\tp50\tp99\tvs ceiling\tvs naive\tvs oncely\tvs watermill\t\tnote\t")
	for _, m := range allModes {
		r, ok := results[m]
		if !ok {
			continue
		}
		vs := []string{ratio(m, modeCeiling), ratio(m, modeNaive), ratio(m, modePerRecord), ratio(m, modeWatermill)}
		if m == modeKeySeq || m == modeKeyPar {
			vs = []string{"-", "-", "-", "-"}
		}
		note := r.note
		if r.err != nil {
			note = "FAILED: " + r.err.Error()
		}
		fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.0f\t%s\t%s\t%s\t%s\t%s\t%s\t\t%s\t\n", r.mode, r.records, r.elapsed.Seconds(), r.rate(),
			dur(r.p50), dur(r.p99), vs[0], vs[1], vs[2], vs[3], note)
	}
	_ = tw.Flush()

	fmt.Fprintln(out)
	fmt.Fprintln(out, "Targets (ratios of records/s measured in this run):")
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	passed, failed := 0, 0
	check := func(name string, value float64, ok bool, shown string) {
		status := "FAIL"
		switch {
		case value == 0:
			status = "not run"
		case ok:
			status = "PASS"
			passed++
		default:
			failed++
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", status, name, shown)
	}
	x := func(m, base string) float64 {
		if rate(m) == 0 || rate(base) == 0 {
			return 0
		}
		return rate(m) / rate(base)
	}
	for _, t := range []struct {
		name      string
		m, base   string
		threshold float64
	}{
		{"batch >= 0.60 x raw-SQL ceiling", modeBatch, modeCeiling, 0.60},
		{"batch >= 5 x oncely per-record", modeBatch, modePerRecord, 5},
		{"batch >= 10 x watermill", modeBatch, modeWatermill, 10},
		{"oncely per-record >= 0.80 x naive at-least-once", modePerRecord, modeNaive, 0.80},
		{"per-key parallel >= 20 x per-partition sequential (" + o.keySleep.String() + " handler, 100 keys, 1 partition)", modeKeyPar, modeKeySeq, 20},
		{"oncely per-record >= 1.00 x watermill", modePerRecord, modeWatermill, 1},
	} {
		v := x(t.m, t.base)
		check(t.name, v, v >= t.threshold, fmt.Sprintf("%.2f", v))
	}
	if r, ok := results[modeRSS]; ok && r.err == nil && r.rss != nil {
		g := r.rss.growth()
		check(fmt.Sprintf("RSS flat within 20%% over a %d-record backlog (last / first quarter)", r.records), g, g >= 0.8 && g <= 1.2,
			fmt.Sprintf("%.2f (%s -> %s, peak %s)", g, mib(r.rss.firstQ), mib(r.rss.lastQ), mib(max(r.rss.peak, r.rss.hwm))))
	} else {
		check("RSS flat within 20% over the RSS backlog", 0, false, "")
	}
	_ = tw.Flush()
	fmt.Fprintf(out, "targets: %d passed, %d failed\n", passed, failed)
}

// dur prints a latency with three significant digits.
func dur(d time.Duration) string {
	switch {
	case d <= 0:
		return "-"
	case d < time.Second:
		return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'g', 3, 64) + "ms"
	default:
		return strconv.FormatFloat(d.Seconds(), 'g', 3, 64) + "s"
	}
}

func mib(b uint64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }
