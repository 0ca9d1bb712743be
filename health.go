package oncely

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/otlptranslator"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
)

// Reason says why one component is not ready.
type Reason struct {
	Component string `json:"component"` // "database", `consumer group "orders"`, "outbox relay", `topic "orders.dlq"`, "runner"
	Reason    string `json:"reason"`
}

func (r Reason) String() string { return r.Component + ": " + r.Reason }

func reasonList(rs []Reason) string {
	s := make([]string, len(rs))
	for i, r := range rs {
		s[i] = r.String()
	}
	return strings.Join(s, "; ")
}

// NotReadyError is Ready's error: every component that is not ready, and why.
type NotReadyError struct{ Reasons []Reason }

func (e *NotReadyError) Error() string { return "oncely: not ready: " + reasonList(e.Reasons) }

// Unwrap returns each reason as an error ("component: reason"): a caller
// that does not import this package (the operator console, given
// Runner.Ready) lists them through the interface{ Unwrap() []error }.
func (e *NotReadyError) Unwrap() []error {
	errs := make([]error, len(e.Reasons))
	for i, r := range e.Reasons {
		errs[i] = errors.New(r.String())
	}
	return errs
}

// health is what the watch loop last found.
type health struct {
	mu      sync.Mutex
	db      error    // the last ping's failure
	missing []Reason // topics found missing by the last check
}

// Ready returns nil when Run has started every component and each is ready:
// the database answered the last ping, each consumer consumes with no
// partition waiting for the database, the relay publishes, and every
// consumed topic and dead-letter topic exists. Otherwise it returns a
// *NotReadyError naming each component that is not.
func (r *Runner) Ready() error {
	var rs []Reason
	if p := *r.phase.Load(); p != phaseRunning {
		rs = append(rs, Reason{"runner", p})
	}
	r.health.mu.Lock()
	if r.health.db != nil {
		rs = append(rs, Reason{"database", "unreachable: " + r.health.db.Error()})
	}
	rs = append(rs, r.health.missing...)
	r.health.mu.Unlock()
	if r.started.Load() {
		for _, e := range r.consumers {
			if why := e.c.NotReady(); why != "" {
				rs = append(rs, Reason{fmt.Sprintf("consumer group %q", e.group), why})
			}
		}
		for _, e := range r.workers {
			if why := e.w.NotReady(); why != "" {
				rs = append(rs, Reason{e.name, why})
			}
		}
		if r.relay != nil {
			if why := r.relay.NotReady(); why != "" {
				rs = append(rs, Reason{"outbox relay", why})
			}
		}
	}
	if len(rs) == 0 {
		return nil
	}
	return &NotReadyError{Reasons: rs}
}

