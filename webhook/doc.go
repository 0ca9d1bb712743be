// Package webhook receives webhooks and acknowledges them only once they are
// durably stored, so that the work they ask for happens exactly once.
//
// A [Receiver] is an http.Handler for one endpoint. For each request it:
//
//  1. Refuses any method but POST (405, with Allow: POST).
//  2. Reads the raw body, at most Config.MaxBodyBytes (default 1 MiB). A
//     larger body is refused with 413 before anything else looks at it, so
//     an oversized request gets 413 whether or not it is signed.
//  3. Asks the [Verifier] to check the signature over those raw bytes and,
//     for schemes that sign a timestamp, that the timestamp is within the
//     tolerance in both directions (default 5 minutes). Nothing parses the
//     body before the signature is verified. A refusal is answered 401 (or
//     the status of the verifier's [*Error]) and writes nothing anywhere.
//     Its body names the reason alone ("webhook: no signature matches"):
//     never a header value, the number of secrets tried or the clock skew.
//     Those details go to Config.Logger, at Info.
//  4. Enqueues the raw body through the outbox (package outbox) to
//     Config.Topic, in one Postgres transaction of its own, with the
//     provider's delivery id as the message id.
//  5. Answers 202 Accepted only after that transaction committed. If the
//     database cannot be reached, the transaction fails or the commit is not
//     confirmed, it answers 503 Service Unavailable, and the provider
//     retries later.
//
// The relay (outbox.Relay) then publishes the delivery to Kafka with the
// delivery id in its message-id header, and a consumer (package consumer)
// processes it once per consumer group: its inbox deduplicates by that id.
//
// # Verifiers
//
// [NewStandardWebhooks] implements the Standard Webhooks scheme
// (https://www.standardwebhooks.com/), [NewStripe] Stripe's Stripe-Signature
// scheme and [NewGitHub] GitHub's X-Hub-Signature-256 scheme. Each takes several secrets at once, so
// a secret can be rotated without refusing deliveries: configure old and new
// together, then drop the old one. Every signature in a request is compared
// with every secret in constant time (hmac.Equal); any match passes. Other
// schemes plug in through the [Verifier] interface.
//
// # Duplicates
//
// Providers deliver at least once: they retry when the answer is lost, slow
// or not 2xx, and some redeliver by hand. Every retry of one delivery carries
// the same id (webhook-id, the Stripe event's id, X-GitHub-Delivery), so:
//
//   - A retry that arrives while the first delivery is still in the outbox
//     (pending, or sent and not yet removed by the outbox's retention) stores
//     nothing and is answered 202 too: the provider needs only a 2xx, and a
//     different answer would make it retry for nothing. Concurrent identical
//     deliveries serialize on the outbox's unique message id: one stores the
//     row, the others wait for its transaction and then see a duplicate (if
//     it rolled back, the next one stores the row instead).
//   - A retry that arrives after the outbox removed the sent row is enqueued
//     and published again, with the same message id; the consumer's inbox
//     finds the id and skips it. Exactly-once therefore rests on the inbox:
//     its retention (package dedup) must exceed the longest time a provider
//     may redeliver (Stripe retries for up to three days; manual redelivery
//     in GitHub reaches back a few days; Standard Webhooks senders typically
//     retry for a day or more). After that, a redelivery is processed again.
//   - A 503 after a commit whose confirmation was lost (the connection broke
//     during COMMIT) may hide a stored delivery: the provider's retry is then
//     a duplicate and is answered 202. Nothing is lost and nothing doubles.
//
// A delivery is never acknowledged before it is committed. The converse
// does not hold, as the last point shows: a stored delivery may be answered
// 503, and the provider's retry then dedups.
//
// # Replays
//
// For Standard Webhooks and Stripe the signature covers the delivery id (the
// webhook-id header; Stripe's id in the body) and a timestamp, so a captured
// request cannot be replayed once the tolerance has passed, and a replay
// within it is a duplicate. GitHub's scheme signs the body only: there is no
// timestamp, so replay protection rests on deduplication by X-GitHub-Delivery,
// which lasts as long as the inbox retains the id; and that header is not
// covered by the signature, so a captured body replayed under a fresh
// delivery id is accepted as a new delivery. Serve GitHub's endpoint over
// TLS only, and make the processing of GitHub events idempotent on something
// in the body where a replay would do harm.
//
// Several providers or endpoints whose delivery ids might collide can share
// one outbox by giving each Receiver its own Config.IDPrefix.
//
// # Telemetry
//
// Each request is a "webhook receive" span (SpanReceive) with its outcome
// (accepted, duplicate, refused with the reason, failed); the stored row
// carries its trace context, which the relay and the consumers continue.
// MetricInboundRequests counts requests by outcome and refusal reason
// (a burst of signature_mismatch is a misconfigured secret or an attack);
// MetricInboundDuration is their duration in seconds.
//
// # Without Postgres
//
// A Receiver needs Postgres (the outbox). An endpoint whose processing is a
// call to another service, with only Redis at hand, is an [Intake]: it
// verifies each request as a Receiver does, then runs the processing
// through package idempotency's middleware, on any store (package
// idempotency/redisstore's for Redis), with the delivery id as the key,
// and answers what the processing answered; a redelivery gets that answer
// replayed. redisstore's package documentation names the duplicate windows
// that remain (the processing must pass the delivery id on to what it
// calls).
package webhook
