package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/ratelog"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/internal/telemetry"
)

// Handler processes one message inside tx, the transaction whose first
// statement claimed the message's id in the inbox. Its writes commit together
// with that claim. It runs only for messages not processed before.
//
// A nil return commits the transaction. An error (or a panic) rolls it back
// and the message is retried with backoff, then dead-lettered; an error
// wrapped with dlq.Permanent or dlq.Undecodable is dead-lettered at once. Handlers must do their work through
// tx; effects outside the database (an HTTP call, an email) are not covered by
// the exactly-once guarantee and should go through an outbox.
type Handler func(ctx context.Context, tx pgx.Tx, msg *Message) error

// BatchHandler processes the new messages of one batch inside tx, the
// transaction whose first statement claimed all of the batch's ids in the
// inbox (see Config.BatchSize). msgs holds only messages not processed
// before, in offset order; it is never empty. A nil return commits them all
// together. An error (or a panic) rolls the whole batch back; each of its
// records is then retried alone on the record path, through Handler when it
// is set and otherwise through BatchHandler with a one-message batch.
type BatchHandler func(ctx context.Context, tx pgx.Tx, msgs []*Message) error

// KeyFunc derives a record's dedup id. An error, or an empty id, makes the
// record undecodable: it is dead-lettered at once.
type KeyFunc func(rec *kgo.Record) (string, error)

// DefaultMessageIDHeader is the record header that carries a message's
// stable id (set by oncely's outbox, and by producers that follow it).
const DefaultMessageIDHeader = "message-id"

// MaxMessageIDLen bounds a dedup id in bytes.
const MaxMessageIDLen = 1024

