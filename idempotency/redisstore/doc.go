// Package redisstore is a Redis store for package idempotency's
// Idempotency-Key middleware, for handlers whose effect is a call to
// another service (a payment provider, an e-mail API) rather than a
// Postgres write. It lives in a package of its own so that go-redis is
// compiled only into programs that import it.
//
//	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"}) // or a Cluster / failover client
//	store, err := redisstore.New(rdb, redisstore.Config{})
//	mw, err := idempotency.NewWithStore(store, idempotency.Config{})
//	http.Handle("/charges", authenticate(mw.Require(chargeHandler)))
//
// Everything the middleware does with Config (per-client keys through
// idempotency.WithClient or Config.Scope, the fingerprint, 409/422/400/401/
// 413, Config.ReplayHeaders, Config.StoreStatus, the TTL) is the same as
// with the Postgres store, and a replay is the same status, recorded
// headers and body byte for byte, with Idempotent-Replayed: true.
//
// # How it works
//
// A key (scope, key) is two Redis keys that share one hash tag, so they live
// in one Redis Cluster slot and every script below touches one slot only:
//
//	<Prefix>{<sha256(scope, key)>}        hash: token, holder, and once recorded resp (fingerprint, status, headers, body)
//	<Prefix>{<sha256(scope, key)>}:lock   string, with PX Config.LockTTL: the key is in progress
//
// A retry of a recorded key is one plain read: HGET resp, then replay (same
// fingerprint) or 422. A recorded response never changes until it expires,
// so the read needs no script. Every other step is one Lua script, atomic in
// Redis:
//
//	claim   recorded response?        -> replay (same fingerprint) or 422
//	        SET lock NX PX LockTTL fails? -> 409 with Retry-After
//	        token = HINCRBY token 1; holder = token:nonce
//	handler runs; every Config.Heartbeat:
//	extend  holder still ours?        -> SET lock holder PX LockTTL   (else: the handler's context is cancelled)
//	record  holder still ours and nothing recorded?
//	                                  -> HSET resp (expiring TTL after the claim, at least LockTTL); DEL lock
//	        else                      -> nothing stored; the client gets 409 and its retry the newer response
//	release (5xx, a status StoreStatus refuses, a panic, a failed record)
//	        holder still ours and nothing recorded? -> DEL lock
//
// The holder is a fencing token: its counter grows with every claim of the
// key (the random nonce keeps it unique should the record hash expire and
// the counter restart), and only the latest claim may extend the lock or
// record a response. A request whose lock lapsed, because its handler ran
// past LockTTL while its heartbeat could not reach Redis, therefore cannot
// store its response over that of a newer request that took the key: the
// newer response stays, every retry gets it, and the stale request's client
// gets 409 and then, on retry, that same response.
//
// Redis errors are answered 503 with Retry-After ("it is safe to retry"),
// both at the claim (nothing ran) and at the record (the handler ran; see
// below). No key is stranded: a lock always has an expiry, a failed record
// releases it if the claim is still the latest, and if Redis cannot be
// reached at all the lock lapses LockTTL after the last heartbeat.
//
// # What is guaranteed, and the windows that remain
//
// Redis cannot commit a response together with an effect in another
// service, so this store gives less than the Postgres one (whose response
// commits in the same transaction as the handler's writes):
//
//   - Concurrent requests with one key never run the handler concurrently
//     while their lock holds: the claim is one atomic script (25 identical
//     requests at once give one run; the others 409, then replays).
//   - Retries after a recorded response get it byte for byte; a different
//     request gets 422; a stale request never overwrites a newer response.
//   - Window 1: the handler's effect happened and the response was not
//     stored: the process was killed, Redis was unreachable at the record
//     (503), or the handler answered a status Config.StoreStatus refuses
//     (5xx). The key is then free (at once, or after LockTTL), and the
//     client's retry runs the handler again: the effect happens twice.
//   - Window 2: the handler runs longer than LockTTL while its heartbeat
//     cannot reach Redis (a network partition, a stalled process). The lock
//     lapses, a retry takes the key and runs the handler a second time. The
//     fencing token keeps the first response from being stored, but both
//     effects happened. The heartbeat cancels the handler's context once it
//     sees the key taken over; choose a LockTTL well above the Redis
//     round-trip times you expect.
//   - Redis itself: with asynchronous replication, a failover can lose the
//     latest writes (a claim or a recorded response), and a Redis without
//     persistence loses everything on restart; the key is then free and the
//     retry runs again. WAIT or AOF with fsync=always narrow this; Redis
//     never closes it.
//
// What a handler must do about windows 1 and 2: pass the key on. Hand the
// provider an idempotency key derived from idempotency.Key(r.Context())
// (e.g. scope + ":" + key as Stripe's Idempotency-Key, or as the e-mail's
// message id), so that the provider deduplicates the second call and
// answers it with the first one's result. Then the second run costs a call
// and no second effect. An effect in your own Postgres belongs in the
// Postgres store instead, where it commits with the response.
//
// # Webhook intakes without Postgres
//
// Package webhook's Receiver stores each delivery in the outbox, in
// Postgres, and the consumer's inbox deduplicates by the delivery id. An
// intake without Postgres is a webhook.Intake on this store: it verifies
// the signature, then runs its handler through the middleware with the
// provider's delivery id (webhook-id, Stripe's event id, X-GitHub-Delivery)
// as the key. A redelivery then replays the first answer below 500, a
// concurrent one gets 409 (providers retry it), and the windows above
// apply: the processing must pass the delivery id on to whatever it calls.
//
// # Costs
//
// A first request costs three round trips (a read that finds no response,
// the claim, the record) plus one heartbeat per Config.Heartbeat while the
// handler runs; a replay costs one plain read (HGET). Scripts
// are sent by SHA (EVALSHA) after their first use. Responses are kept in
// Redis memory for idempotency.Config.TTL (default 24 h): size Redis for
// the request rate times the TTL times the response size. Redis expires the
// keys itself; idempotency.Middleware.DeleteExpired and Run do nothing.
package redisstore
