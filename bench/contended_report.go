package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"text/tabwriter"
	"time"
)

// perTenK is deadlocks per 10,000 committed records.
func (r cresult) perTenK() float64 {
	if r.committed <= 0 {
		if r.deadlocks > 0 {
			return math.Inf(1)
		}
		return 0
	}
	return float64(r.deadlocks) * 10_000 / float64(r.committed)
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if n := len(s); n%2 == 0 {
		return (s[n/2-1] + s[n/2]) / 2
	}
	return s[len(s)/2]
}

// cratio is the median over rounds of a's records/s over b's in the same
// round, with each round's ratio; 0 when either failed.
func cratio(a, b []cresult) (float64, []float64) {
	var each []float64
	for i := range min(len(a), len(b)) {
		if a[i].err != nil || b[i].err != nil || a[i].rate() <= 0 || b[i].rate() <= 0 {
			return 0, nil
		}
		each = append(each, a[i].rate()/b[i].rate())
	}
	return median(each), each
}

func csummary(rs []cresult) (med cresult, p50, p99 time.Duration, failed error) {
	var lat []time.Duration
	for _, r := range rs {
		if r.err != nil && failed == nil {
			failed = r.err
		}
		lat = append(lat, r.latencies...)
	}
	by := slices.Clone(rs)
	slices.SortFunc(by, func(a, b cresult) int { return cmpFloat(a.rate(), b.rate()) })
	med = by[(len(by)-1)/2]
	p50, p99 = percentiles(lat)
	return med, p50, p99, failed
}

func count(v int64) string {
	if v < 0 {
		return "-"
	}
	return strconv.FormatInt(v, 10)
}

