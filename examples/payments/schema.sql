-- The payments service's own tables. They live in the schema oncely's tables
-- use (the service's pool has it as its search_path), and are created at
-- start-up by the runner's BeforeStart, after oncely's migrations, under an
-- advisory lock so that several instances may start at once.
SELECT pg_advisory_xact_lock(hashtext('payments: schema.sql'));

CREATE TABLE IF NOT EXISTS payments (
	id         text PRIMARY KEY DEFAULT gen_random_uuid()::text,
	client     text NOT NULL,                    -- the API client that created it
	amount     bigint NOT NULL CHECK (amount > 0), -- minor units
	currency   text NOT NULL,
	status     text NOT NULL DEFAULT 'created',  -- created, then paid (Stripe's payment_intent.succeeded)
	refunded   bigint NOT NULL DEFAULT 0 CHECK (refunded BETWEEN 0 AND amount),
	created_at timestamptz NOT NULL DEFAULT now()
);

-- One row per effect of a consumed message: a capture or a refund. Exactly
-- once per message id, because the consumer's inbox claim and this insert
-- commit together.
CREATE TABLE IF NOT EXISTS ledger (
	id         bigserial PRIMARY KEY,
	payment_id text NOT NULL REFERENCES payments (id),
	kind       text NOT NULL,   -- capture, refund
	amount     bigint NOT NULL,
	message_id text NOT NULL,   -- the consumed message that wrote it
	created_at timestamptz NOT NULL DEFAULT now()
);

-- capture marks a created payment paid (Stripe's payment_intent.succeeded)
-- and records it in the ledger; refund adds a refund of amount to a paid
-- payment that has that much left. Each returns the amount, or NULL when the
-- payment is unknown or does not allow it (nothing is written then).
CREATE OR REPLACE FUNCTION capture(payment text, amount bigint, message text) RETURNS bigint
LANGUAGE sql AS $$
	WITH p AS (UPDATE payments SET status = 'paid' WHERE id = payment AND status = 'created' RETURNING id, payments.amount)
	INSERT INTO ledger (payment_id, kind, amount, message_id) SELECT p.id, 'capture', p.amount, message FROM p RETURNING ledger.amount
$$;

CREATE OR REPLACE FUNCTION refund(payment text, amount bigint, message text) RETURNS bigint
LANGUAGE sql AS $$
	WITH p AS (UPDATE payments SET refunded = refunded + refund.amount
		WHERE id = payment AND status = 'paid' AND refund.amount > 0 AND refunded + refund.amount <= payments.amount RETURNING id)
	INSERT INTO ledger (payment_id, kind, amount, message_id) SELECT p.id, 'refund', refund.amount, message FROM p RETURNING ledger.amount
$$;
