package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/oncely/oncely/outbox"
)

func outboxCmd(ctx context.Context, sub string, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("outbox "+sub, flag.ContinueOnError)
	var db dbFlags
	db.register(fs)
	timeout := fs.Duration("timeout", 15*time.Second, "how long to wait for Postgres")
	asJSON := jsonFlag(fs)
	var all *bool
	var limit *int
	switch sub {
	case "status", "discard":
	case "parked":
		limit = fs.Int("limit", 0, "list at most this many rows, oldest first (0: all)")
	case "retry":
		all = fs.Bool("all", false, "retry every parked row")
	default:
		return usageErr("outbox: unknown subcommand %q (want status, parked, retry or discard)", sub)
	}
	ids, err := parseWithIDs(fs, args, stderr)
	if err != nil {
		return err
	}
	switch {
	case sub == "retry" && *all && len(ids) > 0:
		return usageErr("outbox retry: give row ids or --all, not both")
	case sub == "retry" && !*all && len(ids) == 0, sub == "discard" && len(ids) == 0:
		return usageErr("outbox %s: name at least one parked row id (see oncely outbox parked)", sub)
	case (sub == "status" || sub == "parked") && len(ids) > 0:
		return usageErr("outbox %s: unexpected argument %d", sub, ids[0])
	case limit != nil && *limit < 0:
		return usageErr("--limit: must not be negative, got %d", *limit)
	}
	o, err := outbox.New(outbox.Config{Schema: db.schema})
	if err != nil {
		return usageErr("--schema: %v", err)
	}
	pool, err := db.connect(ctx, *timeout)
	if err != nil {
		return err
	}
	defer pool.Close()
	switch sub {
	case "status":
		st, err := o.Status(ctx, pool)
		if err != nil {
			return err
		}
		if *asJSON {
			return printJSON(stdout, jsonOutboxStatus{Pending: st.Pending, OldestPendingSeconds: st.OldestPending.Seconds(),
				SentRetained: st.Sent, Parked: st.Parked})
		}
		fmt.Fprintf(stdout, "pending\t%d\noldest_pending_seconds\t%.3f\nsent_retained\t%d\nparked\t%d\n",
			st.Pending, st.OldestPending.Seconds(), st.Sent, st.Parked)
		return nil
	case "parked":
		rows, err := o.Parked(ctx, pool, *limit)
		if err != nil {
			return err
		}
		if *asJSON {
			return printParkedJSON(stdout, rows)
		}
		return printParked(stdout, rows)
	case "retry":
		if *all {
			n, err := o.RetryAll(ctx, pool)
			if err != nil {
				return err
			}
			if *asJSON {
				return printJSON(stdout, jsonCount{Action: "retried", Count: n})
			}
			fmt.Fprintf(stdout, "%d parked rows retried\n", n)
			return nil
		}
		return eachID(ids, stdout, *asJSON, "retried", func(id int64) error { return o.Retry(ctx, pool, id) })
	default: // discard
		return eachID(ids, stdout, *asJSON, "discarded", func(id int64) error { return o.Discard(ctx, pool, id) })
	}
}

type jsonOutboxStatus struct {
	Pending              int64   `json:"pending"`
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	SentRetained         int64   `json:"sent_retained"`
	Parked               int64   `json:"parked"`
}

// jsonCount is the outcome of a command that acts on many rows at once.
type jsonCount struct {
	Action string `json:"action"`
	Count  int64  `json:"count"`
}

// jsonDone is the outcome of a command for one row.
type jsonDone struct {
	Action string `json:"action"`
	ID     string `json:"id"`
}

// parseWithIDs parses flags and the row ids among them, in any order.
func parseWithIDs(fs *flag.FlagSet, args []string, stderr io.Writer) ([]int64, error) {
	pos, err := parseArgs(fs, args, stderr)
	if err != nil {
		return nil, err
	}
	ids := make([]int64, 0, len(pos))
	for _, a := range pos {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil || id <= 0 {
			return nil, usageErr("%s: %q is not an outbox row id", fs.Name(), a)
		}
		ids = append(ids, id)
	}
	return ids, nil
}

func eachID(ids []int64, stdout io.Writer, asJSON bool, done string, do func(int64) error) error {
	var first error
	for _, id := range ids {
		if err := do(id); err != nil {
			first = cmp.Or(first, err)
			continue
		}
		if asJSON {
			first = cmp.Or(first, printJSON(stdout, jsonDone{Action: done, ID: strconv.FormatInt(id, 10)}))
			continue
		}
		fmt.Fprintf(stdout, "%s\t%d\n", done, id)
	}
	return first
}

func printParked(w io.Writer, rows []outbox.ParkedRow) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tMESSAGE-ID\tTOPIC\tKEY\tBYTES\tHELD\tPARKED-AT\tERROR")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%d\t%s\t%s\n", r.ID, r.MessageID, r.Topic, clip(printable(r.Key), 40),
			r.Size, r.Held, r.ParkedAt.UTC().Format(time.RFC3339), clip(r.Error, 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "%d parked rows\n", len(rows))
	return err
}

type jsonParked struct {
	ID        int64     `json:"id"`
	MessageID string    `json:"message_id"`
	Topic     string    `json:"topic"`
	Key       *string   `json:"key"` // null for a row without a key
	Size      int64     `json:"size"`
	Held      int64     `json:"held"`
	Error     string    `json:"error"`
	ParkedAt  time.Time `json:"parked_at"`
}

func printParkedJSON(w io.Writer, rows []outbox.ParkedRow) error {
	out := make([]jsonParked, 0, len(rows))
	for _, r := range rows {
		j := jsonParked{ID: r.ID, MessageID: r.MessageID, Topic: r.Topic, Size: r.Size, Held: r.Held, Error: r.Error, ParkedAt: r.ParkedAt.UTC()}
		if r.Key != nil {
			k := printable(r.Key)
			j.Key = &k
		}
		out = append(out, j)
	}
	return printJSON(w, out...)
}