// Config configures a Consumer. Zero values take the documented defaults.
type Config struct {
	// Brokers are the seed brokers. Required.
	Brokers []string
	// Topics to consume. Required.
	Topics []string
	// Group is the consumer group; it is also the dedup scope: two groups
	// process the same message independently. Required.
	Group string
	// Pool runs the transactions. Required.
	Pool *pgxpool.Pool
	// Handler processes new messages. Required unless BatchHandler is set.
	Handler Handler

	// BatchSize above 1 turns on batch mode: up to BatchSize records of a
	// partition share one transaction. Their ids are claimed in the inbox
	// with one multi-row statement; with Handler, each new record runs under
	// a savepoint of its own, so a failing record rolls back alone and is
	// retried (or dead-lettered) on the record path after the batch
	// committed, without redoing the others; later records with the same key
	// wait for it, keeping per-key order. Default 1: a transaction per record.
	BatchSize int
	// BatchMaxWait is how long a batch may wait for more records of its
	// partition once it has one; it never waits when the partition has no
	// more records to fetch. Default 5ms.
	BatchMaxWait time.Duration
	// BatchHandler, when set with BatchSize above 1, receives all new
	// records of a batch at once instead of Handler running per record.
	BatchHandler BatchHandler

	// KeyParallelism above 1 processes records of one partition that have
	// different keys concurrently, up to KeyParallelism at a time; records
	// with the same key (and all records without a key, as one key) stay in
	// offset order. The committed offset is the low watermark: the offset
	// below which every record finished. It pays off for handlers that wait
	// (on I/O, locks, remote calls) rather than for cheap ones, whose cost is
	// the commit: use BatchSize for those. The two cannot be combined.
	// Default 1: a partition's records one after another.
	KeyParallelism int
	// ConflictKeys names the rows a message's handler will write that other
	// messages' handlers may write too: the customer whose balance an order
	// updates, say, when orders are keyed by order id. Before any handler
	// runs, a transaction takes one advisory lock per key (pg_advisory_xact_lock
	// of a hash of it), all in ascending order and in the round trip that
	// begins it; a batch takes the keys of all its records at once.
	// Transactions that share a key, of this member or any other, then take
	// turns instead of deadlocking: Postgres never has a cycle to break,
	// whatever order the handlers write their rows in. Those of one member
	// take their turns in the process, before they begin, first come first
	// served (Stats.TurnWaits counts the waits): none waits in Postgres
	// behind another of its own member, only behind other members'. Keys
	// are free-form strings, scoped to Schema; use a prefix per kind of row
	// ("customer:42"). A message whose
	// value does not decode may return nil: its handler will say so.
	//
	// Without it, handlers that write shared rows in differing orders can
	// deadlock; Postgres fails one of them after deadlock_timeout (1s by
	// default) and the record runs again (see Stats.Contention), so nothing is
	// lost or dead-lettered, but the seconds are lost. A BatchHandler that
	// writes the shared rows in one global order (each row once, sorted by
	// key, as a set-based upsert with ORDER BY does; outbox.Enqueue then
	// locks its keys sorted too) cannot deadlock with another batch and
	// needs no keys (and no BatchLockTimeout: set it negative): its batches
	// wait at most for each other's commit, while with keys, batches sharing
	// a row take turns from their first statement. Default: none.
	ConflictKeys func(msg *Message) []string
	// BatchLockTimeout bounds, in batch mode without ConflictKeys, how long
	// a statement of a batch waits for a lock (SET LOCAL lock_timeout, sent
	// with BEGIN). Batches whose handlers write shared rows in differing
	// orders would otherwise wait on each other until Postgres's deadlock
	// check (deadlock_timeout, 1s by default) fails one of them, cycle after
	// cycle. Past the bound the record's statement fails, its savepoint is
	// rolled back (releasing its locks, so the others go on), and the record
	// runs again in a transaction of its own after the batch commits, as
	// contention: without spending an attempt. A batch handler's timeout
	// runs its batch again. Default 100ms; negative: no bound.
	BatchLockTimeout time.Duration

	// Concurrency bounds the transactions in flight across all partitions
	// and keys; records wait for a slot rather than for a pool connection.
	// A transaction waiting for its turn behind one that shares a conflict
	// key (ConflictKeys) holds no slot. Default: the Pool's MaxConns.
	Concurrency int
	// GroupConcurrency bounds the transactions in flight across the whole
	// group instead: each member runs its share, by the partitions of
	// Topics it holds (GroupConcurrency x held / all, rounded down, at least
	// one, at most Concurrency), and takes a new share at every rebalance.
	// Once a rebalance has settled, the group keeps to it however many
	// members it has, as long as they are no more than GroupConcurrency and
	// hold about as many partitions each (as the balancers spread them),
	// without reconfiguring members as they come and go; during a rebalance
	// a member that lost partitions keeps its larger share until its
	// transactions in flight end. A member starts with a share of one. It is for effects that contend: batches
	// that write the same hot rows serve best at the few transactions the
	// database runs them fastest at (two to four on the contended benchmark),
	// and more members, each with a pool of its own, would otherwise run
	// more of them and lose throughput to lock waits. Transactions that
	// seldom meet (a transaction per record, rows spread wide) need one per
	// partition at least: set it to the partition count, or leave it unset.
	// Default 0: each member runs up to Concurrency, whatever the group.
	GroupConcurrency int

	// Schema holds oncely's tables (see package migrations). Default "oncely".
	Schema string
	// KeyFunc, when set, derives the dedup id. Otherwise the MessageIDHeader
	// header is used, and without it topic/partition/offset (which dedups
	// redeliveries but not a producer publishing the same message twice):
	// each such record counts in the oncely.consumer.id_fallback metric,
	// and a WARN naming the topic and partition is logged at most once a
	// minute per partition.
	KeyFunc KeyFunc
	// MessageIDHeader names the header with the message id, matched in any
	// casing ("Message-ID" too). Default "message-id".
	MessageIDHeader string

	// StartOffset is where the group starts reading a partition it has no
	// committed offset for: a new group, a topic or partition added later.
	// StartEarliest reads from the oldest record the broker still keeps, so
	// a new group processes the topic's history; StartLatest reads only
	// records produced after the group first got the partition. Either way
	// a committed offset wins, and a committed offset that retention has
	// deleted resumes at the oldest record kept (never at the end: that
	// would skip records that still exist). Default StartEarliest.
	StartOffset StartOffset

	// InstanceID turns on static group membership: a member restarted with
	// the same id takes its partitions back without a group-wide rebalance.
	// Ids must be unique among the group's live members. Default: dynamic.
	InstanceID string
	// SessionTimeout is how long the group waits for a silent member before
	// moving its partitions. The member heartbeats every
	// min(1s, SessionTimeout/3); a rebalance (a member joining or
	// restarting) completes at the other members' next heartbeat. Default 10s.
	SessionTimeout time.Duration
	// RebalanceTimeout bounds how long a rebalance waits for members to
	// rejoin. Default 30s.
	RebalanceTimeout time.Duration

	// RetryBaseDelay and RetryMaxDelay shape the backoff between attempts:
	// exponential from the base, capped, with full jitter.
	// Defaults 100ms and 10s.
	RetryBaseDelay time.Duration
	RetryMaxDelay  time.Duration
	// MaxAttempts is how many times a failing handler runs for one record
	// before the record is dead-lettered (class max_attempts, or panic when
	// the last attempt panicked). Errors marked dlq.Permanent or
	// dlq.Undecodable are dead-lettered at once. Failures to reach the
	// database (begin, claim, commit, a dropped connection) are retried
	// without limit and do not count. Default 10.
	MaxAttempts int

	// DeadLetterTopic names the dead-letter topic of a source topic.
	// Default dlq.DefaultTopic: "<topic>.dlq". The topic must exist: Run
	// checks at start-up (see BrokerTimeout), and the consumer never creates
	// topics. While a dead-letter write fails, the partition waits and
	// Ready reports false.
	DeadLetterTopic func(topic string) string
	// DeadLetterHeaders selects the original headers a dead-letter record
	// keeps. Default: all but authorization-, cookie-, token- and
	// secret-like keys; message-id and trace context are always kept.
	DeadLetterHeaders dlq.HeaderPolicy
	// DeadLetterTimeout bounds one dead-letter produce; a failed or timed
	// out produce is retried with backoff while the partition waits.
	// At least 1s (franz-go's minimum record timeout). Default 10s.
	DeadLetterTimeout time.Duration
	// CrashLoopLimit is how many times a record may kill the process (a
	// handler or KeyFunc calling os.Exit, the process running out of memory, a panic
	// in a goroutine the handler started: nothing Run can recover from)
	// before it is dead-lettered with class crash_loop. Such a record has no
	// error to count within one process, and without a limit would kill
	// every owner of its partition, blocking the partition for good.
	//
	// A partition whose previous owner died (it did not let the partition
	// go through a revoke or a shutdown) starts in probe: the records the
	// dead owner could have been running (as many unfinished records as it
	// could have had started at once: 1, its BatchSize, or its
	// MaxBufferedRecords with key parallelism; partition_owners.in_flight,
	// migration 0008) then run one at a time, each in its own transaction (no batch,
	// no key parallelism), one at a time across the member's probing
	// partitions, and each is marked in the partition_owners table
	// (migration 0006) before its KeyFunc and handler run. In batch mode and
	// with key parallelism, without a KeyFunc, a first death costs less:
	// when the dead owner was running records the ordinary way (not a
	// probe, not a replay) and no death is counted against a record still
	// to run, the records it could have been running (in_flight of them from
	// the first the inbox says did not finish) run again as this consumer runs records (one batch, or
	// on the lanes), marked as a replay (replay_end, migration 0009); a
	// death during the replay counts against no record, and makes the next
	// start probe those records one at a time. A restart after a kill then
	// costs one batch (or the lanes' time), not a transaction and a mark per
	// record, one at a time; a record that kills every process costs one
	// death more. Records that had
	// finished (most of them: those the dead owner finished after its last
	// offset commit) pass as duplicates; without a KeyFunc, the probe asks
	// the inbox about the records buffered ahead of it in one statement,
	// and those it finds finished pass without a mark or a transaction of
	// their own. When the process
	// dies, the next start counts the death against the marked record
	// unless it finished (processed, or dead-lettered and not redriven); a
	// probe that meets that record again, not finished, with
	// CrashLoopLimit deaths counted, dead-letters it instead of running it
	// (its KeyFunc included: a KeyFunc that kills the process is caught the
	// same way), and the partition goes on. The death of an owner that was not probing is put down to no
	// record (it may have been running several), so a record that kills
	// every run is dead-lettered on the start after it killed at most
	// CrashLoopLimit+1 processes (CrashLoopLimit of them in probe), or
	// CrashLoopLimit+2 in batch mode and with key parallelism (one more in
	// the replay). A
	// partition whose owner died while it was idle, or between records,
	// dead-letters nothing. A member revoked or shut down without dying
	// does not count (the deletion of its rows is retried for a few
	// seconds, within the shutdown's time). A member that loses its
	// partitions while alive (its session expired, or it was fenced)
	// counts as a death when the next owner writes the partition's row
	// before the lost member deletes it: nothing in the row tells a live
	// former owner from a dead one. The cost is a statement per partition assigned
	// and revoked, and while probing a mark per record that had not finished
	// (per record with a KeyFunc) and a statement per look-ahead; none on
	// the ordinary record path.
	//
	// Default 3 (DefaultCrashLoopLimit); -1 turns the detection off (no
	// table is read or written, a record that kills the process is received
	// again by every owner); other negative values are invalid.
	CrashLoopLimit int

	// system is messaging.system of a record path that NewRecordPath
	// made for a broker other than Kafka; "" for a Kafka consumer group.
	system string
	// MaxRecordBytes dead-letters records whose key, value and headers
	// together exceed it, without handing them to the handler (class
	// oversized). Default 0: no limit.
	MaxRecordBytes int

	// BrokerTimeout is how long Run waits at start-up for a broker to
	// answer before it logs an ERROR naming the brokers; NotReady names
	// them from then on, and Run goes on waiting (a wrong address shows at
	// once in logs and probes; a broker that is restarting is waited for).
	// Once a broker answers, Run fails with ErrMissingTopics, naming them,
	// when a topic of Topics or its dead-letter topic does not exist: the
	// consumer never creates topics. Default 15s.
	BrokerTimeout time.Duration
	// StuckAfter is how long a partition may stay on one record (retrying
	// it, waiting for its dead-letter write, or in a handler that does not
	// return) before Ready reports false, naming the partition and the
	// offset. The record is neither skipped nor abandoned: the probe only
	// tells. Default 5m.
	StuckAfter time.Duration

	// CommitInterval is how often marked offsets are committed to Kafka.
	// Offsets are also committed synchronously when partitions are revoked
	// and on shutdown. Default 1s.
	CommitInterval time.Duration
	// RevokeTimeout bounds how long a revoked partition's in-flight record
	// may run before it is abandoned (its transaction rolled back) so the
	// rebalance can proceed. Default 5s.
	RevokeTimeout time.Duration
	// ShutdownTimeout bounds Run's drain after its context is cancelled:
	// finishing in-flight records, the final offset commit and leaving the
	// group. Default 8s.
	ShutdownTimeout time.Duration

	// MaxBufferedRecords bounds the records buffered per partition; fetching
	// of a partition pauses while its buffer is full. Default 2000, or two
	// batches (2 x BatchSize) if that is more.
	MaxBufferedRecords int
	// MaxPollRecords bounds the records taken per poll. Default 1000, or
	// 4 x BatchSize if that is more.
	MaxPollRecords int
	// FetchMaxWait is how long a broker holds a fetch while none of the
	// partitions it asks for has new records. A partition whose buffer
	// was full resumes fetching only when the fetch in flight returns, so
	// while the member's other partitions are caught up, a backlogged one
	// waits up to this long each time its buffer drains: at 500ms, batch
	// mode on the uncontended benchmark, whose partitions finish their
	// backlogs one after another, made three quarters of its rate at
	// 100ms (docs/BENCHMARKS.md). A member with no backlog sends a fetch
	// per broker this often. Default 100ms.
	FetchMaxWait time.Duration

	// TracerProvider and MeterProvider instrument the consumer (one
	// "process <topic>" span per attempt, messaging metrics). Default: the
	// global providers.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	// UntrustedProducers starts each process span as a new trace linked to
	// the producer's context instead of continuing it: for topics fed from
	// outside, whose trace ids should not be adopted.
	UntrustedProducers bool
	// RecordKeyAttribute records the record key as
	// messaging.kafka.message.key. Off by default: keys may hold personal data.
	RecordKeyAttribute bool

	// Logger receives the consumer's logs. Default: discard.
	Logger *slog.Logger
	// LogInterval rate-limits the warnings that repeat while the database
	// or the brokers are unreachable (an attempt or a batch failed on the
	// database, a fetch error, a failed offset commit or dead-letter
	// produce): each kind is logged at most once per LogInterval, and the
	// line that goes out counts those held back (attribute "suppressed").
	// Default 10s.
	LogInterval time.Duration
	// ClientID is the Kafka client id of the consumer's client, which also
	// writes its dead-letter records: brokers log it and apply quotas to
	// it. Default: InstanceID when set, else "oncely-<hostname>-<pid>".
	ClientID string
	// ClientOpts are extra franz-go options (TLS, SASL...), applied after
	// oncely's own (a kgo.ClientID here wins over ClientID). Do not pass
	// kgo.AllowAutoTopicCreation: the start-up check would then find the
	// topics a typo created.
	ClientOpts []kgo.Opt
}

