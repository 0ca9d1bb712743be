package main

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// summary is one mode over its rounds.
type summary struct {
	runs     []result
	median   result        // the run with the median records/s
	p50, p99 time.Duration // over the latency samples of all runs
	failed   error         // the first run's error, if any
	rates    []float64     // records/s of each run, in round order
	// appCPU and pgCPU are the mean CPU time per record of the throughput
	// phases: benchmark process and broker, and the mode's Postgres backends.
	appCPU, pgCPU time.Duration
}

func summarize(runs []result) *summary {
	s := &summary{runs: runs}
	var lat []time.Duration
	for _, r := range runs {
		if r.err != nil && s.failed == nil {
			s.failed = r.err
		}
		s.rates = append(s.rates, r.rate())
		lat = append(lat, r.latencies...)
		if r.records > 0 {
			s.appCPU += r.cpu.app / time.Duration(r.records*len(runs))
			s.pgCPU += r.cpu.pg / time.Duration(r.records*len(runs))
		}
	}
	byRate := slices.Clone(runs)
	slices.SortFunc(byRate, func(a, b result) int { return cmpFloat(a.rate(), b.rate()) })
	s.median = byRate[(len(byRate)-1)/2]
	s.p50, s.p99 = percentiles(lat)
	return s
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// ratio is the median over rounds of m's records/s over base's in the same
// round (rss, run once, pairs with the first round), with each round's ratio.
func ratio(sums map[string]*summary, m, base string) (float64, []float64) {
	a, b := sums[m], sums[base]
	if a == nil || b == nil || m == base || a.failed != nil || b.failed != nil {
		return 0, nil
	}
	var each []float64
	for i := range min(len(a.rates), len(b.rates)) {
		if a.rates[i] > 0 && b.rates[i] > 0 {
			each = append(each, a.rates[i]/b.rates[i])
		}
	}
	if len(each) == 0 {
		return 0, nil
	}
	sorted := slices.Clone(each)
	slices.Sort(sorted)
	if n := len(sorted); n%2 == 0 {
		return (sorted[n/2-1] + sorted[n/2]) / 2, each
	}
	return sorted[len(sorted)/2], each
}

// report prints the results table, then the targets with pass or fail.
func report(out io.Writer, o options, runs map[string][]result) {
	sums := map[string]*summary{}
	for m, rs := range runs {
		if len(rs) > 0 {
			sums[m] = summarize(rs)
		}
	}
	cell := func(m, base string) string {
		if m == modeKeySeq || m == modeKeyPar {
			return "-" // sleep-bound: only comparable with each other
		}
		if v, _ := ratio(sums, m, base); v > 0 {
			return fmt.Sprintf("%.2f", v)
		}
		return "-"
	}

	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\trecords\tseconds\trecords/s\trec/tx\tapp CPU/rec\tpg CPU/rec\tp50\tp99\tvs ceiling\tvs naive\tvs oncely\tvs watermill\t\tnote\t")
	for _, m := range allModes {
		s := sums[m]
		if s == nil {
			continue
		}
		r := s.median
		note := r.note
		if s.failed != nil {
			note = "FAILED: " + s.failed.Error()
		}
		fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.0f\t%.1f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\t%s\t\n",
			r.mode, r.records, r.elapsed.Seconds(), r.rate(), r.perTx, us(s.appCPU), us(s.pgCPU), dur(s.p50), dur(s.p99),
			cell(m, modeCeiling), cell(m, modeNaive), cell(m, modePerRecord), cell(m, modeWatermill), note)
	}
	_ = tw.Flush()
	fmt.Fprintf(out, "\nrecords/s and seconds: the median of %d rounds; p50/p99 over all rounds' latency samples; "+
		"vs X: the median of each round's ratio of records/s.\n", o.rounds)

	targets := newTargets(out)
	check := targets.check
	for _, t := range []struct {
		name      string
		m, base   string
		threshold float64
	}{
		{"batch >= 0.60 x raw-SQL ceiling", modeBatch, modeCeiling, 0.60},
		{"batch >= 5 x oncely per-record", modeBatch, modePerRecord, 5},
		{"batch >= 10 x watermill", modeBatch, modeWatermill, 10},
		{"oncely per-record >= 0.80 x naive at-least-once", modePerRecord, modeNaive, 0.80},
		{fmt.Sprintf("per-key parallel >= 20 x per-partition sequential (%s handler, 100 keys, 1 partition)", o.keySleep), modeKeyPar, modeKeySeq, 20},
		{"oncely per-record >= 1.00 x watermill", modePerRecord, modeWatermill, 1},
	} {
		v, each := ratio(sums, t.m, t.base)
		shown := ""
		if v > 0 {
			shown = fmt.Sprintf("%.2f [%s]", v, joinRatios(each))
		}
		check(t.name, v >= t.threshold, shown)
	}
	name := "RSS flat within 20% while a backlog drains (last quarter / first quarter)"
	if s := sums[modeRSS]; s != nil && s.failed == nil && s.median.rss != nil {
		r := s.median.rss
		g := r.growth()
		check(name, g <= 1.2, fmt.Sprintf("%.2f (%s -> %s over %d records; peak %s)",
			g, mib(r.firstQ), mib(r.lastQ), s.median.records, mib(max(r.peak, r.hwm))))
	} else {
		check(name, false, "")
	}
	targets.close()
}

func joinRatios(v []float64) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprintf("%.2f", x)
	}
	return strings.Join(s, " ")
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

// us prints a CPU time per record in microseconds.
func us(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Microsecond), 'f', 1, 64) + "us"
}

func mib(b uint64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

// targetTable prints the targets, each PASS, FAIL or "not run" (shown
// empty), and counts them.
type targetTable struct {
	out            io.Writer
	tw             *tabwriter.Writer
	passed, failed int
}

func newTargets(out io.Writer) *targetTable {
	fmt.Fprintln(out)
	fmt.Fprintln(out, "Targets (median of the rounds' ratios; each round's ratio in brackets):")
	return &targetTable{out: out, tw: tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)}
}

func (t *targetTable) check(name string, ok bool, shown string) {
	status := "FAIL"
	switch {
	case shown == "":
		status = "not run"
	case ok:
		status = "PASS"
		t.passed++
	default:
		t.failed++
	}
	fmt.Fprintf(t.tw, "  %s\t%s\t%s\n", status, name, shown)
}

// close prints the table and the counts.
func (t *targetTable) close() {
	_ = t.tw.Flush()
	fmt.Fprintf(t.out, "targets: %d passed, %d failed\n", t.passed, t.failed)
}