// reportContended prints every round's figures, the medians with the ratios,
// and the targets.
func reportContended(out io.Writer, o options, counts []int, runs map[string]map[int][]cresult) {
	modes := func(f func(m string, n int, rs []cresult)) {
		for _, m := range allContendedModes {
			ns := counts
			if m == cmCeiling {
				ns = ceilingConns(o.conns, counts)
			}
			for _, n := range ns {
				if rs := runs[m][n]; len(rs) > 0 {
					f(m, n, rs)
				}
			}
		}
	}
	who := func(m string, n int) string {
		if m == cmCeiling {
			return fmt.Sprintf("%d conn", n)
		}
		return strconv.Itoa(n)
	}

	fmt.Fprintln(out, "Every round (members: consumers of one group, each with its own pool; the ceiling: connections):")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tmembers\tround\trecords\tseconds\trecords/s\trec/tx\tdeadlocks\tretries\tcontention\tdead letters\tcommitted\tmembers through at\t\tresult\t")
	modes(func(m string, n int, rs []cresult) {
		for i, r := range rs {
			status := "ok"
			if r.err != nil {
				status = "FAILED: " + r.err.Error()
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%.2f\t%.0f\t%.1f\t%d\t%d\t%s\t%d\t%d\t%s\t\t%s\t\n", r.mode, who(m, n), i+1, r.records,
				r.elapsed.Seconds(), r.rate(), r.perTx, r.deadlocks, r.retries, count(r.contention), r.deadLetters, r.committed, r.endsNote(), status)
		}
	})
	_ = tw.Flush()

	fmt.Fprintln(out)
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tmembers\trecords\tseconds\trecords/s\trec/tx\tapp CPU/rec\tpg CPU/rec\tp50\tp99\tdeadlocks\tdl/10k rec\tretries\tcontention\tdead letters\tvs ceiling\tvs hand\tmembers/1\t\tnote\t")
	modes(func(m string, n int, rs []cresult) {
		med, p50, p99, failed := csummary(rs)
		var dl, rt, ct, dead, committed int64
		var appCPU, pgCPU time.Duration
		ct = -1
		for _, r := range rs {
			if r.records > 0 {
				appCPU += r.cpu.app / time.Duration(r.records*len(rs))
				pgCPU += r.cpu.pg / time.Duration(r.records*len(rs))
			}
			dl, rt, dead, committed = dl+r.deadlocks, rt+r.retries, dead+r.deadLetters, committed+r.committed
			if r.contention >= 0 {
				ct = max(ct, 0) + r.contention
			}
		}
		per10k := 0.0
		if committed > 0 {
			per10k = float64(dl) * 10_000 / float64(committed)
		}
		vsHand, scale, vsCeiling := "-", "-", "-"
		if !(m == cmCeiling && n == 4) {
			if v, _ := cratio(rs, runs[cmCeiling][4]); v > 0 {
				vsCeiling = fmt.Sprintf("%.2f", v)
			}
		}
		if m != cmHand && m != cmCeiling {
			if v, _ := cratio(rs, runs[cmHand][n]); v > 0 {
				vsHand = fmt.Sprintf("%.2f", v)
			}
		}
		if m == cmCeiling && n > 4 {
			// members/1 of the ceiling: as many connections as the
			// largest group holds, against 4.
			if v, _ := cratio(rs, runs[m][4]); v > 0 {
				scale = fmt.Sprintf("%.2f", v)
			}
		}
		if m != cmCeiling && n != 1 {
			if v, _ := cratio(rs, runs[m][1]); v > 0 {
				scale = fmt.Sprintf("%.2f", v)
			}
		}
		note := med.note
		if failed != nil {
			note = fmt.Sprintf("FAILED in %d of %d rounds: %v", countFailed(rs), len(rs), failed)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%.2f\t%.0f\t%.1f\t%s\t%s\t%s\t%s\t%d\t%.2f\t%d\t%s\t%d\t%s\t%s\t%s\t\t%s\t\n",
			med.mode, who(m, n), med.records, med.elapsed.Seconds(), med.rate(), med.perTx, us(appCPU), us(pgCPU), dur(p50), dur(p99),
			dl, per10k, rt, count(ct), dead, vsCeiling, vsHand, scale, note)
	})
	_ = tw.Flush()
	fmt.Fprintf(out, "\nrecords/s, seconds, rec/tx: the round with the median records/s of %d rounds; p50/p99 over all rounds' latency samples "+
		"(the ceiling: one transaction); deadlocks, retries, contention, dead letters: totals over the rounds; dl/10k rec: deadlocks per "+
		"10,000 records committed (throughput and latency phases); app CPU/rec, pg CPU/rec: as in the uncontended table (throughput phase; "+
		"app includes every member and the broker); vs ceiling: median of each round's ratio to the 4-connection ceiling; vs hand: median of each round's ratio to the hand-written baseline "+
		"with as many members; members/1: median of each round's ratio to the same mode with one member (the ceiling on as many connections as the largest group holds: to the 4-connection ceiling). contention '-': the library "+
		"has no such counter. members through at (every round): when each member of a group committed its last record of the backlog, "+
		"as a share of the round's time, earliest first: a group drains at its slowest member's pace, and the others sit idle for the rest.\n", o.rounds)

	targets := newTargets(out)
	check := targets.check
	vsHand := func(name, m string, n int, threshold float64) {
		rs, hand := runs[m][n], runs[cmHand][n]
		if len(rs) == 0 || len(hand) == 0 {
			check(name, false, "")
			return
		}
		v, each := cratio(rs, hand)
		if v == 0 {
			check(name, false, "a round failed")
			return
		}
		check(name, v >= threshold, fmt.Sprintf("%.2f [%s]", v, joinRatios(each)))
	}
	vsHand("example default (batch) >= 10 x hand, 1 member", cmBatch, 1, 10)
	vsHand("batch with per-record Handler >= 2 x hand, 1 member", cmBatchRecs, 1, 2)
	oncelyModes := []string{cmOncely, cmBatchRecs, cmBatch, cmPerKey, cmBatchRecsNoCK, cmPerKeyNoCK, cmBatchCK}
	for _, n := range counts {
		for _, m := range oncelyModes {
			if len(runs[m][n]) > 0 {
				vsHand(fmt.Sprintf("%s >= 1 x hand, %d member(s)", m, n), m, n, 1)
			}
		}
	}
	for _, n := range counts {
		if n == 1 {
			continue
		}
		for _, m := range append([]string{cmHand}, oncelyModes...) {
			rs, one := runs[m][n], runs[m][1]
			if len(rs) == 0 || len(one) == 0 {
				continue
			}
			v, each := cratio(rs, one)
			shown := "a round failed"
			if v > 0 {
				shown = fmt.Sprintf("%.2f [%s]", v, joinRatios(each))
			}
			check(fmt.Sprintf("%s: %d members >= 1 x one member", m, n), v >= 1, shown)
		}
	}
	for _, m := range oncelyModes {
		for _, n := range counts {
			rs := runs[m][n]
			if len(rs) == 0 {
				continue
			}
			var dl, committed int64
			each := make([]string, len(rs))
			for i, r := range rs {
				dl, committed = dl+r.deadlocks, committed+r.committed
				each[i] = fmt.Sprintf("%.2f", r.perTenK())
			}
			v := float64(dl) * 10_000 / float64(max(committed, 1))
			worst := 0.0
			for _, r := range rs {
				worst = max(worst, r.perTenK())
			}
			check(fmt.Sprintf("%s x%d: deadlocks <= 1 per 10,000 records", m, n), worst <= 1,
				fmt.Sprintf("%.2f overall, %d deadlocks [per round: %s]", v, dl, joinStrings(each)))
		}
	}
	var dead int64
	ran := false
	for _, m := range oncelyModes {
		for _, n := range counts {
			for _, r := range runs[m][n] {
				dead += r.deadLetters
				ran = true
			}
		}
	}
	if ran {
		check("0 records dead-lettered in every oncely mode", dead == 0, strconv.FormatInt(dead, 10))
	}
	targets.close()
}

func countFailed(rs []cresult) int {
	n := 0
	for _, r := range rs {
		if r.err != nil {
			n++
		}
	}
	return n
}

func joinStrings(v []string) string {
	out := ""
	for i, s := range v {
		if i > 0 {
			out += " "
		}
		out += s
	}
	return out
}
