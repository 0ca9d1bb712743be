package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/oncely/oncely/outbox"
)

func outboxCmd(ctx context.Context, sub string, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("outbox "+sub, flag.ContinueOnError)
	var db dbFlags
	db.register(fs)
	timeout := fs.Duration("timeout", 15*time.Second, "how long to wait for Postgres")
	if err := parse(fs, args, stderr); err != nil {
		return err
	}
	if sub != "status" {
		return usageErr("outbox: unknown subcommand %q (want status)", sub)
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
	st, err := o.Status(ctx, pool)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "pending\t%d\noldest_pending_seconds\t%.3f\nsent_retained\t%d\n", st.Pending, st.OldestPending.Seconds(), st.Sent)
	return nil
}
