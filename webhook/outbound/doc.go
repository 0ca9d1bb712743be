// Package outbound delivers webhooks to subscriber endpoints: signed with
// Standard Webhooks headers, retried with exponential backoff and full
// jitter, held back per endpoint by a circuit breaker whose state every
// dispatcher and replica shares through Postgres, dead-lettered when they
// cannot be delivered, and redrivable.
//
// (Package webhook is the inbound side: it receives and verifies webhooks.)
//
// # The data path
//
//	business transaction
//	  ... the caller's writes ...
//	  Store.Enqueue(ctx, tx, Event{ID, Type, Payload})
//	      one INSERT ... SELECT: a webhook_deliveries row per matching
//	      enabled subscription, each with its own stable webhook-id
//	COMMIT                               (rolled back: nothing is ever sent)
//
//	Dispatcher (N workers; any number of dispatchers and replicas)
//	  claim, in one short transaction:
//	    lock subscriptions with due work and free slots (FOR NO KEY UPDATE SKIP LOCKED)
//	    pick their oldest due deliveries (FOR UPDATE SKIP LOCKED), at most
//	      MaxInFlightPerEndpoint in flight per endpoint, one probe if the breaker is open
//	    status = delivering, attempts + 1, lease token, lease expiry
//	  POST, signed, within RequestTimeout (shorter than the lease)
//	  record, in one short transaction fenced by the lease token:
//	    delivered | pending (retry at next_attempt_at) | dead
//	    and the endpoint's breaker row
//
// # Guarantees
//
//   - Nothing committed is lost. Every delivery ends delivered or dead, and
//     dead ones stay in the table, with the last HTTP status and error, until
//     they are redriven ([Store.Redrive], `oncely webhooks redrive`).
//     Delivered rows are deleted after DispatcherConfig.Retention.
//   - One attempt is made once. Claiming an attempt counts it and leases it
//     to one worker; another dispatcher cannot claim the delivery until the
//     outcome is recorded or the lease expires. The request is cancelled
//     before the lease expires (LeaseDuration > RequestTimeout), so two
//     attempts of one delivery are never in flight together, and each
//     (webhook-id, webhook-attempt) pair is sent at most once.
//   - Every attempt of a delivery carries the same webhook-id, and so does a
//     redrive: receivers deduplicate on it.
//   - All scheduling uses database time (now()): dispatchers with skewed
//     clocks agree. Only the signed webhook-timestamp is the dispatcher's
//     clock, as the receiver compares it with its own.
//
// # Where duplicates are possible
//
// Delivery is at least once. The receiver can see one delivery (one
// webhook-id) more than once, in these windows, which is why webhook-id is
// stable and why receivers must deduplicate on it (package webhook does, through
// the outbox's unique message id and the consumer's inbox):
//
//  1. The receiver processed the request, then the dispatcher crashed (or
//     lost Postgres) before the outcome was recorded. The lease expires, any
//     dispatcher makes the delivery due again, and the next attempt (attempt
//     number + 1) carries the same webhook-id.
//  2. The receiver processed the request but answered too late (after
//     RequestTimeout), or with a retryable status, or the answer was lost on
//     the way: the attempt counts as failed and is retried.
//  3. A dispatcher shutting down cancels attempts still in flight after
//     DrainTimeout; the receiver may have processed them; they are retried
//     at once.
//  4. An operator redrives a dead delivery that the receiver had processed
//     (say it answered 500 after committing).
//
// No order is kept: deliveries to one endpoint run concurrently (up to
// MaxInFlightPerEndpoint) and a retried one arrives after later ones.
// Receivers that care about order should compare something in the payload.
//
// # Outcomes
//
//   - 2xx: delivered.
//   - 408, 425, 429, 5xx, 3xx (redirects are not followed), network errors and
//     timeouts: retried. The delay before retry n is uniformly random in
//     [0, min(RetryMaxDelay, RetryBaseDelay * 2^(n-1))] (full jitter), unless
//     the answer carried Retry-After (seconds or an HTTP date): then the retry
//     waits exactly that long, capped at MaxRetryAfter, and the endpoint's
//     other deliveries wait as well. After MaxAttempts attempts: dead.
//   - Any other status (400, 401, 404, 410, 422, ...): dead at once.
//   - An endpoint URL that is not http(s), or a host that resolves to a
//     forbidden address (below): dead at once, without a connection.
//
// Response bodies are read up to MaxResponseBytes; the first 200 bytes of a
// failed answer's body are kept in last_error.
//
// # Circuit breaker
//
// Every subscription's endpoint has a breaker row (webhook_breakers) shared by
// all dispatchers of all replicas:
//
//   - closed: attempts flow. FailureThreshold consecutive failed attempts
//     (retryable outcomes) open it.
//   - open: the endpoint's deliveries are not claimed, so they are postponed
//     without spending attempts (their next_attempt_at is not touched; they
//     go out once the endpoint is healthy). After CoolDown, one probe may go.
//   - half-open: one probe attempt is in flight. The claim that picks it takes
//     the breaker's probe lease in the same statement, under the subscription
//     row lock, so only one probe runs at a time across the fleet; a probe
//     whose worker dies frees the slot when its lease expires. The probe's
//     success closes the breaker (so does any other success); its failure
//     reopens it for another cool-down. A terminal answer (a 410, say) to a
//     probe says nothing about health and lets the next probe go at once.
//
// An endpoint that has failed without a single success for PauseAfter gets
// its subscription paused (paused_at, paused_reason). Deliveries of a paused
// subscription are still enqueued and wait; [Store.ResumeSubscription] (or
// `oncely webhooks resume`) lifts the pause and resets the breaker.
//
// # Fairness
//
// No endpoint can take more than MaxInFlightPerEndpoint attempts in flight
// at once, fleet-wide: claims for one endpoint are serialized by its
// subscription row lock, and the in-flight count is read in a snapshot taken
// after the lock was granted. Endpoints are served oldest due work first, an
// endpoint at its cap is skipped, and an open breaker takes its endpoint out
// of the claim altogether, so a slow or dead endpoint occupies at most its cap
// of workers (and, once its breaker opens, none but a probe) while the others
// keep flowing.
//
// # Signatures
//
// Each request carries webhook-id, webhook-timestamp (the attempt's send
// time, unix seconds) and webhook-signature: "v1,<base64 HMAC-SHA256 over
// id.timestamp.body>" for each of the subscription's secrets ("whsec_" +
// base64), space-separated, so a secret is rotated by listing the new one
// beside the old one until the receiver has switched. It also carries
// webhook-attempt (1, 2, ...; reset by a redrive) and webhook-event-type, which
// are not signed. See [Sign].
//
// # Address safety
//
// By default the dispatcher refuses to connect to loopback, private (RFC
// 1918, IPv6 unique local), link-local, carrier-grade NAT, multicast,
// unspecified, reserved and documentation addresses. An IPv6 address that
// embeds an IPv4 address is judged by the IPv4 address: IPv4-mapped
// (::ffff:a.b.c.d), IPv4-compatible (::a.b.c.d), IPv4-translated
// (::ffff:0:a.b.c.d), NAT64 (64:ff9b::/96, 64:ff9b:1::/48), 6to4 (2002::/16),
// Teredo (2001::/32) and ISATAP; the forms no public endpoint uses
// (compatible, translated, local-use NAT64, Teredo) are refused whatever they
// embed. The cloud metadata and platform endpoints (169.254.169.254,
// 169.254.170.2, fd00:ec2::254, fd20:ce::254, 168.63.129.16, 100.100.100.200,
// 192.0.0.192 and others) are refused even inside an allow-listed range, and
// their names (metadata.google.internal, instance-data.ec2.internal, ...) are
// refused before they are resolved. The address check runs in
// net.Dialer.Control on the address actually being dialled, after name
// resolution, so a host name that resolves to an internal address, or
// changes its answer between a check and the connection (DNS rebinding), is
// refused all the same. Environment proxies are not used and redirects are
// not followed. DispatcherConfig.AllowNetworks opens chosen ranges, for tests
// and deliberate internal endpoints; a metadata address opens only when it
// is listed as a single address.
//
// # Credentials in endpoint URLs
//
// A subscription URL may carry credentials the endpoint needs
// (https://user:password@host/..., or a token in the query). They are stored
// as given, since every request needs them, and never shown: errors,
// last_error, log lines, spans, Subscription's String and LogValue and the
// oncely CLI show the URL through [RedactURL], which replaces the userinfo and
// the values of credential query parameters (token, key, sig, secret,
// password, signature, X-Amz-Credential, ...) with REDACTED. A credential in
// the path is not recognised: prefer the query or userinfo for one.
//
// # Metrics
//
// With the configured MeterProvider (default: the global one), per endpoint
// (attribute oncely.webhook.subscription.id): oncely.webhook.delivered,
// oncely.webhook.retried and oncely.webhook.dead counters, the
// oncely.webhook.request.duration histogram (seconds, with outcome and HTTP
// status), and two gauges read from the tables when metrics are collected:
// oncely.webhook.queue.depth (pending and in-flight deliveries) and
// oncely.webhook.breaker.state (0 closed, 1 half-open, 2 open). Each attempt
// is also a CLIENT span "POST" from the configured TracerProvider. Trace
// context is not sent to endpoints: they are outside the system.
package outbound
