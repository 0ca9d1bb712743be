package outbound

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncely/oncely/internal/sqlident"
)

// Limits on what Enqueue and the subscription functions accept.
const (
	MaxEventIDLen   = 1024
	MaxEventTypeLen = 256
	MaxSecrets      = 10   // secrets per subscription (the table's CHECK)
	MaxURLLen       = 2048 // endpoint URL length
)

// ErrNotFound is returned for a subscription or delivery that does not exist.
var ErrNotFound = errors.New("outbound: not found")

// DBTX is a connection, pool or transaction: pgx.Tx, *pgx.Conn and
// *pgxpool.Pool satisfy it.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Config names the schema of the webhook tables.
type Config struct {
	// Schema holds the webhook_* tables (package migrations). Default
	// "oncely".
	Schema string
}

// Store enqueues deliveries and manages subscriptions. It holds no
// connection: every method takes the DBTX to run on, so it can join the
// caller's transaction.
type Store struct {
	schema string
	subs   string // quoted table names
	dels   string
	brks   string
	q      storeQueries
}

type storeQueries struct {
	enqueue, createSub, getSub, setSecrets, setEnabled, setEventTypes, setURL, pause, resume,
	deleteSub, getDelivery, redrive, redriveDry, deleteDelivered string
}

// NewStore returns a Store for cfg's schema.
func NewStore(cfg Config) (*Store, error) {
	schema := cmp.Or(cfg.Schema, sqlident.DefaultSchema)
	if err := sqlident.ValidateSchema("outbound: Config.Schema", schema); err != nil {
		return nil, err
	}
	s := &Store{
		schema: schema,
		subs:   sqlident.Table(schema, "webhook_subscriptions"),
		dels:   sqlident.Table(schema, "webhook_deliveries"),
		brks:   sqlident.Table(schema, "webhook_breakers"),
	}
	subCols := `id, endpoint_url, secrets, event_types, description, enabled, paused_at, paused_reason, created_at, updated_at`
	delCols := `id, subscription_id, event_id, event_type, payload, webhook_id, status, attempts, next_attempt_at,
		last_status, last_error, created_at, updated_at, delivered_at, dead_at, redrives`
	s.q = storeQueries{
		// One statement fans every event out to every enabled subscription
		// whose filter matches. Paused subscriptions still get deliveries
		// (they wait for Resume); disabled ones do not.
		enqueue: `INSERT INTO ` + s.dels + ` (subscription_id, event_id, event_type, payload, webhook_id)
			SELECT s.id, e.id, e.type, e.payload, 'msg_' || replace(gen_random_uuid()::text, '-', '')
			FROM unnest($1::text[], $2::text[], $3::bytea[]) WITH ORDINALITY AS e(id, type, payload, n)
			JOIN ` + s.subs + ` s ON s.enabled AND (cardinality(s.event_types) = 0
				OR e.type = ANY (s.event_types)
				OR EXISTS (SELECT 1 FROM unnest(s.event_types) AS p(pattern)
					WHERE p.pattern = '*' OR (right(p.pattern, 2) = '.*' AND starts_with(e.type, left(p.pattern, -1)))))
			ORDER BY e.n, s.id
			ON CONFLICT (subscription_id, event_id) DO NOTHING
			RETURNING id, subscription_id, event_id, webhook_id`,
		createSub: `INSERT INTO ` + s.subs + ` (endpoint_url, secrets, event_types, description, enabled)
			VALUES ($1, $2, $3, $4, $5) RETURNING ` + subCols,
		getSub:        `SELECT ` + subCols + ` FROM ` + s.subs + ` WHERE id = $1`,
		setSecrets:    `UPDATE ` + s.subs + ` SET secrets = $2, updated_at = now() WHERE id = $1`,
		setEnabled:    `UPDATE ` + s.subs + ` SET enabled = $2, updated_at = now() WHERE id = $1`,
		setEventTypes: `UPDATE ` + s.subs + ` SET event_types = $2, updated_at = now() WHERE id = $1`,
		setURL:        `UPDATE ` + s.subs + ` SET endpoint_url = $2, updated_at = now() WHERE id = $1`,
		pause: `UPDATE ` + s.subs + ` SET paused_at = now(), paused_reason = $2, updated_at = now()
			WHERE id = $1 AND paused_at IS NULL`,
		// Resuming starts the endpoint afresh: closed, no failure history,
		// no throttle (the breaker row is removed), in one statement.
		resume: `WITH r AS (UPDATE ` + s.subs + ` SET paused_at = NULL, paused_reason = NULL, updated_at = now()
				WHERE id = $1 RETURNING id),
			b AS (DELETE FROM ` + s.brks + ` WHERE subscription_id IN (SELECT id FROM r))
			SELECT count(*) FROM r`,
		deleteSub:   `DELETE FROM ` + s.subs + ` WHERE id = $1`,
		getDelivery: `SELECT ` + delCols + ` FROM ` + s.dels + ` WHERE webhook_id = $1`,
		redriveDry: `SELECT ` + delCols + ` FROM ` + s.dels + `
			WHERE status = 'dead' AND ($1::uuid IS NULL OR subscription_id = $1)
			  AND ($2::timestamptz IS NULL OR dead_at >= $2) AND ($3::timestamptz IS NULL OR dead_at < $3)
			ORDER BY dead_at, id LIMIT $4`,
		// The same webhook_id: receivers that saw an earlier attempt dedup.
		redrive: `WITH old AS (SELECT ` + delCols + ` FROM ` + s.dels + `
				WHERE status = 'dead' AND ($1::uuid IS NULL OR subscription_id = $1)
				  AND ($2::timestamptz IS NULL OR dead_at >= $2) AND ($3::timestamptz IS NULL OR dead_at < $3)
				ORDER BY dead_at, id LIMIT $4 FOR UPDATE SKIP LOCKED),
			upd AS (UPDATE ` + s.dels + ` d SET status = 'pending', attempts = 0, next_attempt_at = now(),
				dead_at = NULL, redrives = d.redrives + 1, updated_at = now()
				FROM old WHERE d.id = old.id)
			SELECT ` + delCols + ` FROM old ORDER BY dead_at, id`,
		deleteDelivered: `DELETE FROM ` + s.dels + ` WHERE id IN (SELECT id FROM ` + s.dels + `
			WHERE status = 'delivered' AND delivered_at < now() - make_interval(secs => $1)
			ORDER BY delivered_at LIMIT $2 FOR UPDATE SKIP LOCKED)`,
	}
	return s, nil
}

