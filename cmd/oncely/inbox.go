package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/internal/kafkaflags"
	"github.com/oncely/oncely/internal/sqlident"
)

// retentionEnv gives the inbox cleaner's retention to "inbox retention"
// when --retention is not set.
const retentionEnv = "ONCELY_INBOX_RETENTION"

// inboxCmd runs the inbox subcommands:
//
//	oncely inbox count     [--group G]
//	oncely inbox get       MESSAGE-ID [--group G]
//	oncely inbox retention --retention D [--group G]
//
// Counts are exact (count(*)), and every age is database time, as the
// cleaner's.
func inboxCmd(ctx context.Context, sub string, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("inbox "+sub, flag.ContinueOnError)
	var db dbFlags
	db.register(fs)
	timeout := fs.Duration("timeout", 15*time.Second, "how long to wait for Postgres")
	asJSON := jsonFlag(fs)
	group := fs.String("group", "", "only this consumer group (default: all)")
	var retention time.Duration
	switch sub {
	case "count", "get":
	case "retention":
		fs.DurationVar(&retention, "retention", 0, "the cleaner's retention (dedup.CleanerConfig.Retention), e.g. 168h (env "+retentionEnv+")")
	default:
		return usageErr("inbox: unknown subcommand %q (want count, get or retention)", sub)
	}
	pos, err := parseArgs(fs, args, stderr)
	if err != nil {
		return err
	}
	var messageID string
	switch {
	case sub == "get" && len(pos) != 1:
		return usageErr("inbox get: name exactly one message id, got %d arguments", len(pos))
	case sub == "get":
		messageID = pos[0]
	case len(pos) > 0:
		return usageErr("inbox %s: unexpected arguments %q", sub, pos)
	}
	if sub == "retention" {
		if retention, err = retentionFlag(fs, retention); err != nil {
			return err
		}
	}
	if _, err := dedup.New(dedup.Config{Schema: db.schema}); err != nil {
		return usageErr("--schema: %v", err)
	}
	table := sqlident.Table(db.schema, "inbox")
	pool, err := db.connect(ctx, *timeout)
	if err != nil {
		return err
	}
	defer pool.Close()
	switch sub {
	case "count":
		return inboxCount(ctx, pool, table, *group, *asJSON, stdout)
	case "get":
		return inboxGet(ctx, pool, table, *group, messageID, *asJSON, stdout)
	default:
		return inboxRetention(ctx, pool, table, *group, retention, *asJSON, stdout)
	}
}

// retentionFlag returns --retention, or the environment's, checked as the
// cleaner checks it.
func retentionFlag(fs *flag.FlagSet, flagValue time.Duration) (time.Duration, error) {
	r := flagValue
	if v := os.Getenv(retentionEnv); !kafkaflags.Given(fs, "retention") && v != "" {
		var err error
		if r, err = time.ParseDuration(v); err != nil {
			return 0, usageErr("%s: %q is not a duration", retentionEnv, v)
		}
	}
	switch {
	case r == 0:
		return 0, usageErr("--retention: required (or set %s): the retention of the inbox cleaner", retentionEnv)
	case r < dedup.MinRetention:
		return 0, usageErr("--retention: %s is below the minimum %s that the cleaner accepts", r, dedup.MinRetention)
	}
	return r, nil
}

// jsonGroupCount is the inbox rows of one group (or of all: the total).
type jsonGroupCount struct {
	Group        string `json:"group,omitempty"`
	Processed    int64  `json:"processed"`
	DeadLettered int64  `json:"dead_lettered"`
	Total        int64  `json:"total"`
}

// jsonInboxCount is inbox count --json: one object.
type jsonInboxCount struct {
	Total  jsonGroupCount   `json:"total"`
	Groups []jsonGroupCount `json:"groups"`
}

