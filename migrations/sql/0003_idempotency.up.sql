-- Idempotency keys for the HTTP middleware (package idempotency): one row per
-- (scope, key) whose first request completed with a recorded response. Run with
-- search_path set to the oncely schema (see 0001_inbox.up.sql).
--
-- The row is inserted (status 0) in the same transaction as the handler's
-- writes and updated with the response before that transaction commits, so a
-- committed row always holds a complete response and the effects it reports.
-- "In progress" is never stored: it is the open transaction itself, and a
-- crashed request (connection gone, transaction rolled back) leaves nothing
-- behind.
CREATE TABLE idempotency_keys (
    scope         text        NOT NULL,              -- '' unless the middleware scopes keys per client
    key           text        NOT NULL,              -- the Idempotency-Key header value
    fingerprint   bytea       NOT NULL,              -- SHA-256 of method, path, (query,) and the raw body's SHA-256
    status        integer     NOT NULL DEFAULT 0     -- the recorded HTTP status; 0 only inside the owning transaction
                              CHECK (status = 0 OR status BETWEEN 100 AND 999),
    header_names  text[]      NOT NULL DEFAULT '{}', -- replayed response headers, one entry per value
    header_values text[]      NOT NULL DEFAULT '{}',
    body          bytea       NOT NULL DEFAULT '',   -- the response body, byte for byte
    created_at    timestamptz NOT NULL DEFAULT now(),
    completed_at  timestamptz,
    expires_at    timestamptz NOT NULL,              -- after this the key is free again
    PRIMARY KEY (scope, key),
    CHECK (cardinality(header_names) = cardinality(header_values))
);

-- Cleanup deletes expired rows first, in bounded batches.
CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