// watch pings the database every HealthInterval and checks the topics every
// ten intervals, until ctx is done.
func (r *Runner) watch(ctx context.Context) {
	clients := make([]*kgo.Client, len(r.consumers)) // made on first use, one per consumer
	defer closeClients(clients)
	t := time.NewTicker(r.cfg.HealthInterval)
	defer t.Stop()
	for i := 0; ; i++ {
		dbErr := r.ping(ctx)
		if ctx.Err() != nil {
			return
		}
		r.health.mu.Lock()
		r.health.db = dbErr
		r.health.mu.Unlock()
		// The topics are checked whatever the database's state: /readyz
		// names every problem there is.
		if i%10 == 9 && len(r.consumers) > 0 {
			missing, topicErr := r.checkTopics(ctx, clients)
			if topicErr == nil {
				r.health.mu.Lock()
				r.health.missing = missing
				r.health.mu.Unlock()
			} else if ctx.Err() == nil {
				r.cfg.Logger.Warn("oncely: topic check failed", "err", topicErr)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// ping asks the database, unless every pool connection is in use (the
// components are then talking to it, and a ping would only queue behind
// them).
func (r *Runner) ping(ctx context.Context) error {
	if st := r.cfg.Pool.Stat(); st.AcquiredConns() >= st.MaxConns() {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, max(r.cfg.HealthInterval, time.Second))
	defer cancel()
	return r.cfg.Pool.Ping(ctx)
}

// kafkaClient makes a client for e's topic check: on the consumer's own
// brokers, with its own options. An error is the consumer's configuration's
// (ErrInvalidConfig): trying again would not mend it.
func (e *consumerEntry) kafkaClient() (*kgo.Client, error) {
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(e.brokers...)}, e.opts...)...)
	if err != nil {
		return nil, invalid(fmt.Sprintf("consumer group %q's Config.Brokers and ClientOpts (after the runner's KafkaOpts)", e.group),
			"no Kafka client can be made of them: %v", err)
	}
	return cl, nil
}

func closeClients(clients []*kgo.Client) {
	for _, cl := range clients {
		if cl != nil {
			cl.Close()
		}
	}
}

// checkTopics returns a Reason for each consumed topic and dead-letter topic
// that does not exist, asking each consumer's own brokers about its topics.
// clients, aligned with r.consumers, keeps the clients between calls: a nil
// one is made (and kept). clients nil: the clients are made for the check
// and closed after it.
func (r *Runner) checkTopics(ctx context.Context, clients []*kgo.Client) ([]Reason, error) {
	if clients == nil {
		clients = make([]*kgo.Client, len(r.consumers))
		defer closeClients(clients)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var missing []Reason
	seen := map[Reason]bool{}
	for i, e := range r.consumers {
		if clients[i] == nil {
			cl, err := e.kafkaClient()
			if err != nil {
				return nil, err
			}
			clients[i] = cl
		}
		m, err := e.checkTopics(ctx, clients[i])
		if err != nil {
			return nil, err
		}
		for _, reason := range m {
			if !seen[reason] {
				seen[reason] = true
				missing = append(missing, reason)
			}
		}
	}
	return missing, nil
}

// checkTopics returns a Reason for each of e's topics and dead-letter
// topics that cl's brokers say does not exist.
func (e *consumerEntry) checkTopics(ctx context.Context, cl *kgo.Client) ([]Reason, error) {
	needs := map[string]string{} // topic -> why the consumer needs it
	for _, t := range e.topics {
		needs[t] = fmt.Sprintf("consumed by group %q", e.group)
		if _, ok := needs[e.dlq(t)]; !ok {
			needs[e.dlq(t)] = fmt.Sprintf("the dead-letter topic of %q (group %q)", t, e.group)
		}
	}
	topics := slices.Sorted(maps.Keys(needs))
	if len(topics) == 0 {
		return nil, nil
	}
	details, err := kadm.NewClient(cl).ListTopics(ctx, topics...)
	if err != nil {
		return nil, fmt.Errorf("oncely: list topics of group %q on %s: %w", e.group, strings.Join(e.brokers, ", "), err)
	}
	var missing []Reason
	for _, t := range topics {
		d, ok := details[t]
		switch {
		case !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition):
			missing = append(missing, Reason{fmt.Sprintf("topic %q", t), "does not exist; it is " + needs[t]})
		case d.Err != nil:
			return nil, fmt.Errorf("oncely: topic %q: %w", t, d.Err)
		}
	}
	return missing, nil
}

// Handler serves GET /livez, GET /readyz and GET /metrics, and the routes
// added with Handle.
//
// /livez answers 200 while Run runs (and before), 503 once it returned.
// /readyz answers 200 "ready" when Ready returns nil, and 503 otherwise
// with one "component: reason" line each, or, when the request accepts
// application/json, {"ready": false, "reasons": [{"component", "reason"}]}.
func (r *Runner) Handler() http.Handler { return r.mux }

func (r *Runner) newMux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) {
		if *r.phase.Load() == phaseStopped {
			http.Error(w, "stopped", http.StatusServiceUnavailable)
			return
		}
		_, _ = fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", r.serveReady)
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, req *http.Request) {
		if r.metrics == nil {
			http.Error(w, "no metrics: Config.MeterProvider is set and Config.MetricsHandler is not", http.StatusNotFound)
			return
		}
		r.metrics.ServeHTTP(w, req)
	})
	return mux
}

func (r *Runner) serveReady(w http.ResponseWriter, req *http.Request) {
	err := r.Ready()
	var nr *NotReadyError
	errors.As(err, &nr)
	w.Header().Set("Cache-Control", "no-store")
	if strings.Contains(req.Header.Get("Accept"), "application/json") {
		body := struct {
			Ready   bool     `json:"ready"`
			Reasons []Reason `json:"reasons,omitempty"`
		}{Ready: err == nil}
		if nr != nil {
			body.Reasons = nr.Reasons
		}
		w.Header().Set("Content-Type", "application/json")
		if err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(body)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if err == nil {
		_, _ = fmt.Fprintln(w, "ready")
		return
	}
	w.WriteHeader(http.StatusServiceUnavailable)
	_, _ = fmt.Fprintln(w, "not ready")
	for _, r := range nr.Reasons {
		_, _ = fmt.Fprintln(w, r.String())
	}
}

// PrometheusExporter returns a metric reader to add to an SDK meter
// provider and the handler that serves its metrics in the Prometheus text
// format (OpenTelemetry names translated the Prometheus way:
// messaging.client.consumed.messages becomes
// messaging_client_consumed_messages_total), from a registry of its own with
// the Go runtime and process collectors next to them.
func PrometheusExporter() (sdkmetric.Reader, http.Handler, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	exp, err := otelprom.New(otelprom.WithRegisterer(reg),
		otelprom.WithTranslationStrategy(otlptranslator.UnderscoreEscapingWithSuffixes))
	if err != nil {
		return nil, nil, fmt.Errorf("oncely: prometheus exporter: %w", err)
	}
	return exp, promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}), nil
}
