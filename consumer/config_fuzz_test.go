package consumer_test

import (
	"context"
	"errors"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/pgtest"
)

// invalidFields is the test's own reading of Config's documented rules: the
// fields of cfg (zero values meaning their defaults) that New must refuse.
func invalidFields(cfg consumer.Config) map[string]bool {
	bad := map[string]bool{}
	or := func(d, def time.Duration) time.Duration {
		if d == 0 {
			return def
		}
		return d
	}
	emptyOrHasEmpty := func(xs []string) bool { return len(xs) == 0 || slices.Contains(xs, "") }
	bad["Brokers"] = emptyOrHasEmpty(cfg.Brokers)
	bad["Topics"] = emptyOrHasEmpty(cfg.Topics)
	bad["Group"] = cfg.Group == ""
	bad["Pool"] = cfg.Pool == nil
	bad["Handler"] = cfg.Handler == nil
	bad["Schema"] = cfg.Schema != "" && !pgtest.SchemaNameValid(cfg.Schema)
	for name, d := range map[string]time.Duration{
		"SessionTimeout": cfg.SessionTimeout, "RebalanceTimeout": cfg.RebalanceTimeout,
		"RetryBaseDelay": cfg.RetryBaseDelay, "RetryMaxDelay": cfg.RetryMaxDelay,
		"CommitInterval": cfg.CommitInterval, "RevokeTimeout": cfg.RevokeTimeout,
		"ShutdownTimeout": cfg.ShutdownTimeout, "DeadLetterTimeout": cfg.DeadLetterTimeout,
	} {
		bad[name] = d < 0
	}
	bad["RetryMaxDelay"] = bad["RetryMaxDelay"] || or(cfg.RetryMaxDelay, 10*time.Second) < or(cfg.RetryBaseDelay, 100*time.Millisecond)
	bad["DeadLetterTimeout"] = bad["DeadLetterTimeout"] || or(cfg.DeadLetterTimeout, 10*time.Second) < time.Second
	bad["MaxAttempts"] = cfg.MaxAttempts < 0
	bad["MaxRecordBytes"] = cfg.MaxRecordBytes < 0
	bad["MaxBufferedRecords"] = cfg.MaxBufferedRecords < 0
	bad["MaxPollRecords"] = cfg.MaxPollRecords < 0
	if cfg.DeadLetterTopic != nil {
		for _, t := range cfg.Topics {
			if d := cfg.DeadLetterTopic(t); d == "" || d == t {
				bad["DeadLetterTopic"] = true
			}
		}
	}
	return bad
}

// errorFieldRE finds the field an invalid-config error names: the text
// after "consumer: invalid config: " up to the next colon.
var errorFieldRE = regexp.MustCompile(`^consumer: invalid config: ([A-Za-z]+):`)

// FuzzConfig: New never panics; it accepts a config exactly when every field
// is valid, and a refusal wraps ErrInvalidConfig and names a field that is
// invalid. Schema names with quotes, semicolons or spaces are always refused.
func FuzzConfig(f *testing.F) {
	pool := pgtest.UnreachablePool(f)
	handler := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }

	f.Add("127.0.0.1:9092", "orders", "g", "", ".dlq", int64(0), int64(0), int64(0), 0, 0, 0, true, uint32(0))
	f.Add("a,b", "orders,payments", "g", "oncely", "", int64(-1), int64(time.Second), int64(time.Millisecond), 3, 1, 5, true, uint32(0))
	f.Add("a", "t", "g", `x"; drop table y`, "-dead", int64(0), int64(0), int64(0), 0, 0, 0, false, uint32(0))
	f.Add("a,", "t", "", "pg_catalog", ".dlq", int64(time.Hour), int64(time.Minute), int64(500*time.Millisecond), -1, -1, -1, true, uint32(0))
	f.Add("", "", "g", "Oncely", ".dlq", int64(0), int64(time.Nanosecond), int64(time.Second), 1<<30, 0, 0, true, uint32(0))
	for i := range 12 { // a valid config with one field negative
		f.Add("a", "t", "g", "s", ".dlq", int64(time.Minute), int64(time.Millisecond), int64(time.Second), 1, 1, 2, true, uint32(1)<<i)
	}
	f.Fuzz(func(t *testing.T, brokers, topics, group, schema, dlqSuffix string,
		timeout, base, dlTimeout int64, attempts, recordBytes, buffered int, withPool bool, negate uint32) {
		d := func(i int, v int64) time.Duration { return time.Duration(pgtest.Signed(negate, i, v)) }
		cfg := consumer.Config{
			Group: group, Schema: schema, Handler: handler,
			SessionTimeout: d(0, timeout), RebalanceTimeout: d(1, timeout*3),
			RevokeTimeout: d(2, timeout/2), ShutdownTimeout: d(3, timeout+1), CommitInterval: d(4, base*10),
			RetryBaseDelay: d(5, base), RetryMaxDelay: d(6, timeout), DeadLetterTimeout: d(7, dlTimeout),
			MaxAttempts: pgtest.Signed(negate, 8, attempts), MaxRecordBytes: pgtest.Signed(negate, 9, recordBytes),
			MaxBufferedRecords: pgtest.Signed(negate, 10, buffered), MaxPollRecords: pgtest.Signed(negate, 11, buffered/2),
			DeadLetterTopic: func(t string) string { return t + dlqSuffix },
		}
		if brokers != "" {
			cfg.Brokers = strings.Split(brokers, ",")
		}
		if topics != "" {
			cfg.Topics = strings.Split(topics, ",")
		}
		if withPool {
			cfg.Pool = pool
		}
		c, err := consumer.New(cfg)
		if err == nil && strings.ContainsAny(schema, "\"'; \\") {
			t.Fatalf("New accepted the schema name %q", schema)
		}
		if err == nil && c == nil {
			t.Fatal("New returned neither a consumer nor an error")
		}
		if err != nil && !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Fatalf("error %q does not wrap ErrInvalidConfig", err)
		}
		pgtest.CheckConfigError(t, err, invalidFields(cfg), pgtest.FieldMatch(errorFieldRE))
	})
}