// Schema returns the schema the store works in.
func (s *Store) Schema() string { return s.schema }

// Event is something that happened, to be delivered to every subscription
// that wants its type.
type Event struct {
	// ID identifies the event. Enqueuing an ID that a subscription already
	// has a delivery for stores nothing for that subscription, so a retried
	// enqueue is harmless. Required.
	ID string
	// Type is matched against the subscriptions' event type filters.
	// Required.
	Type string
	// Payload is the request body, sent byte for byte (normally JSON:
	// requests carry Content-Type: application/json).
	Payload []byte
}

// Enqueued is a delivery that Enqueue stored.
type Enqueued struct {
	DeliveryID     int64
	SubscriptionID uuid.UUID
	EventID        string
	// WebhookID is the webhook-id header of every attempt of this delivery.
	WebhookID string
}

// Enqueue stores one delivery per (event, matching enabled subscription) in
// the caller's transaction, in one statement. The deliveries become visible to
// dispatchers when tx commits; if it rolls back, nothing is sent. An event
// that a subscription already has a delivery for is skipped for that
// subscription; the result lists only what was stored.
func (s *Store) Enqueue(ctx context.Context, tx pgx.Tx, events ...Event) ([]Enqueued, error) {
	if len(events) == 0 {
		return nil, nil
	}
	ids, types, payloads := make([]string, len(events)), make([]string, len(events)), make([][]byte, len(events))
	for i, e := range events {
		switch {
		case e.ID == "":
			return nil, fmt.Errorf("outbound: enqueue: event %d: Event.ID is empty", i)
		case len(e.ID) > MaxEventIDLen:
			return nil, fmt.Errorf("outbound: enqueue: event %d: Event.ID of %d bytes exceeds %d", i, len(e.ID), MaxEventIDLen)
		case e.Type == "":
			return nil, fmt.Errorf("outbound: enqueue: event %d: Event.Type is empty", i)
		case len(e.Type) > MaxEventTypeLen:
			return nil, fmt.Errorf("outbound: enqueue: event %d: Event.Type of %d bytes exceeds %d", i, len(e.Type), MaxEventTypeLen)
		}
		ids[i], types[i], payloads[i] = e.ID, e.Type, e.Payload
		if payloads[i] == nil {
			payloads[i] = []byte{}
		}
	}
	rows, err := tx.Query(ctx, s.q.enqueue, ids, types, payloads)
	if err != nil {
		return nil, fmt.Errorf("outbound: enqueue: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Enqueued, error) {
		var e Enqueued
		err := r.Scan(&e.DeliveryID, &e.SubscriptionID, &e.EventID, &e.WebhookID)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbound: enqueue: %w", err)
	}
	return out, nil
}

// Subscription is an endpoint that receives events.
type Subscription struct {
	ID uuid.UUID // assigned by CreateSubscription
	// URL is the endpoint, http or https. Required. Where it may point is
	// checked when each request is sent (see DispatcherConfig.AllowNetworks).
	// Credentials in it (user:password@, a token in the query) are stored
	// and sent, and never shown: see RedactURL.
	URL string
	// Secrets sign every request (Standard Webhooks, "whsec_" + base64 of
	// 24 to 64 random bytes), one v1 signature per secret. Empty on
	// creation: one is generated. List several while rotating.
	Secrets []string
	// EventTypes filters events by type: exact names, "prefix.*" (e.g.
	// "invoice.*" matches "invoice.paid") or "*". Empty: every type.
	EventTypes  []string
	Description string
	// Disabled: the subscription gets no new deliveries and its pending
	// ones are not attempted until it is enabled again (SetEnabled).
	Disabled bool

	PausedAt     time.Time // zero unless paused (automatically or by PauseSubscription)
	PausedReason string
	CreatedAt    time.Time
	UpdatedAt    time.Time
}

// Paused reports whether deliveries to the subscription are on hold.
func (s Subscription) Paused() bool { return !s.PausedAt.IsZero() }

// NewSecret returns a fresh signing secret: "whsec_" + base64 of 32 random
// bytes.
func NewSecret() (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("outbound: new secret: %w", err)
	}
	return "whsec_" + base64.StdEncoding.EncodeToString(b), nil
}