func inboxCount(ctx context.Context, pool *pgxpool.Pool, table, group string, asJSON bool, w io.Writer) error {
	rows, err := pool.Query(ctx, `SELECT consumer_group,
			count(*) FILTER (WHERE outcome = 'processed'), count(*) FILTER (WHERE outcome = 'dead_lettered'), count(*)
		FROM `+table+` WHERE ($1 = '' OR consumer_group = $1) GROUP BY consumer_group ORDER BY consumer_group`, group)
	if err != nil {
		return fmt.Errorf("count inbox rows: %w", err)
	}
	out := jsonInboxCount{Groups: []jsonGroupCount{}}
	var g jsonGroupCount
	if _, err := pgx.ForEachRow(rows, []any{&g.Group, &g.Processed, &g.DeadLettered, &g.Total}, func() error {
		out.Groups = append(out.Groups, g)
		out.Total.Processed += g.Processed
		out.Total.DeadLettered += g.DeadLettered
		out.Total.Total += g.Total
		return nil
	}); err != nil {
		return fmt.Errorf("count inbox rows: %w", err)
	}
	if asJSON {
		return printJSON(w, out)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "GROUP\tPROCESSED\tDEAD-LETTERED\tTOTAL")
	for _, g := range out.Groups {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\n", g.Group, g.Processed, g.DeadLettered, g.Total)
	}
	fmt.Fprintf(tw, "(all %d groups)\t%d\t%d\t%d\n", len(out.Groups), out.Total.Processed, out.Total.DeadLettered, out.Total.Total)
	return tw.Flush()
}

// jsonInboxRow is one inbox row in --json output. Topic, partition and
// offset are null when the row does not record them (a row claimed
// without them).
type jsonInboxRow struct {
	Group     string    `json:"group"`
	MessageID string    `json:"message_id"`
	Outcome   string    `json:"outcome"` // processed or dead_lettered
	At        time.Time `json:"at"`      // when it was processed or dead-lettered (database time)
	Topic     *string   `json:"topic"`
	Partition *int32    `json:"partition"`
	Offset    *int64    `json:"offset"`
}

