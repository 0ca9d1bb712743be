package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/consumer"
)

// runBatchMode runs the modes built on consumer.Config's batch and per-key
// options.
func (e *env) runBatchMode(ctx context.Context, m string) result {
	o := e.opts
	switch m {
	case modeBatch, modeBatchRecs:
		name, n, note := "oncely batch", o.batchN, "BatchSize "+strconv.Itoa(o.batchSize)+", BatchHandler: multi-row effect insert"
		if m == modeBatchRecs {
			name, n, note = "oncely batch, Handler", o.batchRecsN, "BatchSize "+strconv.Itoa(o.batchSize)+", per-record Handler under a savepoint"
		}
		r := e.runKafka(ctx, kafkaMode{name: name, inbox: true, conns: int32(o.conns),
			w:              workload{records: n, keys: o.keys, partitions: int32(o.partitions)},
			latencyRecords: o.latencyRecords, latencyRate: o.latencyRate,
			run: func(ctx context.Context, k kafkaRun) error {
				cfg := batchConfig(k, o.batchSize)
				if m == modeBatchRecs {
					cfg.BatchHandler = nil // Handler runs per record, each under a savepoint
				}
				return runOncely(ctx, cfg)
			},
		})
		r.note = note
		return r
	case modeKeySeq, modeKeyPar:
		conns := e.keyConns(ctx)
		par, name, n := conns, "oncely per-key parallel", o.keyN
		if m == modeKeySeq {
			par, name, n = 1, "oncely per-partition sequential", o.keySeqN
		}
		r := e.runKafka(ctx, kafkaMode{name: name, inbox: true, conns: int32(conns),
			w:              workload{records: n, keys: 100, partitions: 1},
			latencyRecords: o.keyLatencyRecords(), latencyRate: o.keyLatencyRate,
			run: func(ctx context.Context, k kafkaRun) error {
				cfg := oncelyConfig(k)
				effect := cfg.Handler
				cfg.Handler = func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
					time.Sleep(o.keySleep)
					return effect(ctx, tx, msg)
				}
				cfg.KeyParallelism = par
				return runOncely(ctx, cfg)
			},
		})
		r.note = "KeyParallelism " + strconv.Itoa(par) + ", " + o.keySleep.String() + " handler, 100 keys, 1 partition"
		return r
	case modeRSS:
		r := e.runKafka(ctx, kafkaMode{name: "oncely batch, RSS", inbox: true, conns: int32(o.conns),
			w:              workload{records: o.rssN, keys: o.keys, partitions: int32(o.partitions)},
			latencyRecords: o.latencyRecords, latencyRate: o.latencyRate,
			run:    func(ctx context.Context, k kafkaRun) error { return runOncely(ctx, batchConfig(k, o.batchSize)) },
			sample: sampleRSS(100 * time.Millisecond),
		})
		if r.rss != nil {
			r.note = rssNote(r.rss)
		}
		return r
	}
	panic("unknown mode " + m)
}

// keyConns is the per-key modes' pool size and parallelism: -key-parallelism,
// or less when the server has not that many connections free (others use it
// too), keeping ten for them.
func (e *env) keyConns(ctx context.Context) int {
	want := e.opts.keyParallelism
	var free int
	err := e.admin.QueryRow(ctx, `SELECT current_setting('max_connections')::int - count(*) FROM pg_stat_activity`).Scan(&free)
	if err != nil || free-10 >= want {
		return want
	}
	n := max(free-10, 2)
	fmt.Fprintf(os.Stderr, "\nbench: only %d Postgres connections free; per-key modes use %d, not %d\n", free, n, want)
	return n
}

// batchConfig is oncely in batch mode with a BatchHandler that inserts the
// batch's effects in one statement.
func batchConfig(k kafkaRun, size int) consumer.Config {
	cfg := oncelyConfig(k)
	cfg.BatchSize = size
	cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
		items := make([]item, len(msgs))
		for i, msg := range msgs {
			var err error
			if items[i], err = itemOf(msg.ID, msg.Record); err != nil {
				return err
			}
		}
		return k.db.applyEffects(ctx, tx, items)
	}
	return cfg
}