// CreateSubscription validates sub and stores it, generating a secret when
// sub.Secrets is empty. ID, the pause and the times are assigned, not read.
// It returns the stored subscription.
func (s *Store) CreateSubscription(ctx context.Context, db DBTX, sub Subscription) (Subscription, error) {
	if err := ValidateURL(sub.URL); err != nil {
		return Subscription{}, fmt.Errorf("outbound: Subscription.URL: %w", err)
	}
	if len(sub.Secrets) == 0 {
		sec, err := NewSecret()
		if err != nil {
			return Subscription{}, err
		}
		sub.Secrets = []string{sec}
	}
	if _, err := decodeSecrets(sub.Secrets); err != nil {
		return Subscription{}, fmt.Errorf("outbound: Subscription.Secrets: %w", err)
	}
	if err := validateEventTypes(sub.EventTypes); err != nil {
		return Subscription{}, fmt.Errorf("outbound: Subscription.EventTypes: %w", err)
	}
	types := sub.EventTypes
	if types == nil {
		types = []string{}
	}
	out, err := scanSubscription(db.QueryRow(ctx, s.q.createSub, sub.URL, sub.Secrets, types, sub.Description, !sub.Disabled))
	if err != nil {
		return Subscription{}, fmt.Errorf("outbound: create subscription: %w", err)
	}
	return out, nil
}