// ErrInvalidConfig is wrapped by every configuration error.
var ErrInvalidConfig = errors.New("consumer: invalid config")

func invalid(field, format string, args ...any) error {
	return fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, args...))
}

// StartOffset is Config.StartOffset.
type StartOffset string

// The values of Config.StartOffset.
const (
	StartEarliest StartOffset = "earliest"
	StartLatest   StartOffset = "latest"
)

func (cfg *Config) setDefaults() {
	cfg.Schema = cmp.Or(cfg.Schema, sqlident.DefaultSchema)
	cfg.StartOffset = cmp.Or(cfg.StartOffset, StartEarliest)
	cfg.MessageIDHeader = cmp.Or(cfg.MessageIDHeader, DefaultMessageIDHeader)
	cfg.SessionTimeout = cmp.Or(cfg.SessionTimeout, 10*time.Second)
	cfg.RebalanceTimeout = cmp.Or(cfg.RebalanceTimeout, 30*time.Second)
	cfg.RetryBaseDelay = cmp.Or(cfg.RetryBaseDelay, 100*time.Millisecond)
	cfg.RetryMaxDelay = cmp.Or(cfg.RetryMaxDelay, 10*time.Second)
	cfg.MaxAttempts = cmp.Or(cfg.MaxAttempts, DefaultMaxAttempts)
	if cfg.DeadLetterTopic == nil {
		cfg.DeadLetterTopic = dlq.DefaultTopic
	}
	cfg.DeadLetterHeaders.IDHeader = cfg.MessageIDHeader
	cfg.DeadLetterTimeout = cmp.Or(cfg.DeadLetterTimeout, 10*time.Second)
	cfg.BrokerTimeout = cmp.Or(cfg.BrokerTimeout, 15*time.Second)
	cfg.StuckAfter = cmp.Or(cfg.StuckAfter, 5*time.Minute)
	cfg.CommitInterval = cmp.Or(cfg.CommitInterval, time.Second)
	cfg.RevokeTimeout = cmp.Or(cfg.RevokeTimeout, 5*time.Second)
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, 8*time.Second)
	// A poll should be able to fill a batch of every partition, and a
	// partition's buffer hold two batches.
	cfg.MaxBufferedRecords = cmp.Or(cfg.MaxBufferedRecords, max(2000, 2*cfg.BatchSize))
	cfg.MaxPollRecords = cmp.Or(cfg.MaxPollRecords, max(1000, 4*cfg.BatchSize))
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	cfg.LogInterval = cmp.Or(cfg.LogInterval, ratelog.DefaultInterval)
	cfg.ClientID = telemetry.ClientID(cmp.Or(cfg.ClientID, cfg.InstanceID))
	cfg.BatchSize = cmp.Or(cfg.BatchSize, 1)
	cfg.BatchMaxWait = cmp.Or(cfg.BatchMaxWait, 5*time.Millisecond)
	cfg.FetchMaxWait = cmp.Or(cfg.FetchMaxWait, 100*time.Millisecond)
	cfg.BatchLockTimeout = cmp.Or(cfg.BatchLockTimeout, 100*time.Millisecond)
	cfg.KeyParallelism = cmp.Or(cfg.KeyParallelism, 1)
	cfg.CrashLoopLimit = cmp.Or(cfg.CrashLoopLimit, DefaultCrashLoopLimit)
	if cfg.Concurrency == 0 && cfg.Pool != nil {
		cfg.Concurrency = int(cfg.Pool.Config().MaxConns)
	}
}

