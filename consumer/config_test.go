package consumer_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/consumer"
)

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()
	// pgxpool connects lazily: no server is needed to validate a config.
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	handler := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }
	valid := func() consumer.Config {
		return consumer.Config{Brokers: []string{"127.0.0.1:9092"}, Topics: []string{"orders"}, Group: "g", Pool: pool, Handler: handler}
	}
	if _, err := consumer.New(valid()); err != nil {
		t.Fatalf("valid config refused: %v", err)
	}
	for _, limit := range []int{-1, 0, 1, 100} { // -1: off; 0: the default
		cfg := valid()
		cfg.CrashLoopLimit = limit
		if _, err := consumer.New(cfg); err != nil {
			t.Errorf("CrashLoopLimit %d refused: %v", limit, err)
		}
	}
	for _, tc := range []struct {
		name   string
		mutate func(*consumer.Config)
		field  string
	}{
		{"missing group", func(c *consumer.Config) { c.Group = "" }, "Group"},
		{"no topics", func(c *consumer.Config) { c.Topics = nil }, "Topics"},
		{"empty topic", func(c *consumer.Config) { c.Topics = []string{"orders", ""} }, "Topics"},
		{"no brokers", func(c *consumer.Config) { c.Brokers = nil }, "Brokers"},
		{"no pool", func(c *consumer.Config) { c.Pool = nil }, "Pool"},
		{"no handler", func(c *consumer.Config) { c.Handler = nil }, "Handler"},
		{"injected schema", func(c *consumer.Config) { c.Schema = `x"; drop table y` }, "Schema"},
		{"upper-case schema", func(c *consumer.Config) { c.Schema = "Oncely" }, "Schema"},
		{"negative attempts", func(c *consumer.Config) { c.MaxAttempts = -1 }, "MaxAttempts"},
		{"negative timeout", func(c *consumer.Config) { c.SessionTimeout = -time.Second }, "SessionTimeout"},
		{"negative fetch wait", func(c *consumer.Config) { c.FetchMaxWait = -time.Millisecond }, "FetchMaxWait"},
		{"negative group concurrency", func(c *consumer.Config) { c.GroupConcurrency = -1 }, "GroupConcurrency"},
		{"short dead-letter timeout", func(c *consumer.Config) { c.DeadLetterTimeout = 100 * time.Millisecond }, "DeadLetterTimeout"},
		{"dead-letter topic is the source", func(c *consumer.Config) { c.DeadLetterTopic = func(t string) string { return t } }, "DeadLetterTopic"},
		{"negative record limit", func(c *consumer.Config) { c.MaxRecordBytes = -1 }, "MaxRecordBytes"},
		{"crash-loop limit below -1", func(c *consumer.Config) { c.CrashLoopLimit = -2 }, "CrashLoopLimit"},
		{"cap below base", func(c *consumer.Config) { c.RetryBaseDelay, c.RetryMaxDelay = time.Second, time.Millisecond }, "RetryMaxDelay"},
		{"unknown start offset", func(c *consumer.Config) { c.StartOffset = "newest" }, "StartOffset"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := valid()
			tc.mutate(&cfg)
			c, err := consumer.New(cfg)
			if err == nil {
				t.Fatalf("New accepted the config: %+v", c)
			}
			if !errors.Is(err, consumer.ErrInvalidConfig) {
				t.Errorf("error %q does not wrap ErrInvalidConfig", err)
			}
			if !strings.Contains(err.Error(), tc.field) {
				t.Errorf("error %q does not name the field %s", err, tc.field)
			}
		})
	}
}
