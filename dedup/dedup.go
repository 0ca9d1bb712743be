package dedup

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/internal/sqlident"
)

// DBTX is what the inbox needs from a connection: pgx.Tx, *pgx.Conn and
// *pgxpool.Pool satisfy it. Claims are meant for a pgx.Tx.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Outcome is what became of a message.
type Outcome string

const (
	// Processed means the handler ran and its transaction committed.
	Processed Outcome = "processed"
	// DeadLettered means the message was written to a dead-letter topic.
	DeadLettered Outcome = "dead_lettered"
)

// Entry is one message to claim.
type Entry struct {
	Group     string // consumer group; required
	MessageID string // dedup key; required
	Topic     string
	Partition int32
	Offset    int64
	Outcome   Outcome // default Processed
	// Redrive marks a record that says it was redriven from a dead-letter
	// topic. Its claim consumes the redrive grant of its id (GrantRedrive),
	// if there is one whose ref is RedriveRef, and only with a grant does
	// it take over an id that the inbox holds as dead-lettered: the row
	// becomes processed, and the claim counts as new. Without a grant the
	// claim is an ordinary one. An id held as processed is still a
	// duplicate. A dead-lettered outcome consumes the grant too: the
	// redriven record had its one more run.
	Redrive bool
	// RedriveRef is what the redriven record says it was redriven from
	// (the value of its dlq.HeaderRedrive header: the dead-letter record's
	// topic/partition/offset). Only a grant made for that very ref is
	// taken: while a grant is pending, another record with the id and the
	// header (anybody can write both) is an ordinary claim.
	RedriveRef string
}

// Config configures an Inbox.
type Config struct {
	// Schema holds the inbox table (created by package migrations).
	// Default "oncely".
	Schema string
}

// Inbox claims message ids in the inbox table.
type Inbox struct {
	schema    string
	claim     string
	redrive   string
	claimMany string
	setOut    string
	lookup    string
	release   string
	// LookupMany
	lookupMany string
	// redrive grants (GrantRedrive)
	redriveDead, grant, revoke, granted string
}

// New returns an Inbox for the configured schema.
func New(cfg Config) (*Inbox, error) {
	schema := cmp.Or(cfg.Schema, sqlident.DefaultSchema)
	if err := sqlident.ValidateSchema("dedup: Config.Schema", schema); err != nil {
		return nil, err
	}
	t := sqlident.Table(schema, "inbox")
	g := sqlident.Table(schema, "redrive_grants")
	// A redriven record's claim deletes its grant in the same statement:
	// the claim and the grant's use commit or roll back together.
	takeGrant := `WITH g AS (DELETE FROM ` + g + ` WHERE consumer_group = $1 AND message_id = $2 AND ref = $7 RETURNING 1) `
	return &Inbox{
		schema: schema,
		claim: `INSERT INTO ` + t + ` (consumer_group, message_id, topic, partition, "offset", outcome)
			VALUES ($1, $2, $3, $4, $5, $6)
			ON CONFLICT (consumer_group, message_id) DO NOTHING`,
		redrive: takeGrant + `INSERT INTO ` + t + ` AS i (consumer_group, message_id, topic, partition, "offset", outcome)
			VALUES ($1, $2, $3, $4, $5, $6)
			ON CONFLICT (consumer_group, message_id) DO UPDATE
			SET outcome = EXCLUDED.outcome, topic = EXCLUDED.topic, partition = EXCLUDED.partition,
			    "offset" = EXCLUDED."offset", processed_at = now()
			WHERE i.outcome = 'dead_lettered' AND EXISTS (SELECT 1 FROM g)`,
		redriveDead: takeGrant + `INSERT INTO ` + t + ` (consumer_group, message_id, topic, partition, "offset", outcome)
			VALUES ($1, $2, $3, $4, $5, $6)
			ON CONFLICT (consumer_group, message_id) DO NOTHING`,
		grant: `INSERT INTO ` + g + ` (consumer_group, message_id, ref) VALUES ($1, $2, $3)
			ON CONFLICT (consumer_group, message_id) DO UPDATE SET ref = EXCLUDED.ref, granted_at = now()`,
		revoke:  `DELETE FROM ` + g + ` WHERE consumer_group = $1 AND message_id = $2`,
		granted: `SELECT EXISTS (SELECT 1 FROM ` + g + ` WHERE consumer_group = $1 AND message_id = $2 AND ref = $3)`,
		claimMany: `INSERT INTO ` + t + ` (consumer_group, message_id, topic, partition, "offset", outcome)
			SELECT $1, u.id, u.topic, u.part, u.off, u.outcome
			FROM unnest($2::text[], $3::text[], $4::int[], $5::bigint[], $6::text[]) AS u(id, topic, part, off, outcome)
			ORDER BY u.id -- two batches claiming overlapping ids take their row locks in one order
			ON CONFLICT (consumer_group, message_id) DO NOTHING
			RETURNING message_id`,
		setOut:     `UPDATE ` + t + ` SET outcome = $3 WHERE consumer_group = $1 AND message_id = $2`,
		lookup:     `SELECT outcome FROM ` + t + ` WHERE consumer_group = $1 AND message_id = $2`,
		lookupMany: `SELECT message_id, outcome FROM ` + t + ` WHERE consumer_group = $1 AND message_id = ANY ($2::text[])`,
		release:    `DELETE FROM ` + t + ` WHERE consumer_group = $1 AND message_id = $2`,
	}, nil
}

