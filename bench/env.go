package main

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/migrations"
)

// env is what every mode shares: the database server, the broker and the
// options of the run.
type env struct {
	dbURL     string
	admin     *pgxpool.Pool
	brokers   []string
	brokerPID int
	opts      options
}

// uniqueName returns prefix followed by 8 random hex digits.
func uniqueName(prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return prefix + "_" + hex.EncodeToString(b[:])
}

// db is one mode's schema: oncely's tables (migrations.Up) and the effects
// table, with a pool whose search_path is the schema and whose tracer is the
// mode's recorder.
type db struct {
	order    bool // -effect order: a primary key on effects, and balances
	schema   string
	pool     *pgxpool.Pool
	rec      *recorder
	backends backends
}

// effectsTable is the handlers' effect: one row per processed record. It has
// no unique index, so a record applied twice shows as a duplicate when the
// run is verified; seq orders the rows by insertion, so the verification
// also sees whether records of one key were applied out of order.
const effectsTable = `CREATE TABLE effects (
	seq        bigint GENERATED ALWAYS AS IDENTITY,
	message_id text   NOT NULL,
	key        text   NOT NULL,
	part       int    NOT NULL,
	off        bigint NOT NULL,
	amount     bigint NOT NULL)`

// The -effect values.
const (
	effectRow   = "row"
	effectOrder = "order"
)

// orderTables turn the effect into the orderworker example's: the effect
// row gets a primary key, as an orders table has, and every record adds its
// amount to its key's balance.
const orderTables = `ALTER TABLE effects ADD PRIMARY KEY (seq);
	CREATE TABLE balances (key text PRIMARY KEY, amount bigint NOT NULL, records bigint NOT NULL)`

// newDB creates a fresh schema for a mode and a pool of maxConns connections.
func (e *env) newDB(ctx context.Context, mode string, maxConns int32) (*db, error) {
	schema := uniqueName("bench_" + sqlIdent(mode))
	if _, err := e.admin.Exec(ctx, "CREATE SCHEMA "+sqlident.Quote(schema)); err != nil {
		return nil, fmt.Errorf("create schema: %w", err)
	}
	d := &db{schema: schema, rec: newRecorder(), order: e.opts.effect == effectOrder}
	cfg, err := pgxpool.ParseConfig(e.dbURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.Tracer = d.rec
	cfg.AfterConnect = func(_ context.Context, c *pgx.Conn) error {
		d.backends.add(c.PgConn().PID())
		return nil
	}
	cfg.MaxConns, cfg.MinConns = maxConns, maxConns
	if d.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, err
	}
	m, err := migrations.New(d.pool, migrations.Config{Schema: schema})
	if err == nil {
		_, err = m.Up(ctx)
	}
	if err == nil {
		_, err = d.pool.Exec(ctx, effectsTable)
	}
	if err == nil && d.order {
		_, err = d.pool.Exec(ctx, orderTables)
	}
	if err == nil {
		err = d.pool.Ping(ctx) // MinConns fills in the background; wait for one
	}
	if err != nil {
		d.close(ctx, e.admin)
		return nil, fmt.Errorf("prepare schema %s: %w", schema, err)
	}
	return d, nil
}

// sqlIdent maps a mode name to identifier characters.
func sqlIdent(s string) string {
	b := []byte(s)
	for i, c := range b {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			b[i] = '_'
		}
	}
	return string(b)
}

// cpuMeter measures the CPU time the mode costs.
func (e *env) cpuMeter(d *db) cpuMeter { return cpuMeter{brokerPID: e.brokerPID, db: d} }