// GetSubscription returns the subscription, or an error wrapping ErrNotFound.
func (s *Store) GetSubscription(ctx context.Context, db DBTX, id uuid.UUID) (Subscription, error) {
	out, err := scanSubscription(db.QueryRow(ctx, s.q.getSub, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Subscription{}, fmt.Errorf("outbound: subscription %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return Subscription{}, fmt.Errorf("outbound: get subscription %s: %w", id, err)
	}
	return out, nil
}

// SetSecrets replaces the subscription's signing secrets. To rotate, set
// [old, new], let the receiver accept new, then set [new].
func (s *Store) SetSecrets(ctx context.Context, db DBTX, id uuid.UUID, secrets []string) error {
	if len(secrets) == 0 {
		return errors.New("outbound: SetSecrets: at least one secret is required")
	}
	if _, err := decodeSecrets(secrets); err != nil {
		return fmt.Errorf("outbound: SetSecrets: %w", err)
	}
	return s.update(ctx, db, "set secrets", s.q.setSecrets, id, secrets)
}

// SetEnabled enables or disables the subscription.
func (s *Store) SetEnabled(ctx context.Context, db DBTX, id uuid.UUID, enabled bool) error {
	return s.update(ctx, db, "set enabled", s.q.setEnabled, id, enabled)
}

// SetEventTypes replaces the subscription's event type filter (empty: all).
func (s *Store) SetEventTypes(ctx context.Context, db DBTX, id uuid.UUID, types []string) error {
	if err := validateEventTypes(types); err != nil {
		return fmt.Errorf("outbound: SetEventTypes: %w", err)
	}
	if types == nil {
		types = []string{}
	}
	return s.update(ctx, db, "set event types", s.q.setEventTypes, id, types)
}

// SetURL changes the subscription's endpoint. Pending deliveries go to the
// new URL; the breaker state is kept (reset it with ResumeSubscription).
func (s *Store) SetURL(ctx context.Context, db DBTX, id uuid.UUID, endpoint string) error {
	if err := ValidateURL(endpoint); err != nil {
		return fmt.Errorf("outbound: SetURL: %w", err)
	}
	return s.update(ctx, db, "set url", s.q.setURL, id, endpoint)
}

// PauseSubscription holds the subscription's deliveries until
// ResumeSubscription. Pausing a paused subscription keeps the first reason.
func (s *Store) PauseSubscription(ctx context.Context, db DBTX, id uuid.UUID, reason string) error {
	if reason == "" {
		reason = "paused by an operator"
	}
	tag, err := db.Exec(ctx, s.q.pause, id, reason)
	if err != nil {
		return fmt.Errorf("outbound: pause subscription %s: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		_, err := s.GetSubscription(ctx, db, id) // already paused, or missing
		return err
	}
	return nil
}

// ResumeSubscription lifts a pause and resets the endpoint's circuit
// breaker (closed, no failures, no throttle), so pending deliveries go out
// on the next claim.
func (s *Store) ResumeSubscription(ctx context.Context, db DBTX, id uuid.UUID) error {
	var n int
	if err := db.QueryRow(ctx, s.q.resume, id).Scan(&n); err != nil {
		return fmt.Errorf("outbound: resume %s: %w", id, err)
	}
	if n == 0 {
		return fmt.Errorf("outbound: resume %s: %w", id, ErrNotFound)
	}
	return nil
}

// DeleteSubscription removes the subscription with its deliveries and
// breaker state.
func (s *Store) DeleteSubscription(ctx context.Context, db DBTX, id uuid.UUID) error {
	return s.update(ctx, db, "delete", s.q.deleteSub, id)
}

func (s *Store) update(ctx context.Context, db DBTX, what, sql string, id uuid.UUID, args ...any) error {
	tag, err := db.Exec(ctx, sql, append([]any{id}, args...)...)
	if err != nil {
		return fmt.Errorf("outbound: %s %s: %w", what, id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("outbound: %s %s: %w", what, id, ErrNotFound)
	}
	return nil
}

func scanSubscription(row pgx.Row) (Subscription, error) {
	var (
		sub     Subscription
		enabled bool
		paused  *time.Time
		reason  *string
	)
	err := row.Scan(&sub.ID, &sub.URL, &sub.Secrets, &sub.EventTypes, &sub.Description, &enabled,
		&paused, &reason, &sub.CreatedAt, &sub.UpdatedAt)
	if paused != nil {
		sub.PausedAt = *paused
	}
	if reason != nil {
		sub.PausedReason = *reason
	}
	sub.Disabled = !enabled
	return sub, err
}

// ValidateURL accepts absolute http and https URLs with a host and no
// fragment, whose host is not the name of a cloud metadata endpoint
// (*HostError). It does not resolve the host: the address is checked when
// each request is dialled. Its errors never quote a credential of the URL.
func ValidateURL(raw string) error {
	if len(raw) > MaxURLLen {
		return fmt.Errorf("URL of %d bytes exceeds %d", len(raw), MaxURLLen)
	}
	u, err := url.Parse(raw)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // without the URL, which may hold a credential
		}
		return fmt.Errorf("URL does not parse: %w", err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("%w: %q (want http or https)", ErrScheme, u.Scheme)
	}
	if u.Hostname() == "" {
		return fmt.Errorf("URL %q has no host", RedactURL(raw))
	}
	if u.Fragment != "" {
		return fmt.Errorf("URL %q has a fragment", RedactURL(raw))
	}
	return checkHost(u.Hostname())
}

func validateEventTypes(types []string) error {
	for i, t := range types {
		if t == "" || len(t) > MaxEventTypeLen {
			return fmt.Errorf("event type %d: must be 1 to %d bytes", i, MaxEventTypeLen)
		}
		if strings.Contains(strings.TrimSuffix(t, "*"), "*") || (strings.HasSuffix(t, "*") && t != "*" && !strings.HasSuffix(t, ".*")) {
			return fmt.Errorf("event type %q: a wildcard is allowed only as \"*\" or a trailing \".*\"", t)
		}
	}
	return nil
}

// DeliveryStatus is where a delivery is in its life.
type DeliveryStatus string

// Delivery statuses.
const (
	StatusPending    DeliveryStatus = "pending"    // waiting for next_attempt_at (or for its subscription)
	StatusDelivering DeliveryStatus = "delivering" // an attempt is in flight under a lease
	StatusDelivered  DeliveryStatus = "delivered"  // a 2xx was received
	StatusDead       DeliveryStatus = "dead"       // terminal: a non-retryable answer, or attempts exhausted
)

// Delivery is one event for one subscription, as stored.
type Delivery struct {
	ID             int64
	SubscriptionID uuid.UUID
	EventID        string
	EventType      string
	Payload        []byte
	WebhookID      string
	Status         DeliveryStatus
	Attempts       int
	NextAttemptAt  time.Time
	LastStatus     int    // HTTP status of the last attempt; 0 when it got no response
	LastError      string // why the last attempt failed; empty after success
	CreatedAt      time.Time
	UpdatedAt      time.Time
	DeliveredAt    time.Time // zero unless delivered
	DeadAt         time.Time // zero unless dead
	Redrives       int       // how often it was redriven
}

func scanDelivery(row pgx.CollectableRow) (Delivery, error) {
	var (
		d                    Delivery
		lastStatus           *int32
		lastErr              *string
		deliveredAt, deadAt  *time.Time
		status               string
		attempts, redrives32 int32
	)
	err := row.Scan(&d.ID, &d.SubscriptionID, &d.EventID, &d.EventType, &d.Payload, &d.WebhookID, &status,
		&attempts, &d.NextAttemptAt, &lastStatus, &lastErr, &d.CreatedAt, &d.UpdatedAt, &deliveredAt, &deadAt, &redrives32)
	d.Status, d.Attempts, d.Redrives = DeliveryStatus(status), int(attempts), int(redrives32)
	if lastStatus != nil {
		d.LastStatus = int(*lastStatus)
	}
	if lastErr != nil {
		d.LastError = *lastErr
	}
	if deliveredAt != nil {
		d.DeliveredAt = *deliveredAt
	}
	if deadAt != nil {
		d.DeadAt = *deadAt
	}
	return d, err
}

// GetDelivery returns the delivery with the given webhook-id, or an error
// wrapping ErrNotFound.
func (s *Store) GetDelivery(ctx context.Context, db DBTX, webhookID string) (Delivery, error) {
	rows, err := db.Query(ctx, s.q.getDelivery, webhookID)
	if err != nil {
		return Delivery{}, fmt.Errorf("outbound: get delivery %s: %w", webhookID, err)
	}
	d, err := pgx.CollectExactlyOneRow(rows, scanDelivery)
	if errors.Is(err, pgx.ErrNoRows) {
		return Delivery{}, fmt.Errorf("outbound: delivery %s: %w", webhookID, ErrNotFound)
	}
	if err != nil {
		return Delivery{}, fmt.Errorf("outbound: get delivery %s: %w", webhookID, err)
	}
	return d, nil
}

// RedriveFilter selects dead deliveries.
type RedriveFilter struct {
	// SubscriptionID restricts the redrive to one subscription. uuid.Nil:
	// every subscription (AllSubscriptions must then be set, so that a
	// forgotten field cannot redrive everything).
	SubscriptionID   uuid.UUID
	AllSubscriptions bool
	// Since and Until bound when the deliveries died (database time):
	// Since <= dead_at < Until. Zero: unbounded.
	Since, Until time.Time
	// Limit bounds how many are redriven (oldest deaths first). 0: no limit.
	Limit int
	// DryRun returns what would be redriven and changes nothing.
	DryRun bool
}

// Redrive puts the dead deliveries that f selects back to pending, due now,
// with their attempt count reset to zero and their webhook-id unchanged
// (a receiver that processed an earlier attempt deduplicates), and returns
// them as they were before the redrive. Deliveries of a paused or disabled
// subscription wait until it is resumed or enabled.
func (s *Store) Redrive(ctx context.Context, db DBTX, f RedriveFilter) ([]Delivery, error) {
	if f.SubscriptionID == uuid.Nil && !f.AllSubscriptions {
		return nil, errors.New("outbound: redrive: RedriveFilter.SubscriptionID: required unless AllSubscriptions is set")
	}
	if f.SubscriptionID != uuid.Nil && f.AllSubscriptions {
		return nil, errors.New("outbound: redrive: RedriveFilter: set SubscriptionID or AllSubscriptions, not both")
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && !f.Since.Before(f.Until) {
		return nil, fmt.Errorf("outbound: redrive: RedriveFilter.Since (%s) must be before Until (%s)", f.Since, f.Until)
	}
	if f.Limit < 0 {
		return nil, fmt.Errorf("outbound: redrive: RedriveFilter.Limit: %d is negative", f.Limit)
	}
	var sub, since, until, limit any
	if f.SubscriptionID != uuid.Nil {
		sub = f.SubscriptionID
	}
	if !f.Since.IsZero() {
		since = f.Since
	}
	if !f.Until.IsZero() {
		until = f.Until
	}
	if f.Limit > 0 {
		limit = f.Limit
	}
	q := s.q.redrive
	if f.DryRun {
		q = s.q.redriveDry
	}
	rows, err := db.Query(ctx, q, sub, since, until, limit)
	if err != nil {
		return nil, fmt.Errorf("outbound: redrive: %w", err)
	}
	out, err := pgx.CollectRows(rows, scanDelivery)
	if err != nil {
		return nil, fmt.Errorf("outbound: redrive: %w", err)
	}
	return out, nil
}

// DeleteDelivered deletes delivered rows older than retention (database
// time) in batches of batch rows and returns how many it deleted. Dead rows
// are kept for redrive.
func (s *Store) DeleteDelivered(ctx context.Context, db DBTX, retention time.Duration, batch int) (int64, error) {
	if retention < 0 || batch <= 0 {
		return 0, fmt.Errorf("outbound: delete delivered: retention %s and batch %d must be non-negative and positive", retention, batch)
	}
	var total int64
	for {
		tag, err := db.Exec(ctx, s.q.deleteDelivered, retention.Seconds(), batch)
		if err != nil {
			return total, fmt.Errorf("outbound: delete delivered: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) || ctx.Err() != nil {
			return total, ctx.Err()
		}
	}
}

// Overview is a subscription's state at a glance, for operators.
type Overview struct {
	Subscription Subscription
	Breaker      Breaker
	Pending      int64 // waiting, due or not (including those held by a pause)
	Delivering   int64 // attempts in flight
	Dead         int64
	// OldestPending is the creation time of the oldest pending delivery;
	// zero when none.
	OldestPending time.Time
}

// Overviews returns every subscription with its breaker and backlog,
// ordered by creation.
func (s *Store) Overviews(ctx context.Context, db DBTX) ([]Overview, error) {
	rows, err := db.Query(ctx, `SELECT s.id, s.endpoint_url, s.secrets, s.event_types, s.description, s.enabled,
			s.paused_at, s.paused_reason, s.created_at, s.updated_at,
			coalesce(b.state, 'closed'), coalesce(b.consecutive_failures, 0), b.failing_since, b.open_until, b.throttled_until,
			coalesce(c.pending, 0), coalesce(c.delivering, 0), coalesce(c.dead, 0), c.oldest
		FROM `+s.subs+` s
		LEFT JOIN `+s.brks+` b ON b.subscription_id = s.id
		LEFT JOIN (SELECT subscription_id,
				count(*) FILTER (WHERE status = 'pending') AS pending,
				count(*) FILTER (WHERE status = 'delivering') AS delivering,
				count(*) FILTER (WHERE status = 'dead') AS dead,
				min(created_at) FILTER (WHERE status = 'pending') AS oldest
			FROM `+s.dels+` WHERE status <> 'delivered' GROUP BY subscription_id) c ON c.subscription_id = s.id
		ORDER BY s.created_at, s.id`)
	if err != nil {
		return nil, fmt.Errorf("outbound: overviews: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Overview, error) {
		var (
			o                          Overview
			enabled                    bool
			paused, failing, open, thr *time.Time
			oldest                     *time.Time
			reason                     *string
			state                      string
			failures                   int32
		)
		err := r.Scan(&o.Subscription.ID, &o.Subscription.URL, &o.Subscription.Secrets, &o.Subscription.EventTypes,
			&o.Subscription.Description, &enabled, &paused, &reason, &o.Subscription.CreatedAt, &o.Subscription.UpdatedAt,
			&state, &failures, &failing, &open, &thr, &o.Pending, &o.Delivering, &o.Dead, &oldest)
		o.Subscription.Disabled = !enabled
		o.Breaker = Breaker{SubscriptionID: o.Subscription.ID, State: BreakerState(state), ConsecutiveFailures: int(failures)}
		for _, p := range []struct{ dst, src *time.Time }{
			{&o.Subscription.PausedAt, paused}, {&o.Breaker.FailingSince, failing}, {&o.Breaker.OpenUntil, open},
			{&o.Breaker.ThrottledUntil, thr}, {&o.OldestPending, oldest},
		} {
			if p.src != nil {
				*p.dst = *p.src
			}
		}
		if reason != nil {
			o.Subscription.PausedReason = *reason
		}
		return o, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbound: overviews: %w", err)
	}
	return out, nil
}
