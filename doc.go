// Package oncely runs a service's oncely components as one: the consumers
// (Kafka's, and through AddWorker those of JetStream and RabbitMQ), the
// outbox relay, the inbox and idempotency-key cleanups, outbound webhook
// dispatchers, and the HTTP servers that feed the outbox, configured once and
// shut down in order.
//
//	pool, err := oncely.NewPool(ctx, url, "payments") // search_path: the schema
//	r, err := oncely.New(oncely.Config{
//		Pool:     pool,
//		Schema:   "payments",
//		Brokers:  brokers,
//		Migrate:  true,
//		Relay:    &outbox.RelayConfig{},
//		HTTPAddr: ":8080", // GET /livez, /readyz, /metrics, and the routes of Handle
//	})
//	c, err := r.AddConsumer(consumer.Config{Group: "payments", Topics: []string{"payments"}, Handler: h})
//	keys, err := r.Idempotency(idempotency.Config{Scope: account}) // keys per client; cleanup runs with the others
//	r.Handle("POST /payments", keys.Require(api))
//	err = r.Run(ctx) // until ctx is done
//
// # What it does
//
// The schema, the pool, the brokers, the Kafka options, the logger and the
// telemetry providers are set once, in Config, and go into every component's
// configuration. A component configuration that names another schema or
// pool is an error at New or at the Add call, naming the field: a forgotten
// schema cannot fail at run time.
//
// Run starts the HTTP servers at once (/livez answers, /readyz says
// "starting"), applies the migrations when Config.Migrate is set, runs
// Config.BeforeStart (the application's own tables, say), and then checks,
// before any component starts: that the schema has every migration this
// build knows, and that every consumed topic and its dead-letter topic
// exist. A failed check is Run's error, naming what is missing. The pool is
// checked earlier, at New and AddConsumer: it must hold the connections the
// consumers' concurrency, the relay and the cleanups need together (see
// Config.ExtraConns).
//
// # Shutdown
//
// When Run's context is done, or any component fails, Run stops everything
// in this order within Config.ShutdownTimeout:
//
//  1. the HTTP servers stop taking connections; requests in flight finish;
//  2. the consumers drain (in-flight records finish, offsets are committed,
//     the member leaves the group), and so do the workers of other brokers
//     (AddWorker: a JetStream or RabbitMQ consumer), while those requests
//     finish;
//  3. the relay publishes what the last transactions and requests enqueued,
//     for up to Config.RelayFlushTimeout, and stops. What it does not
//     publish stays in the outbox for the next relay: nothing is lost.
//
// Run returns nil after a shutdown asked for through its context, and the
// failures otherwise, each naming its component.
//
// # Health
//
// Handler serves GET /livez (200 while the process runs), GET /readyz (200
// when every component is ready; otherwise 503 with one line per component
// that is not, and why, or JSON when the request accepts
// application/json) and GET /metrics (Config.MetricsHandler, or the
// Prometheus exporter of the meter provider the runner builds when
// Config.MeterProvider is unset). Readiness follows the database (the
// runner pings it every Config.HealthInterval), the consumers and the relay
// (each ready once running and while the database answers them) and the
// topics (checked again every ten intervals: a deleted topic shows).
package oncely
