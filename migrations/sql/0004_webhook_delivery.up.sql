-- Outbound webhook delivery (package webhook/outbound): subscriptions, one
-- delivery row per (subscription, event), and one circuit-breaker row per
-- subscription endpoint, shared by every dispatcher of every replica. Run with
-- search_path set to the oncely schema (see 0001_inbox.up.sql).
--
-- All times are database time (now()); dispatchers never write their own clock.

CREATE TABLE webhook_subscriptions (
    id            uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    endpoint_url  text        NOT NULL CHECK (endpoint_url ~* '^https?://'),
    -- Standard Webhooks signing secrets, "whsec_" + base64. Every request is
    -- signed with each of them (one v1 signature per secret), so a secret is
    -- rotated by adding the new one, letting the receiver switch, then
    -- removing the old one.
    secrets       text[]      NOT NULL CHECK (cardinality(secrets) BETWEEN 1 AND 10),
    -- Event types this subscription receives: exact names, "prefix.*" or
    -- "*". Empty: every type.
    event_types   text[]      NOT NULL DEFAULT '{}',
    description   text        NOT NULL DEFAULT '',
    -- enabled is the operator's switch: a disabled subscription gets no new
    -- deliveries and its pending ones wait. paused_at/paused_reason are set
    -- by the dispatcher when the endpoint has been failing for too long (or
    -- by an operator): new deliveries are still stored, none is attempted
    -- until the subscription is resumed.
    enabled       boolean     NOT NULL DEFAULT true,
    paused_at     timestamptz,
    paused_reason text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CHECK ((paused_at IS NULL) = (paused_reason IS NULL))
);

CREATE TABLE webhook_deliveries (
    id               bigserial   PRIMARY KEY,
    subscription_id  uuid        NOT NULL REFERENCES webhook_subscriptions (id) ON DELETE CASCADE,
    event_id         text        NOT NULL,
    event_type       text        NOT NULL,
    payload          bytea       NOT NULL,
    -- The Standard Webhooks webhook-id: the same on every attempt and after a
    -- redrive, so that receivers can deduplicate.
    webhook_id       text        NOT NULL UNIQUE,
    status           text        NOT NULL DEFAULT 'pending'
                                 CHECK (status IN ('pending', 'delivering', 'delivered', 'dead')),
    -- Attempts started, counted when an attempt is claimed (so an attempt
    -- whose worker died still counts).
    attempts         integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    -- The claim of the attempt in flight (status 'delivering'): the token
    -- fences the outcome (a worker that lost its lease records nothing), the
    -- expiry makes the delivery due again if the worker disappears.
    lease_token      uuid,
    lease_holder     text,
    lease_expires_at timestamptz,
    last_status      integer,     -- HTTP status of the last attempt; NULL when it got no response
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    delivered_at     timestamptz,
    dead_at          timestamptz,
    redrives         integer     NOT NULL DEFAULT 0,
    UNIQUE (subscription_id, event_id),
    CHECK ((status = 'delivering') = (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL))
);

-- Claims: the oldest due pending delivery of a subscription.
CREATE INDEX webhook_deliveries_due_idx ON webhook_deliveries (subscription_id, next_attempt_at)
    WHERE status = 'pending';
-- In-flight attempts per subscription (the per-endpoint cap) and expired leases.
CREATE INDEX webhook_deliveries_leased_idx ON webhook_deliveries (subscription_id, lease_expires_at)
    WHERE status = 'delivering';
CREATE INDEX webhook_deliveries_lease_expiry_idx ON webhook_deliveries (lease_expires_at)
    WHERE status = 'delivering';
-- Redrive selects dead deliveries by subscription and time of death.
CREATE INDEX webhook_deliveries_dead_idx ON webhook_deliveries (subscription_id, dead_at)
    WHERE status = 'dead';
-- Retention deletes the oldest delivered rows first.
CREATE INDEX webhook_deliveries_delivered_idx ON webhook_deliveries (delivered_at)
    WHERE status = 'delivered';

-- The circuit breaker of each subscription's endpoint. A missing row means
-- closed with no failures.
CREATE TABLE webhook_breakers (
    subscription_id      uuid        PRIMARY KEY REFERENCES webhook_subscriptions (id) ON DELETE CASCADE,
    state                text        NOT NULL DEFAULT 'closed'
                                     CHECK (state IN ('closed', 'open', 'half_open')),
    consecutive_failures integer     NOT NULL DEFAULT 0,
    failing_since        timestamptz,  -- first failure since the last success; drives automatic pausing
    opened_at            timestamptz,
    open_until           timestamptz,  -- end of the cool-down: then one probe may go
    probe_token          uuid,         -- lease token of the probe attempt in flight
    probe_expires_at     timestamptz,  -- the probe's lease expiry; after it another probe may go
    throttled_until      timestamptz,  -- from a Retry-After: no attempt to the endpoint before this
    updated_at           timestamptz NOT NULL DEFAULT now()
);