func (cfg *Config) validate() error {
	switch {
	case len(cfg.Brokers) == 0 && cfg.system == "":
		return invalid("Brokers", "at least one seed broker is required")
	case len(cfg.Topics) == 0 && cfg.system == "":
		return invalid("Topics", "at least one topic is required")
	case cfg.Group == "":
		return invalid("Group", "a consumer group is required")
	case cfg.Pool == nil:
		return invalid("Pool", "a *pgxpool.Pool is required")
	case cfg.Handler == nil && cfg.BatchHandler == nil:
		return invalid("Handler", "a handler is required")
	case cfg.BatchHandler != nil && cfg.BatchSize < 2:
		return invalid("BatchHandler", "needs BatchSize above 1, got %d", cfg.BatchSize)
	case cfg.StartOffset != StartEarliest && cfg.StartOffset != StartLatest:
		return invalid("StartOffset", "%q is neither %q nor %q", cfg.StartOffset, StartEarliest, StartLatest)
	}
	for i, b := range cfg.Brokers {
		if b == "" {
			return invalid("Brokers", "broker %d is empty", i)
		}
	}
	for i, t := range cfg.Topics {
		if t == "" {
			return invalid("Topics", "topic %d is empty", i)
		}
	}
	if err := sqlident.ValidateSchema("Schema", cfg.Schema); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		{"SessionTimeout", cfg.SessionTimeout}, {"RebalanceTimeout", cfg.RebalanceTimeout},
		{"RetryBaseDelay", cfg.RetryBaseDelay}, {"RetryMaxDelay", cfg.RetryMaxDelay},
		{"CommitInterval", cfg.CommitInterval}, {"RevokeTimeout", cfg.RevokeTimeout},
		{"ShutdownTimeout", cfg.ShutdownTimeout}, {"DeadLetterTimeout", cfg.DeadLetterTimeout},
		{"BatchMaxWait", cfg.BatchMaxWait}, {"LogInterval", cfg.LogInterval},
		{"BrokerTimeout", cfg.BrokerTimeout}, {"StuckAfter", cfg.StuckAfter},
		{"FetchMaxWait", cfg.FetchMaxWait},
	} {
		if d.v < 0 {
			return invalid(d.field, "must not be negative, got %s", d.v)
		}
	}
	if cfg.RetryMaxDelay < cfg.RetryBaseDelay {
		return invalid("RetryMaxDelay", "%s is below RetryBaseDelay %s", cfg.RetryMaxDelay, cfg.RetryBaseDelay)
	}
	if cfg.MaxAttempts < 1 {
		return invalid("MaxAttempts", "must be at least 1, got %d", cfg.MaxAttempts)
	}
	if cfg.DeadLetterTimeout < time.Second {
		return invalid("DeadLetterTimeout", "must be at least 1s, got %s", cfg.DeadLetterTimeout)
	}
	if cfg.CrashLoopLimit < -1 {
		return invalid("CrashLoopLimit", "must be at least 1, or -1 to turn crash-loop detection off, got %d", cfg.CrashLoopLimit)
	}
	if cfg.MaxRecordBytes < 0 {
		return invalid("MaxRecordBytes", "must not be negative, got %d", cfg.MaxRecordBytes)
	}
	for _, t := range cfg.Topics {
		if d := cfg.DeadLetterTopic(t); d == "" || d == t {
			return invalid("DeadLetterTopic", "topic %q maps to dead-letter topic %q; it must be a different, non-empty name", t, d)
		}
	}
	if cfg.MaxBufferedRecords < 1 {
		return invalid("MaxBufferedRecords", "must be at least 1, got %d", cfg.MaxBufferedRecords)
	}
	if cfg.MaxPollRecords < 1 {
		return invalid("MaxPollRecords", "must be at least 1, got %d", cfg.MaxPollRecords)
	}
	for _, n := range []struct {
		field string
		v     int
	}{{"BatchSize", cfg.BatchSize}, {"KeyParallelism", cfg.KeyParallelism}, {"Concurrency", cfg.Concurrency}} {
		if n.v < 1 {
			return invalid(n.field, "must be at least 1, got %d", n.v)
		}
	}
	if cfg.GroupConcurrency < 0 {
		return invalid("GroupConcurrency", "must not be negative, got %d", cfg.GroupConcurrency)
	}
	if cfg.BatchSize > 1 && cfg.KeyParallelism > 1 {
		return invalid("KeyParallelism", "cannot be combined with BatchSize above 1 (got %d and %d): batches suit cheap handlers, key parallelism slow ones",
			cfg.KeyParallelism, cfg.BatchSize)
	}
	return nil
}
