// Package redisstore is a Redis store for package idempotency's
// Idempotency-Key middleware, for handlers whose effect is a call to
// another service (a payment provider, an e-mail API) rather than a
// Postgres write. It lives in a package of its own so that go-redis is
// compiled only into programs that import it.
//
//	rdb := redis.NewClient(&redis.Options{ // or a Cluster / failover client
//		Addr:                  "127.0.0.1:6379",
//		ContextTimeoutEnabled: true, // the request's context bounds each call
//	})
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
// A key (scope, key) is one Redis key, whose value is either the lock of
// the request that holds it or, once that request is done, its response:
//
//	<Prefix>{<sha256(scope, key)>}   "L" + token    PX Config.LockTTL: in progress
//	                                 "R" + resp     PX the TTL from the claim (at least LockTTL): the response
//	                                                (fingerprint, status, headers, body)
//
// The hash tag ({...}) makes the key's Cluster slot depend on the scope and
// the key only, never on braces a client put in them. Every step touches
// that one key, so every step is atomic in Redis:
//
//	claim   SET key "L"+token NX PX LockTTL GET      (one plain command)
//	        the key was free  -> taken: the handler runs
//	        it held "R"+resp  -> replay (same fingerprint) or 422
//	        it held "L"+...   -> 409 with Retry-After
//	handler runs; every Config.Heartbeat (script):
//	extend  key still our lock (or empty)? -> SET key our lock PX LockTTL
//	                                       (else: the handler's context is cancelled)
//	record  key still our lock (or empty)? (script)
//	                                  -> SET key "R"+resp PX (the TTL counted from the claim, at least LockTTL)
//	        else                      -> nothing stored; the client gets 409 and its retry the newer response
//	release (5xx, a status StoreStatus refuses, a panic, a failed record)
//	        key still our lock? -> DEL key (script)
//
// The token is a fencing token: 128 random bits drawn for each claim, so
// two claims never share one, and only the claim whose lock the key holds
// may extend it, record a response or release it. A request whose lock
// lapsed, because its handler ran past LockTTL while its heartbeat could not
// reach Redis, therefore cannot store its response over that of a newer
// request that took the key: the newer response (or lock) stays, every
// retry gets it, and the stale request's client gets 409 and then, on retry,
// that same response. If the lock lapsed and no request took the key, the
// key is empty and the request keeps its right to it: its next heartbeat
// takes the key again, and its record stores its response. (A newer request
// that took the key and then released it, its handler having failed,
// leaves it empty too; the stale request's response is then the one kept.)
//
// Redis errors are answered 503 with Retry-After ("it is safe to retry"),
// both at the claim (nothing ran) and at the record (the handler ran; see
// below). No key is stranded: a lock always has an expiry, a failed record
// releases it if the key still holds its lock, and if Redis cannot be
// reached at all the lock lapses LockTTL after the last heartbeat. A reply
// that is lost leaves no lock behind either: go-redis sends a command again
// after a connection error (Options.MaxRetries), and a claim whose retried
// SET finds its own token holds the key, as a record whose retried script
// finds its own response has recorded it; a claim that got no reply at all
// (its context ended, the connection broke for good) deletes its lock, if
// Redis took it, before it answers 503.
//
// # Running Redis for it
//
// Use maxmemory-policy noeviction (Redis's default). Every key of this
// store has an expiry, so the volatile-* and allkeys-* policies may evict a
// lock (a second request then runs the handler while the first still does)
// or a response (the retry runs the handler again). At maxmemory Redis
// refuses every SET, the claim's included; the claim then reads the key,
// so replays and 409 are still answered and only new keys get 503.
//
// Enable go-redis's ContextTimeoutEnabled, as above: without it a call waits
// the client's ReadTimeout whatever the request's context says, and the
// store's own bounds (a heartbeat's, a release's 5 seconds) do not apply.
//
// The claim is a write, so it goes to the primary, replays included: a
// replica cannot serve them. It needs Redis 7.0 or later (SET with both NX
// and GET).
//
// # What is guaranteed, and the windows that remain
//
// Redis cannot commit a response together with an effect in another
// service, so this store gives less than the Postgres one (whose response
// commits in the same transaction as the handler's writes):
//
//   - Concurrent requests with one key never run the handler concurrently
//     while their lock holds: the claim is one atomic command (25 identical
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
// A first request costs two round trips (the claim, a plain SET; the
// record, a short script) plus one heartbeat per Config.Heartbeat while the
// handler runs; a replay costs one (the claim's SET, which takes nothing
// and returns the response). Scripts are sent by SHA (EVALSHA) after their
// first use. Responses are kept in Redis memory for idempotency.Config.TTL (default
// 24 h): size Redis for the request rate times the TTL times the response
// size. Redis expires the
// keys itself; idempotency.Middleware.DeleteExpired and Run do nothing.
package redisstore
