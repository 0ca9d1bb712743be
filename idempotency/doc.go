// Package idempotency is net/http middleware for the Idempotency-Key header,
// backed by Postgres: a keyed request takes effect once, and every retry of
// it gets the first response back, byte for byte.
//
// # Stores
//
// [New] keeps the keys in Postgres, in the transaction the handler writes
// through ([Tx]): the response commits with the handler's writes, which is
// what the rest of this documentation describes. [NewWithStore] takes
// another [Store]: package idempotency/redisstore keeps the keys in Redis,
// for handlers whose effect is a call to another service. Every status,
// header and replay rule below holds for both; the Redis store cannot
// commit an effect with its response, and its package documentation says
// exactly which duplicate windows that leaves.
//
// # How it works
//
// Each keyed request runs in one Postgres transaction, which the handler
// joins through [Tx]:
//
//	BEGIN
//	  pg_try_advisory_xact_lock(hash(scope, key))       -- the "in progress" marker
//	    not available -> 409 + Retry-After               (another request holds the key now)
//	  INSERT idempotency_keys (scope, key, fingerprint)  -- ON CONFLICT: a committed row
//	    conflict      -> ROLLBACK; same fingerprint: replay with Idempotent-Replayed: true
//	                                 other fingerprint: 422
//	                     (an expired row is taken over instead: the key is free)
//	  handler(w, r)   -- writes through Tx(r.Context()); response captured, not sent
//	  UPDATE idempotency_keys SET status, headers, body
//	COMMIT
//	send the response
//
// The handler's writes and the recorded response commit together or not at
// all, so "in progress" is never a stored state: it is the open transaction
// and its advisory lock. When the process dies, or its connection breaks, or
// the handler panics, Postgres rolls the transaction back and the key is
// free again at once. Nothing is ever stranded "in progress", and no Redis
// (or other lock service) is involved.
//
// # Keys belong to a client
//
// A key is unique per client, not per server: two clients that pick the
// same key get two independent requests, and neither is ever replayed the
// other's response. The client is named by the authentication in front of
// the middleware: by default the one [WithClient] put in the request's
// context, or whatever Config.Scope returns. A keyed request that names no
// client is refused with 401 (fail closed). Config.GlobalScope is the
// explicit opt-in to one key space shared by every client.
//
// The fingerprint is SHA-256 over the method, the escaped path, the raw
// query (unless Config.IgnoreQuery), and the SHA-256 of the raw body bytes
// as received. The body
// is never parsed or re-serialised: two JSON documents that differ only in
// whitespace or key order are different requests (422 under one key). The
// middleware reads the body whole before claiming the key; the handler reads
// it again from memory (its request's Body, GetBody and ContentLength), and
// the caller's request is left as it came, but for its body read to the end.
//
// # What a client sees
//
//   - 2xx, 3xx, 4xx (per Config.StoreStatus): the handler ran and its effects
//     committed with the response. The first response carries every header
//     the handler set; every retry within the TTL gets the same status, the
//     recorded headers (Config.ReplayHeaders, default
//     [DefaultReplayHeaders]: Content-*, Location, ETag, Last-Modified,
//     Link; never Set-Cookie unless listed) and the same body byte for byte, plus Idempotent-Replayed:
//     true. Informational (1xx) responses are not forwarded.
//   - 409 with Retry-After: another request with the key is running right
//     now (or, rarely, was being replayed at that very moment). Retry.
//   - 422: the key was used for another request (another method, path,
//     query or body). Do not retry with this key.
//   - 401: the request names no client (see above); nothing ran.
//   - 400: no key on a [Middleware.Require] route, or an invalid key (empty,
//     too long, not visible ASCII; a quoted RFC 8941 string is accepted, as the
//     IETF draft specifies). 413: body above Config.MaxBodyBytes.
//   - 5xx from the handler (statuses StoreStatus refuses): the transaction was
//     rolled back, so the request had no effect and nothing was recorded; a
//     retry runs the handler afresh. 503: the database failed; the same holds.
//   - A handler whose statement failed (the transaction is aborted) cannot
//     commit anything: its 4xx/5xx answer passes through unrecorded, and a
//     success it answers anyway becomes a 500. Use a savepoint (tx.Begin)
//     around statements that are allowed to fail.
//
// # Where duplicates and losses are still possible
//
//   - Crash before COMMIT (process killed, connection lost, panic): the
//     handler's writes and the key vanish together; the client got no 2xx
//     and its retry runs afresh. No second effect, no lost effect.
//   - Crash after COMMIT and before the response reached the client: the
//     effects are committed; the retry gets the recorded response as a replay.
//   - Connection lost during COMMIT itself: the outcome is unknown to the
//     middleware, which answers 503; the retry resolves it (replay if the
//     commit happened, fresh run if not).
//   - Effects outside the transaction (an e-mail sent, a call to another
//     API) are not covered: they happen again if the transaction rolls back
//     and the request is retried. Send them through the outbox (package
//     outbox) inside Tx instead, so they too commit once.
//   - After the TTL the row expires and the key is free: a retry after that
//     runs afresh. Pick a TTL longer than any client keeps retrying.
//   - A request without a key on a [Middleware.Handler] route, or with a
//     method outside Config.Methods, passes through with no protection and
//     no transaction ([Tx] reports false).
//   - Changing Config.IgnoreQuery (or the version of this package's
//     fingerprint) makes retries of keys recorded before the change get 422.
//
// # Costs
//
// Each keyed request holds one pooled connection, and its transaction, for
// the handler's whole run; size the pool for the number of concurrent keyed
// requests, and keep handlers short. Responses are buffered in memory (at
// most Config.MaxResponseBytes) and cannot be streamed or flushed early.
//
// # Retention
//
// Rows expire Config.TTL (default 24 h) after the first request began.
// [Middleware.DeleteExpired] deletes expired rows in bounded batches, by
// database time; [Middleware.Run] does so every Config.CleanupInterval.
//
// # Telemetry
//
// Each request of Config.Methods is an "idempotency request" span
// (SpanRequest), the parent of the handler's spans, with its outcome:
// stored, not_stored, replayed, conflict (409), mismatch (422), refused (with
// the reason), failed (500), unavailable (503), aborted (a panic: no answer)
// or no_key. MetricRequests
// counts requests by outcome; MetricDuration is their duration in seconds.
package idempotency
