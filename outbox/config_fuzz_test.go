package outbox_test

import (
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/outbox"
)

// relayInvalidFields is the test's own reading of RelayConfig's documented
// rules: the fields New must refuse (Outbox.* for the embedded Config).
func relayInvalidFields(cfg outbox.RelayConfig) map[string]bool {
	bad := map[string]bool{}
	bad["Outbox.Schema"] = cfg.Outbox.Schema != "" && !pgtest.SchemaNameValid(cfg.Outbox.Schema)
	if cfg.Outbox.Shards < 0 || cfg.Outbox.Shards > 1<<16 {
		bad["Outbox.Shards"] = true
	}
	if cfg.Pool == nil {
		bad["Pool"] = true
	}
	if len(cfg.Brokers) == 0 || slices.Contains(cfg.Brokers, "") {
		bad["Brokers"] = true
	}
	if cfg.ProduceTimeout != 0 && cfg.ProduceTimeout < time.Second {
		bad["ProduceTimeout"] = true
	}
	for name, neg := range map[string]bool{
		"BatchSize": cfg.BatchSize < 0, "PollInterval": cfg.PollInterval < 0, "NotifyDebounce": cfg.NotifyDebounce < 0,
		"Retention": cfg.Retention < 0, "CleanupInterval": cfg.CleanupInterval < 0, "CleanupBatch": cfg.CleanupBatch < 0,
		"RetryBaseDelay": cfg.RetryBaseDelay < 0, "RetryMaxDelay": cfg.RetryMaxDelay < 0,
	} {
		if neg {
			bad[name] = true
		}
	}
	base, maxDelay := cfg.RetryBaseDelay, cfg.RetryMaxDelay
	if base == 0 {
		base = 100 * time.Millisecond
	}
	if maxDelay == 0 {
		maxDelay = 10 * time.Second
	}
	if maxDelay < base {
		bad["RetryMaxDelay"] = true
	}
	return bad
}

// relayErrorFieldRE finds the field a configuration error names.
var relayErrorFieldRE = regexp.MustCompile(`^outbox: (Config|RelayConfig)\.([A-Za-z]+):`)

// FuzzRelayConfig: NewRelay never panics; it accepts a config exactly when
// every field is valid, and a refusal names a field that is invalid. Schema
// names with quotes, semicolons or spaces are always refused.
func FuzzRelayConfig(f *testing.F) {
	pool := pgtest.UnreachablePool(f)
	f.Add("", 0, "127.0.0.1:9092", int64(0), int64(0), int64(0), 0, true, uint32(0))
	f.Add("oncely", 64, "a,b", int64(time.Second), int64(time.Millisecond), int64(time.Hour), 500, true, uint32(0))
	f.Add(`x"; drop table y`, -1, "a,", int64(time.Millisecond), int64(-1), int64(-time.Hour), -1, false, uint32(1))
	f.Add("pg_temp", 1<<16+1, "", int64(-time.Second), int64(time.Minute), int64(0), 1, true, uint32(1<<9))
	for i := range 10 { // a valid config with one field negative
		f.Add("oncely", 1, "a", int64(time.Second), int64(time.Millisecond), int64(time.Hour), 5, true, uint32(1)<<i)
	}
	f.Fuzz(func(t *testing.T, schema string, shards int, brokers string, produce, delay, retention int64, batch int, withPool bool, negate uint32) {
		d := func(i int, v int64) time.Duration { return time.Duration(pgtest.Signed(negate, i, v)) }
		cfg := outbox.RelayConfig{
			Outbox:    outbox.Config{Schema: schema, Shards: pgtest.Signed(negate, 9, shards)},
			BatchSize: pgtest.Signed(negate, 0, batch), CleanupBatch: pgtest.Signed(negate, 1, batch*2),
			PollInterval: d(2, delay), NotifyDebounce: d(3, delay/100),
			RetryBaseDelay: d(4, delay), RetryMaxDelay: d(5, retention),
			Retention: d(6, retention), CleanupInterval: d(7, retention/10), ProduceTimeout: d(8, produce),
		}
		if brokers != "" {
			cfg.Brokers = strings.Split(brokers, ",")
		}
		if withPool {
			cfg.Pool = pool
		}
		r, err := outbox.NewRelay(cfg)
		if err == nil && (r == nil || strings.ContainsAny(schema, "\"'; \\")) {
			t.Fatalf("NewRelay accepted the schema name %q, or returned nothing", schema)
		}
		pgtest.CheckConfigError(t, err, relayInvalidFields(cfg), func(msg string) (string, bool) {
			m := relayErrorFieldRE.FindStringSubmatch(msg)
			if m == nil {
				return "", false
			}
			if m[1] == "Config" {
				return "Outbox." + m[2], true
			}
			return m[2], true
		})
	})
}