// MustNew is New for a schema known to be valid; it panics otherwise.
func MustNew(schema string) *Inbox {
	in, err := New(Config{Schema: schema})
	if err != nil {
		panic(err)
	}
	return in
}

// Schema returns the inbox's schema.
func (in *Inbox) Schema() string { return in.schema }

// ErrInvalidEntry is returned for an entry without group or message id.
var ErrInvalidEntry = errors.New("dedup: entry needs a group and a message id")

func (e *Entry) check() error {
	if e.Group == "" || e.MessageID == "" {
		return ErrInvalidEntry
	}
	if e.Outcome == "" {
		e.Outcome = Processed
	}
	if e.Outcome != Processed && e.Outcome != DeadLettered {
		return fmt.Errorf("dedup: unknown outcome %q", e.Outcome)
	}
	return nil
}

// Claim inserts the entry's id and reports whether it is new (true) or was
// claimed before (false). Call it first in the transaction that carries the
// message's effects; if another open transaction holds the same id, Claim
// waits for it to end. BeginClaim does the same in a transaction it begins,
// one round trip sooner.
func (in *Inbox) Claim(ctx context.Context, tx DBTX, e Entry) (bool, error) {
	sql, args, err := in.claimArgs(e)
	if err != nil {
		return false, err
	}
	tag, err := tx.Exec(ctx, sql, args...)
	if err != nil {
		return false, fmt.Errorf("dedup: claim %q: %w", e.MessageID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// BeginClaim begins a transaction on a connection from pool with e's claim
// as its first statement, and reports whether the claim is new, as Claim
// does. BEGIN and the claim go to Postgres in one round trip (pgx's
// Batch.BeginTx), where pool.Begin followed by Claim takes two. The
// transaction is open either way; the caller commits or rolls it back,
// which returns its connection to the pool. The statements of then run
// after the claim in the same round trip (locks the caller's handler will
// need, say). On error there is no transaction.
func (in *Inbox) BeginClaim(ctx context.Context, pool *pgxpool.Pool, e Entry, then ...Statement) (pgx.Tx, bool, error) {
	sql, args, err := in.claimArgs(e)
	if err != nil {
		return nil, false, err
	}
	var claimed bool
	tx, err := beginWith(ctx, pool, func(b *pgx.Batch) {
		b.Queue(sql, args...).Exec(func(tag pgconn.CommandTag) error {
			claimed = tag.RowsAffected() == 1
			return nil
		})
		queueAll(b, then)
	})
	if err != nil {
		return nil, false, fmt.Errorf("dedup: begin and claim %q: %w", e.MessageID, err)
	}
	return tx, claimed, nil
}

// Statement is a statement with its arguments, run after a claim in the
// same round trip (BeginClaim, BeginClaimMany).
type Statement struct {
	SQL  string
	Args []any
}

func queueAll(b *pgx.Batch, stmts []Statement) {
	for _, s := range stmts {
		b.Queue(s.SQL, s.Args...)
	}
}

// beginWith begins a transaction on a connection from pool and runs the
// statements queue adds as its first, all in one round trip. If any of
// them fails, the transaction is rolled back and the connection freed.
func beginWith(ctx context.Context, pool *pgxpool.Pool, queue func(*pgx.Batch)) (pgx.Tx, error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	queue(b)
	br := pool.SendBatch(ctx, b)
	tx := br.Tx()
	if err := br.Close(); err != nil {
		// Bounded on its own: ctx may be what failed.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx) // ends the transaction if BEGIN got through, and frees the connection
		return nil, err
	}
	return tx, nil
}

func (in *Inbox) claimArgs(e Entry) (string, []any, error) {
	if err := e.check(); err != nil {
		return "", nil, err
	}
	args := []any{e.Group, e.MessageID, e.Topic, e.Partition, e.Offset, string(e.Outcome)}
	switch {
	case e.Redrive && e.Outcome == DeadLettered:
		return in.redriveDead, append(args, e.RedriveRef), nil
	case e.Redrive:
		return in.redrive, append(args, e.RedriveRef), nil
	}
	return in.claim, args, nil
}

// ClaimMany claims all entries of one group in a single statement and returns,
// aligned with entries, whether each was newly claimed. When an id occurs
// more than once in entries, only its first occurrence can be new.
func (in *Inbox) ClaimMany(ctx context.Context, tx DBTX, group string, entries []Entry) ([]bool, error) {
	args, err := claimManyArgs(group, entries)
	if err != nil {
		return nil, err
	}
	if len(entries) == 0 {
		return []bool{}, nil
	}
	rows, err := tx.Query(ctx, in.claimMany, args...)
	if err != nil {
		return nil, fmt.Errorf("dedup: claim many: %w", err)
	}
	claimed, err := claimedOf(rows, args[1].([]string))
	if err != nil {
		return nil, fmt.Errorf("dedup: claim many: %w", err)
	}
	return claimed, nil
}

// BeginClaimMany is ClaimMany as the first statement of a transaction it
// begins on a connection from pool, in one round trip with BEGIN and the
// statements of then (see BeginClaim).
func (in *Inbox) BeginClaimMany(ctx context.Context, pool *pgxpool.Pool, group string, entries []Entry, then ...Statement) (pgx.Tx, []bool, error) {
	args, err := claimManyArgs(group, entries)
	if err != nil {
		return nil, nil, err
	}
	claimed := make([]bool, len(entries))
	tx, err := beginWith(ctx, pool, func(b *pgx.Batch) {
		if len(entries) > 0 {
			b.Queue(in.claimMany, args...).Query(func(rows pgx.Rows) error {
				var err error
				claimed, err = claimedOf(rows, args[1].([]string))
				return err
			})
		}
		queueAll(b, then)
	})
	if err != nil {
		return nil, nil, fmt.Errorf("dedup: begin and claim many: %w", err)
	}
	return tx, claimed, nil
}

// claimManyArgs checks entries and returns the claimMany statement's
// arguments: the group, then arrays of ids, topics, partitions, offsets and
// outcomes.
func claimManyArgs(group string, entries []Entry) ([]any, error) {
	n := len(entries)
	ids, topics, outcomes := make([]string, n), make([]string, n), make([]string, n)
	parts, offs := make([]int32, n), make([]int64, n)
	for i := range entries {
		e := entries[i] // a copy: the defaults below must not be written into the caller's slice
		if e.Group == "" {
			e.Group = group
		}
		if err := e.check(); err != nil {
			return nil, err
		}
		if e.Group != group {
			return nil, fmt.Errorf("dedup: claim many: entry %d has group %q, want %q", i, e.Group, group)
		}
		ids[i], topics[i], parts[i], offs[i], outcomes[i] = e.MessageID, e.Topic, e.Partition, e.Offset, string(e.Outcome)
	}
	return []any{group, ids, topics, parts, offs, outcomes}, nil
}

// claimedOf reads the ids a claimMany statement returned and says, aligned
// with ids, which were newly claimed.
func claimedOf(rows pgx.Rows, ids []string) ([]bool, error) {
	fresh := make(map[string]bool, len(ids))
	var id string
	if _, err := pgx.ForEachRow(rows, []any{&id}, func() error { fresh[id] = true; return nil }); err != nil {
		return nil, err
	}
	claimed := make([]bool, len(ids))
	for i, id := range ids {
		if fresh[id] {
			claimed[i] = true
			delete(fresh, id) // later occurrences of the same id are duplicates
		}
	}
	return claimed, nil
}

// SetOutcome records what became of an already claimed message.
func (in *Inbox) SetOutcome(ctx context.Context, tx DBTX, group, messageID string, o Outcome) error {
	e := Entry{Group: group, MessageID: messageID, Outcome: o}
	if err := e.check(); err != nil {
		return err
	}
	tag, err := tx.Exec(ctx, in.setOut, group, messageID, string(o))
	if err != nil {
		return fmt.Errorf("dedup: set outcome of %q: %w", messageID, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("dedup: set outcome of %q: %w", messageID, ErrNotClaimed)
	}
	return nil
}

// Release deletes a claim that tx made earlier, for a message whose effects
// tx rolled back to a savepoint taken after the claim: the message is then
// new again, for a later transaction (or a concurrent one waiting on the
// claim) to process. Never release a claim tx did not make.
func (in *Inbox) Release(ctx context.Context, tx DBTX, group, messageID string) error {
	if _, err := tx.Exec(ctx, in.release, group, messageID); err != nil {
		return fmt.Errorf("dedup: release %q: %w", messageID, err)
	}
	return nil
}

// ErrNotClaimed is returned by SetOutcome and Lookup for an id not in the inbox.
var ErrNotClaimed = errors.New("dedup: message not claimed")

// Lookup returns the outcome recorded for a message, or ErrNotClaimed.
func (in *Inbox) Lookup(ctx context.Context, db DBTX, group, messageID string) (Outcome, error) {
	var o string
	err := db.QueryRow(ctx, in.lookup, group, messageID).Scan(&o)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", ErrNotClaimed
	}
	if err != nil {
		return "", fmt.Errorf("dedup: lookup %q: %w", messageID, err)
	}
	return Outcome(o), nil
}

// LookupMany returns the outcome of each of ids that group holds (ids it
// does not hold are absent), in one query.
func (in *Inbox) LookupMany(ctx context.Context, db DBTX, group string, ids []string) (map[string]Outcome, error) {
	rows, err := db.Query(ctx, in.lookupMany, group, ids)
	if err != nil {
		return nil, fmt.Errorf("dedup: lookup %d ids: %w", len(ids), err)
	}
	out := make(map[string]Outcome, len(ids))
	var id, o string
	_, err = pgx.ForEachRow(rows, []any{&id, &o}, func() error {
		out[id] = Outcome(o)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("dedup: lookup %d ids: %w", len(ids), err)
	}
	return out, nil
}

// GrantRedrive records that the dead-lettered message id of group may run
// once more: the next claim of a record marked as redriven (Entry.Redrive)
// from ref (Entry.RedriveRef) takes over its dead-lettered inbox row,
// consuming the grant in its transaction. ref names the dead-letter record
// redriven, as the redriven record's dlq.HeaderRedrive header does; it is
// required. Granting an id that already has a grant leaves one grant, for
// the latest ref. Record the grant before producing the redriven record,
// or the consumer may see the record first and skip it as a duplicate.
func (in *Inbox) GrantRedrive(ctx context.Context, db DBTX, group, messageID, ref string) error {
	if group == "" || messageID == "" {
		return ErrInvalidEntry
	}
	if ref == "" {
		return fmt.Errorf("dedup: grant redrive of %q: the ref of the redriven dead-letter record is required", messageID)
	}
	if _, err := db.Exec(ctx, in.grant, group, messageID, ref); err != nil {
		return fmt.Errorf("dedup: grant redrive of %q: %w", messageID, err)
	}
	return nil
}

// RevokeRedrive deletes the redrive grant of a message id, if any: for a
// redrive whose record could not be produced.
func (in *Inbox) RevokeRedrive(ctx context.Context, db DBTX, group, messageID string) error {
	if _, err := db.Exec(ctx, in.revoke, group, messageID); err != nil {
		return fmt.Errorf("dedup: revoke redrive of %q: %w", messageID, err)
	}
	return nil
}

// RedriveGranted reports whether a message id holds a redrive grant for
// the dead-letter record ref.
func (in *Inbox) RedriveGranted(ctx context.Context, db DBTX, group, messageID, ref string) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, in.granted, group, messageID, ref).Scan(&ok); err != nil {
		return false, fmt.Errorf("dedup: redrive grant of %q: %w", messageID, err)
	}
	return ok, nil
}

// EstimateRows returns the planner's estimate of the inbox's row count
// (reltuples per page times the table's current pages, as the planner
// scales it), which costs nothing whatever the table's size. It returns -1
// when the planner has no statistics of the table (never analyzed, or
// analyzed while empty): count exactly then.
func (in *Inbox) EstimateRows(ctx context.Context, db DBTX) (int64, error) {
	var estimate int64
	err := db.QueryRow(ctx, `SELECT CASE WHEN reltuples > 0 AND relpages > 0
			THEN (reltuples / relpages * (pg_relation_size(oid) / current_setting('block_size')::bigint))::bigint
			ELSE -1 END
		FROM pg_class WHERE oid = to_regclass($1)`, sqlident.Table(in.schema, "inbox")).Scan(&estimate)
	if err != nil {
		return 0, fmt.Errorf("dedup: estimate rows: %w", err)
	}
	return estimate, nil
}
