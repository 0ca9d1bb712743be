// Package console is the operator console: server-rendered pages that show
// what is stuck (consumer lag, dead letters, the outbox backlog and its
// parked rows, the inbox, outbound webhook endpoints) and, when actions are
// enabled, fix it (redrive dead letters, retry or discard parked outbox rows,
// redrive dead webhook deliveries, pause and resume endpoints).
//
// [New] returns an http.Handler that a service mounts under a path of its
// own (http.StripPrefix is enough: every link and redirect is relative), and
// `oncely console` serves it on its own. Every asset is embedded; the pages
// load nothing from any other origin.
//
// Safe by default:
//   - Read-only unless Config.Actions is set: a POST is refused with 403 and
//     no action form is shown.
//   - Every POST needs the CSRF token of the form (a double-submit cookie
//     compared in constant time) and passes net/http's cross-origin
//     protection (Sec-Fetch-Site and Origin checks).
//   - Config.Auth authenticates every request and names the operator with
//     [WithIdentity]; every action is logged with that name. [BearerToken]
//     is the authentication of the standalone command.
//   - No secret is rendered: webhook secrets never, subscription URLs through
//     outbound.RedactURL, and record headers whose names suggest a credential
//     (authorization, cookie, token, secret, password, api-key, signature)
//     are shown as "[redacted]".
//
// Redrive of dead letters goes through dlq.Redrive, which records a redrive
// grant in the consumers' inbox before producing: each redrive runs the
// message exactly once more. Redriving "every record matching the filter"
// first shows a dry run (the count, and the last matching offset of each
// partition); the confirmation applies that filter to the records up to
// those offsets only, so a record dead-lettered after the dry run is not
// redriven by it.
//
// Cost: the dead-letter pages and the overview read each dead-letter topic
// from its start on every view (dlq.List), and the inbox counts are exact
// (count(*)); on 100,000 dead letters and 1,000,000 inbox rows a page takes
// seconds, not milliseconds (make bench-console measures every page beside
// its raw queries). Lists stop at 500 rows; counts and actions cover all.
//
// Not done here: trends over time (the pages show the present), the inbox
// retention horizon, readiness, and brokers other than Kafka.
package console
