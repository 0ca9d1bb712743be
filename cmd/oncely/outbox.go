package main

import (
	"cmp"
	"context"
	"encoding/json"
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
	var asJSON, all *bool
	var limit *int
	switch sub {
	case "status", "discard":
	case "parked":
		asJSON = fs.Bool("json", false, "print one JSON object per parked row")
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
			fmt.Fprintf(stdout, "%d parked rows retried\n", n)
			return nil
		}
		return eachID(ids, stdout, "retried", func(id int64) error { return o.Retry(ctx, pool, id) })
	default: // discard
		return eachID(ids, stdout, "discarded", func(id int64) error { return o.Discard(ctx, pool, id) })
	}
}

// parseWithIDs parses flags and the row ids among them, in any order.
func parseWithIDs(fs *flag.FlagSet, args []string, stderr io.Writer) ([]int64, error) {
	var ids []int64
	for {
		if err := parse(fs, args, stderr); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return ids, nil
		}
		id, err := strconv.ParseInt(fs.Arg(0), 10, 64)
		if err != nil || id <= 0 {
			return nil, usageErr("%s: %q is not an outbox row id", fs.Name(), fs.Arg(0))
		}
		ids, args = append(ids, id), fs.Args()[1:]
	}
}

// eachID applies do to every id, reporting each, and returns the first error
// after trying them all.
func eachID(ids []int64, stdout io.Writer, done string, do func(int64) error) error {
	var first error
	for _, id := range ids {
		if err := do(id); err != nil {
			first = cmp.Or(first, err)
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
	enc := json.NewEncoder(w)
	for _, r := range rows {
		j := jsonParked{ID: r.ID, MessageID: r.MessageID, Topic: r.Topic, Size: r.Size, Held: r.Held, Error: r.Error, ParkedAt: r.ParkedAt.UTC()}
		if r.Key != nil {
			k := printable(r.Key)
			j.Key = &k
		}
		if err := enc.Encode(j); err != nil {
			return err
		}
	}
	return nil
}
