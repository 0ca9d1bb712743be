package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/internal/kafkaflags"
	"github.com/oncely/oncely/migrations"
)

// dbFlags are the flags of commands that talk to Postgres.
type dbFlags struct {
	url, schema string
	fs          *flag.FlagSet
}

func (d *dbFlags) register(fs *flag.FlagSet) {
	d.fs = fs
	// No default from the environment: -h would print it, password included.
	fs.StringVar(&d.url, "database-url", "", "Postgres connection string (env DATABASE_URL)")
	fs.StringVar(&d.schema, "schema", "oncely", "schema of oncely's tables")
}

func (d *dbFlags) connect(ctx context.Context, timeout time.Duration) (*pgxpool.Pool, error) {
	if d.url == "" && d.fs != nil && !kafkaflags.Given(d.fs, "database-url") {
		d.url = os.Getenv("DATABASE_URL")
	}
	if d.url == "" {
		return nil, usageErr("--database-url: required (or set DATABASE_URL)")
	}
	cfg, err := pgxpool.ParseConfig(d.url)
	if err != nil {
		return nil, usageErr("--database-url: %v", err)
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to Postgres: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("cannot reach Postgres at %s:%d within %s: %w", cfg.ConnConfig.Host, cfg.ConnConfig.Port, timeout, err)
	}
	return pool, nil
}

func migrateCmd(ctx context.Context, sub string, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("migrate "+sub, flag.ContinueOnError)
	var db dbFlags
	db.register(fs)
	to := fs.Int("to", 0, "down: revert every migration above this version (0: all)")
	asJSON := jsonFlag(fs)
	timeout := fs.Duration("timeout", 15*time.Second, "how long to wait for Postgres")
	if err := parse(fs, args, stderr); err != nil {
		return err
	}
	if sub != "up" && sub != "down" && sub != "status" {
		return usageErr("migrate: unknown subcommand %q (want up, down or status)", sub)
	}
	if *to < 0 {
		return usageErr("--to: must not be negative")
	}
	pool, err := db.connect(ctx, *timeout)
	if err != nil {
		return err
	}
	defer pool.Close()
	m, err := migrations.New(pool, migrations.Config{Schema: db.schema})
	if err != nil {
		return usageErr("--schema: %v", err)
	}
	switch sub {
	case "up", "down":
		var done []migrations.Migration
		action := "applied"
		if sub == "up" {
			done, err = m.Up(ctx)
		} else {
			done, err = m.Down(ctx, *to)
			action = "reverted"
		}
		if err != nil {
			return err
		}
		if *asJSON {
			out := make([]jsonMigration, 0, len(done))
			for _, mig := range done {
				out = append(out, jsonMigration{Action: action, Version: mig.Version, Name: mig.Name})
			}
			return printJSON(stdout, out...)
		}
		if len(done) == 0 && sub == "up" {
			fmt.Fprintf(stdout, "schema %s is up to date\n", db.schema)
		}
		for _, mig := range done {
			fmt.Fprintf(stdout, "%s %04d_%s\n", action, mig.Version, mig.Name)
		}
	case "status":
		st, err := m.Status(ctx)
		if err != nil {
			return err
		}
		if *asJSON {
			out := make([]jsonMigrationStatus, 0, len(st))
			for _, s := range st {
				j := jsonMigrationStatus{Version: s.Version, Name: s.Name, Applied: s.Applied}
				if s.Applied {
					at := s.AppliedAt.UTC()
					j.AppliedAt = &at
				}
				out = append(out, j)
			}
			return printJSON(stdout, out...)
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "VERSION\tNAME\tAPPLIED")
		for _, s := range st {
			applied := "no"
			if s.Applied {
				applied = s.AppliedAt.UTC().Format(time.RFC3339)
			}
			fmt.Fprintf(tw, "%04d\t%s\t%s\n", s.Version, s.Name, applied)
		}
		return tw.Flush()
	}
	return nil
}

type jsonMigration struct {
	Action  string `json:"action"` // applied or reverted
	Version int    `json:"version"`
	Name    string `json:"name"`
}

type jsonMigrationStatus struct {
	Version   int        `json:"version"`
	Name      string     `json:"name"`
	Applied   bool       `json:"applied"`
	AppliedAt *time.Time `json:"applied_at"` // null when not applied
}