func inboxGet(ctx context.Context, pool *pgxpool.Pool, table, group, messageID string, asJSON bool, w io.Writer) error {
	rows, err := pool.Query(ctx, `SELECT consumer_group, message_id, outcome, processed_at, topic, partition, "offset"
		FROM `+table+` WHERE message_id = $1 AND ($2 = '' OR consumer_group = $2) ORDER BY consumer_group`, messageID, group)
	if err != nil {
		return fmt.Errorf("look up %q in the inbox: %w", messageID, err)
	}
	var out []jsonInboxRow
	var r jsonInboxRow
	var topic string
	var partition int32
	var offset int64
	if _, err := pgx.ForEachRow(rows, []any{&r.Group, &r.MessageID, &r.Outcome, &r.At, &topic, &partition, &offset}, func() error {
		row := r
		row.At = row.At.UTC()
		if topic != "" {
			t := topic
			row.Topic = &t
		}
		if partition >= 0 {
			p := partition
			row.Partition = &p
		}
		if offset >= 0 {
			o := offset
			row.Offset = &o
		}
		out = append(out, row)
		return nil
	}); err != nil {
		return fmt.Errorf("look up %q in the inbox: %w", messageID, err)
	}
	if len(out) == 0 {
		in := "any group"
		if group != "" {
			in = "group " + group
		}
		return errNotFound{fmt.Sprintf("inbox: message id %q is not in the inbox of %s (never finished, or deleted by retention)", messageID, in)}
	}
	if asJSON {
		return printJSON(w, out...)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "GROUP\tMESSAGE-ID\tOUTCOME\tAT\tSOURCE")
	for _, r := range out {
		source := "-"
		if r.Topic != nil {
			source = *r.Topic
			if r.Partition != nil && r.Offset != nil {
				source = fmt.Sprintf("%s/%d/%d", *r.Topic, *r.Partition, *r.Offset)
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", r.Group, r.MessageID, r.Outcome, r.At.Format(time.RFC3339Nano), source)
	}
	return tw.Flush()
}

// errNotFound is a lookup that found nothing (exit status 1).
type errNotFound struct{ msg string }

func (e errNotFound) Error() string { return e.msg }

// jsonInboxRetention is inbox retention --json: one object.
type jsonInboxRetention struct {
	Now              time.Time        `json:"now"` // database time
	RetentionSeconds float64          `json:"retention_seconds"`
	Horizon          time.Time        `json:"horizon"` // rows processed before it are deleted by the cleaner
	Oldest           *jsonInboxRow    `json:"oldest"`  // null when the inbox is empty
	OldestAgeSeconds *float64         `json:"oldest_age_seconds"`
	Expired          int64            `json:"expired"` // rows beyond the horizon, all groups selected
	ExpiredByGroup   []jsonGroupCount `json:"expired_by_group"`
}

func inboxRetention(ctx context.Context, pool *pgxpool.Pool, table, group string, retention time.Duration, asJSON bool, w io.Writer) error {
	out := jsonInboxRetention{RetentionSeconds: retention.Seconds(), ExpiredByGroup: []jsonGroupCount{}}
	// The cleaner's own predicate: processed_at < now() - retention.
	if err := pool.QueryRow(ctx, `SELECT now(), now() - make_interval(secs => $1)`, retention.Seconds()).Scan(&out.Now, &out.Horizon); err != nil {
		return fmt.Errorf("read the database clock: %w", err)
	}
	var oldest jsonInboxRow
	err := pool.QueryRow(ctx, `SELECT consumer_group, message_id, outcome, processed_at FROM `+table+`
		WHERE ($1 = '' OR consumer_group = $1) ORDER BY processed_at LIMIT 1`, group).
		Scan(&oldest.Group, &oldest.MessageID, &oldest.Outcome, &oldest.At)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return fmt.Errorf("find the oldest inbox row: %w", err)
	default:
		oldest.At = oldest.At.UTC()
		age := out.Now.Sub(oldest.At).Seconds()
		out.Oldest, out.OldestAgeSeconds = &oldest, &age
	}
	rows, err := pool.Query(ctx, `SELECT consumer_group, count(*) FILTER (WHERE outcome = 'processed'),
			count(*) FILTER (WHERE outcome = 'dead_lettered'), count(*)
		FROM `+table+` WHERE processed_at < $1 AND ($2 = '' OR consumer_group = $2)
		GROUP BY consumer_group ORDER BY consumer_group`, out.Horizon, group)
	if err != nil {
		return fmt.Errorf("count expired inbox rows: %w", err)
	}
	var g jsonGroupCount
	if _, err := pgx.ForEachRow(rows, []any{&g.Group, &g.Processed, &g.DeadLettered, &g.Total}, func() error {
		out.ExpiredByGroup = append(out.ExpiredByGroup, g)
		out.Expired += g.Total
		return nil
	}); err != nil {
		return fmt.Errorf("count expired inbox rows: %w", err)
	}
	out.Now, out.Horizon = out.Now.UTC(), out.Horizon.UTC()
	if asJSON {
		return printJSON(w, out)
	}
	fmt.Fprintf(w, "retention\t%s\nhorizon\t%s (rows processed before it are deleted by the cleaner's next pass)\n",
		retention, out.Horizon.Format(time.RFC3339))
	if out.Oldest == nil {
		fmt.Fprintln(w, "oldest\t- (no rows)")
	} else {
		fmt.Fprintf(w, "oldest\t%s, %s ago (group %s, message id %s)\n", out.Oldest.At.Format(time.RFC3339),
			time.Duration(*out.OldestAgeSeconds*float64(time.Second)).Round(time.Second), out.Oldest.Group, out.Oldest.MessageID)
	}
	fmt.Fprintf(w, "expired\t%d\n", out.Expired)
	for _, g := range out.ExpiredByGroup {
		fmt.Fprintf(w, "expired\t%d\tgroup %s\n", g.Total, g.Group)
	}
	return nil
}
