package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/oncely/oncely/webhook/outbound"
)

// webhooksCmd runs the outbound webhook subcommands:
//
//	oncely webhooks status  [--database-url URL] [--schema oncely]
//	oncely webhooks redrive (--subscription ID | --all-subscriptions) [--since T] [--until T] [--limit N] [--dry-run]
//	oncely webhooks pause   --subscription ID [--reason TEXT]
//	oncely webhooks resume  --subscription ID
func webhooksCmd(ctx context.Context, sub string, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("webhooks "+sub, flag.ContinueOnError)
	var db dbFlags
	db.register(fs)
	timeout := fs.Duration("timeout", 15*time.Second, "how long to wait for Postgres")
	asJSON := jsonFlag(fs)
	var subscription, since, until, reason string
	var all, dryRun bool
	var limit int
	switch sub {
	case "redrive":
		fs.StringVar(&subscription, "subscription", "", "redrive this subscription's dead deliveries (its id)")
		fs.BoolVar(&all, "all-subscriptions", false, "redrive the dead deliveries of every subscription")
		fs.StringVar(&since, "since", "", "only deliveries that died at or after this time (RFC 3339, or a duration ago such as 24h)")
		fs.StringVar(&until, "until", "", "only deliveries that died before this time (RFC 3339, or a duration ago)")
		fs.IntVar(&limit, "limit", 0, "redrive at most this many, oldest deaths first (0: all)")
		fs.BoolVar(&dryRun, "dry-run", false, "list what would be redriven, change nothing")
	case "pause", "resume":
		fs.StringVar(&subscription, "subscription", "", "the subscription's id (required)")
		if sub == "pause" {
			fs.StringVar(&reason, "reason", "paused by an operator", "why, stored with the pause")
		}
	case "status":
	default:
		return usageErr("webhooks: unknown subcommand %q (want status, redrive, pause or resume)", sub)
	}
	if err := parse(fs, args, stderr); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageErr("webhooks %s: unexpected arguments %q", sub, fs.Args())
	}
	store, err := outbound.NewStore(outbound.Config{Schema: db.schema})
	if err != nil {
		return usageErr("--schema: %v", err)
	}
	var subID uuid.UUID
	if subscription != "" {
		if subID, err = uuid.Parse(subscription); err != nil {
			return usageErr("--subscription: %q is not a subscription id (a UUID)", subscription)
		}
	}
	f := outbound.RedriveFilter{SubscriptionID: subID, AllSubscriptions: all, Limit: limit, DryRun: dryRun}
	switch sub {
	case "redrive":
		if (subID == uuid.Nil) == !all {
			return usageErr("webhooks redrive: give --subscription or --all-subscriptions (exactly one)")
		}
		if limit < 0 {
			return usageErr("--limit: must not be negative")
		}
		now := time.Now()
		if f.Since, err = parseWhen("--since", since, now); err != nil {
			return err
		}
		if f.Until, err = parseWhen("--until", until, now); err != nil {
			return err
		}
		if !f.Since.IsZero() && !f.Until.IsZero() && !f.Since.Before(f.Until) {
			return usageErr("--since must be before --until")
		}
	case "pause", "resume":
		if subID == uuid.Nil {
			return usageErr("webhooks %s: --subscription is required", sub)
		}
	}

	pool, err := db.connect(ctx, *timeout)
	if err != nil {
		return err
	}
	defer pool.Close()
	switch sub {
	case "status":
		ovs, err := store.Overviews(ctx, pool)
		if err != nil {
			return err
		}
		if *asJSON {
			return printSubscriptionsJSON(stdout, ovs)
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "SUBSCRIPTION\tURL\tSTATE\tBREAKER\tFAILURES\tPENDING\tIN-FLIGHT\tDEAD\tOLDEST-PENDING\tPAUSE-REASON")
		for _, o := range ovs {
			oldest := "-"
			if !o.OldestPending.IsZero() {
				oldest = o.OldestPending.UTC().Format(time.RFC3339)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%s\t%s\n", o.Subscription.ID, clip(outbound.RedactURL(o.Subscription.URL), 60), subscriptionState(o.Subscription),
				o.Breaker.State, o.Breaker.ConsecutiveFailures, o.Pending, o.Delivering, o.Dead, oldest, clip(o.Subscription.PausedReason, 60))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		_, err = fmt.Fprintf(stdout, "%d subscriptions\n", len(ovs))
		return err
	case "pause":
		if err := store.PauseSubscription(ctx, pool, subID, reason); err != nil {
			return notFoundAsUsage(err, subID)
		}
		if *asJSON {
			return printJSON(stdout, jsonDone{Action: "paused", ID: subID.String()})
		}
		_, err := fmt.Fprintf(stdout, "paused %s\n", subID)
		return err
	case "resume":
		if err := store.ResumeSubscription(ctx, pool, subID); err != nil {
			return notFoundAsUsage(err, subID)
		}
		if *asJSON {
			return printJSON(stdout, jsonDone{Action: "resumed", ID: subID.String()})
		}
		_, err := fmt.Fprintf(stdout, "resumed %s (breaker reset)\n", subID)
		return err
	}

	if subID != uuid.Nil { // a typo in the id should not look like "nothing to redrive"
		if _, err := store.GetSubscription(ctx, pool, subID); err != nil {
			return notFoundAsUsage(err, subID)
		}
	}
	ds, err := store.Redrive(ctx, pool, f)
	if err != nil {
		return err
	}
	if *asJSON {
		return printDeliveriesJSON(stdout, ds, dryRun)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "WEBHOOK-ID\tSUBSCRIPTION\tEVENT-ID\tEVENT-TYPE\tDIED\tATTEMPTS\tLAST-STATUS\tLAST-ERROR")
	for _, d := range ds {
		status := "-"
		if d.LastStatus != 0 {
			status = fmt.Sprint(d.LastStatus)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", d.WebhookID, d.SubscriptionID, clip(d.EventID, 40), d.EventType,
			d.DeadAt.UTC().Format(time.RFC3339), d.Attempts, status, clip(d.LastError, 60))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if dryRun {
		_, err = fmt.Fprintf(stdout, "%d dead deliveries would be redriven (dry run: nothing changed)\n", len(ds))
	} else {
		_, err = fmt.Fprintf(stdout, "%d dead deliveries redriven: pending now, attempts reset, same webhook-id\n", len(ds))
	}
	return err
}

func notFoundAsUsage(err error, id uuid.UUID) error {
	if errors.Is(err, outbound.ErrNotFound) {
		return usageErr("--subscription: no subscription %s", id)
	}
	return err
}

func subscriptionState(s outbound.Subscription) string {
	switch {
	case s.Disabled:
		return "disabled"
	case s.Paused():
		return "paused"
	}
	return "active"
}

// jsonSubscription is one row of webhooks status --json. The URL is
// redacted; the secrets are never shown.
type jsonSubscription struct {
	ID                  string     `json:"id"`
	URL                 string     `json:"url"`
	State               string     `json:"state"`
	EventTypes          []string   `json:"event_types"`
	Breaker             string     `json:"breaker"`
	ConsecutiveFailures int        `json:"consecutive_failures"`
	Pending             int64      `json:"pending"`
	InFlight            int64      `json:"in_flight"`
	Dead                int64      `json:"dead"`
	OldestPending       *time.Time `json:"oldest_pending"`
	PausedReason        string     `json:"paused_reason,omitempty"`
}

func printSubscriptionsJSON(w io.Writer, ovs []outbound.Overview) error {
	out := make([]jsonSubscription, 0, len(ovs))
	for _, o := range ovs {
		j := jsonSubscription{ID: o.Subscription.ID.String(), URL: outbound.RedactURL(o.Subscription.URL),
			State: subscriptionState(o.Subscription), EventTypes: o.Subscription.EventTypes, Breaker: string(o.Breaker.State),
			ConsecutiveFailures: o.Breaker.ConsecutiveFailures, Pending: o.Pending, InFlight: o.Delivering, Dead: o.Dead,
			PausedReason: o.Subscription.PausedReason}
		if !o.OldestPending.IsZero() {
			t := o.OldestPending.UTC()
			j.OldestPending = &t
		}
		if j.EventTypes == nil {
			j.EventTypes = []string{}
		}
		out = append(out, j)
	}
	return printJSON(w, out...)
}

// jsonDelivery is one row of webhooks redrive --json.
type jsonDelivery struct {
	Action         string    `json:"action"` // redriven or would_redrive
	WebhookID      string    `json:"webhook_id"`
	SubscriptionID string    `json:"subscription_id"`
	EventID        string    `json:"event_id"`
	EventType      string    `json:"event_type"`
	DiedAt         time.Time `json:"died_at"`
	Attempts       int       `json:"attempts"`
	LastStatus     int       `json:"last_status,omitempty"`
	LastError      string    `json:"last_error"`
}

func printDeliveriesJSON(w io.Writer, ds []outbound.Delivery, dryRun bool) error {
	action := "redriven"
	if dryRun {
		action = "would_redrive"
	}
	out := make([]jsonDelivery, 0, len(ds))
	for _, d := range ds {
		out = append(out, jsonDelivery{Action: action, WebhookID: d.WebhookID, SubscriptionID: d.SubscriptionID.String(),
			EventID: d.EventID, EventType: d.EventType, DiedAt: d.DeadAt.UTC(), Attempts: d.Attempts,
			LastStatus: d.LastStatus, LastError: d.LastError})
	}
	return printJSON(w, out...)
}