func (d *db) close(ctx context.Context, admin *pgxpool.Pool) {
	if d.pool != nil {
		d.pool.Close()
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	_, _ = admin.Exec(ctx, "DROP SCHEMA "+sqlident.Quote(d.schema)+" CASCADE")
}

// verification is what the database holds after a mode ran.
type verification struct {
	effects, distinct, outOfOrder, inbox int64
	badBalances                          int64 // -effect order: keys whose balance is not their effects' sum
}

// verify checks that every one of want records has exactly one effect row,
// for modes with an inbox that each has exactly one inbox row, and for
// consumers (ordered) that the records of each key were applied in offset
// order.
func (d *db) verify(ctx context.Context, want int64, inbox, ordered bool) (verification, error) {
	var v verification
	err := d.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT message_id),
		count(*) FILTER (WHERE back)
		FROM (SELECT message_id, off < lag(off) OVER (PARTITION BY part, key ORDER BY seq) AS back FROM effects) e`).
		Scan(&v.effects, &v.distinct, &v.outOfOrder)
	if err == nil && inbox {
		err = d.pool.QueryRow(ctx, `SELECT count(*) FROM inbox`).Scan(&v.inbox)
	}
	if err == nil && d.order {
		// Every key's balance is the sum of its effects' amounts, and
		// counts them.
		err = d.pool.QueryRow(ctx, `SELECT count(*) FROM balances b FULL JOIN
			(SELECT key, sum(amount) AS amount, count(*) AS records FROM effects GROUP BY key) e USING (key)
			WHERE b.amount IS DISTINCT FROM e.amount OR b.records IS DISTINCT FROM e.records`).Scan(&v.badBalances)
	}
	if err != nil {
		return v, fmt.Errorf("verify: %w", err)
	}
	switch {
	case v.effects != want || v.distinct != want:
		return v, fmt.Errorf("verify: %d effect rows for %d distinct ids, want %d of each", v.effects, v.distinct, want)
	case ordered && v.outOfOrder != 0:
		return v, fmt.Errorf("verify: %d effect rows applied before an earlier record of their key", v.outOfOrder)
	case inbox && v.inbox != want:
		return v, fmt.Errorf("verify: %d inbox rows, want %d", v.inbox, want)
	case v.badBalances != 0:
		return v, fmt.Errorf("verify: %d keys whose balance is not the sum of their effects", v.badBalances)
	}
	return v, nil
}

// item is one benchmark record: the same fields whatever consumes it.
type item struct {
	id     string
	key    string
	part   int32
	off    int64
	amount int64
	sent   time.Time // when it was produced; carried in the value
}

// workload says which records a mode consumes. Record i has id "m-<i>",
// key "k-<i mod keys>" and goes to partition (i mod keys) mod partitions, so
// that every key lives on one partition and partitions get equal shares.
type workload struct {
	records    int
	keys       int
	partitions int32
}

const valueSize = 100 // bytes per record value: amount, produce time, padding

func (w workload) key(i int) int                 { return i % w.keys }
func (w workload) partition(i int) int32         { return int32(w.key(i) % int(w.partitions)) }
func amountOf(i int) int64                       { return int64(i%1000) + 1 }
func messageID(i int) string                     { return "m-" + strconv.Itoa(i) }
func keyName(k int) string                       { return "k-" + strconv.Itoa(k) }
func (w workload) record(i int) (id, key string) { return messageID(i), keyName(w.key(i)) }

// encodeValue lays out a record value: amount, produce time in unix
// nanoseconds (Kafka's own timestamps have millisecond resolution), padding.
func encodeValue(amount int64, sent time.Time) []byte {
	v := make([]byte, valueSize)
	binary.BigEndian.PutUint64(v[0:8], uint64(amount))
	binary.BigEndian.PutUint64(v[8:16], uint64(sent.UnixNano()))
	return v
}

func decodeValue(v []byte) (amount int64, sent time.Time, err error) {
	if len(v) < 16 {
		return 0, time.Time{}, fmt.Errorf("record value of %d bytes, want %d", len(v), valueSize)
	}
	return int64(binary.BigEndian.Uint64(v[0:8])), time.Unix(0, int64(binary.BigEndian.Uint64(v[8:16]))), nil
}

// watermillUUIDHeader carries the message id where watermill-kafka's default
// unmarshaler looks for it, so that msg.UUID is the same id oncely dedups on.
const watermillUUIDHeader = "_watermill_message_uuid"

func (w workload) kafkaRecord(topic string, i int, sent time.Time) *kgo.Record {
	id, key := w.record(i)
	return &kgo.Record{
		Topic: topic, Partition: w.partition(i), Key: []byte(key),
		Value: encodeValue(amountOf(i), sent),
		Headers: []kgo.RecordHeader{
			{Key: consumer.DefaultMessageIDHeader, Value: []byte(id)},
			{Key: watermillUUIDHeader, Value: []byte(id)},
		},
	}
}

// insertEffect is the handlers' effect statement.
const insertEffect = `INSERT INTO effects (message_id, key, part, off, amount) VALUES ($1, $2, $3, $4, $5)`

// applyEffect writes the record's effect row in tx and notes the record with the
// recorder, which counts it when tx commits.
func (d *db) applyEffect(ctx context.Context, tx pgx.Tx, it item) error {
	if _, err := tx.Exec(ctx, insertEffect, it.id, it.key, it.part, it.off, it.amount); err != nil {
		return err
	}
	if d.order {
		if _, err := tx.Exec(ctx, addToBalance, it.key, it.amount); err != nil {
			return err
		}
	}
	d.rec.note(tx.Conn(), it.sent)
	return nil
}

// addToBalance is -effect order's second statement: the record's amount
// added to its key's balance.
const addToBalance = `INSERT INTO balances AS b (key, amount, records) VALUES ($1, $2, 1)
	ON CONFLICT (key) DO UPDATE SET amount = b.amount + EXCLUDED.amount, records = b.records + 1`

// addToBalances is addToBalance for many records in one statement.
const addToBalances = `INSERT INTO balances AS b (key, amount, records)
	SELECT key, sum(amount), count(*) FROM unnest($1::text[], $2::bigint[]) AS u(key, amount) GROUP BY key ORDER BY key
	ON CONFLICT (key) DO UPDATE SET amount = b.amount + EXCLUDED.amount, records = b.records + EXCLUDED.records`

// insertEffects is insertEffect for many rows in one statement.
const insertEffects = `INSERT INTO effects (message_id, key, part, off, amount)
	SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::bigint[], $5::bigint[])`

// applyEffects writes the effect rows of items in one statement and notes
// them with the recorder.
func (d *db) applyEffects(ctx context.Context, tx pgx.Tx, items []item) error {
	n := len(items)
	ids, keys := make([]string, n), make([]string, n)
	parts, offs, amounts := make([]int32, n), make([]int64, n), make([]int64, n)
	for j, it := range items {
		ids[j], keys[j], parts[j], offs[j], amounts[j] = it.id, it.key, it.part, it.off, it.amount
	}
	if _, err := tx.Exec(ctx, insertEffects, ids, keys, parts, offs, amounts); err != nil {
		return err
	}
	if d.order {
		if _, err := tx.Exec(ctx, addToBalances, keys, amounts); err != nil {
			return err
		}
	}
	for _, it := range items {
		d.rec.note(tx.Conn(), it.sent)
	}
	return nil
}

// itemOf reads a franz-go record (oncely and the naive consumer).
func itemOf(id string, rec *kgo.Record) (item, error) {
	amount, sent, err := decodeValue(rec.Value)
	return item{id: id, key: string(rec.Key), part: rec.Partition, off: rec.Offset, amount: amount, sent: sent}, err
}

// newTopic creates a fresh topic for a mode.
func (e *env) newTopic(ctx context.Context, mode string, partitions int32) (string, error) {
	topic := uniqueName("bench-" + mode)
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		return "", err
	}
	defer cl.Close()
	// The dead-letter topic too: the consumer checks at start-up that it exists.
	resp, err := kadm.NewClient(cl).CreateTopics(ctx, partitions, 1, nil, topic, dlq.DefaultTopic(topic))
	if err == nil {
		err = resp.Error()
	}
	if err != nil {
		return "", fmt.Errorf("create topic %s: %w", topic, err)
	}
	return topic, nil
}

// deleteTopic frees the broker's copy of a mode's records.
func (e *env) deleteTopic(ctx context.Context, topic string) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		return
	}
	defer cl.Close()
	_, _ = kadm.NewClient(cl).DeleteTopics(ctx, topic, dlq.DefaultTopic(topic))
}

// producer writes a mode's records to its topic: record i is what record
// builds for it.
type producer struct {
	cl     *kgo.Client
	record func(i int, sent time.Time) (*kgo.Record, error)

	mu  sync.Mutex
	err error
}

// compressions are the -compression choices.
var compressions = map[string]kgo.CompressionCodec{
	"none": kgo.NoCompression(), "snappy": kgo.SnappyCompression(), "lz4": kgo.Lz4Compression(),
	"zstd": kgo.ZstdCompression(), "gzip": kgo.GzipCompression(),
}

func (e *env) newProducer(topic string, w workload) (*producer, error) {
	return e.newRecordProducer(func(i int, sent time.Time) (*kgo.Record, error) {
		return w.kafkaRecord(topic, i, sent), nil
	})
}

// newRecordProducer returns a producer of the records record builds.
func (e *env) newRecordProducer(record func(i int, sent time.Time) (*kgo.Record, error)) (*producer, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerLinger(0), kgo.MaxBufferedRecords(50_000),
		kgo.ProducerBatchCompression(compressions[e.opts.compression]))
	if err != nil {
		return nil, err
	}
	return &producer{cl: cl, record: record}, nil
}

func (p *producer) produce(ctx context.Context, i int, sent time.Time) {
	rec, err := p.record(i, sent)
	if err != nil {
		p.fail(err)
		return
	}
	p.cl.Produce(ctx, rec, func(_ *kgo.Record, err error) {
		if err != nil {
			p.fail(err)
		}
	})
}

func (p *producer) fail(err error) {
	p.mu.Lock()
	p.err = cmpErr(p.err, err)
	p.mu.Unlock()
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// backlog produces records [from, to) as fast as the broker takes them and
// waits for their acknowledgements.
func (p *producer) backlog(ctx context.Context, from, to int) error {
	now := time.Now()
	for i := from; i < to; i++ {
		p.produce(ctx, i, now)
	}
	return p.flush(ctx)
}

// paced produces records [from, to) at rate records per second, each
// stamped with its produce time, and waits for their acknowledgements.
func (p *producer) paced(ctx context.Context, from, to int, rate float64) error {
	start := time.Now()
	for i := from; i < to; i++ {
		due := start.Add(time.Duration(float64(i-from) / rate * float64(time.Second)))
		if d := time.Until(due); d > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(d):
			}
		}
		p.produce(ctx, i, time.Now())
	}
	return p.flush(ctx)
}

func (p *producer) flush(ctx context.Context) error {
	if err := p.cl.Flush(ctx); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return fmt.Errorf("produce: %w", p.err)
	}
	return nil
}

func (p *producer) close() { p.cl.Close() }
