package outbound

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Defaults of DispatcherConfig.
const (
	DefaultWorkers                = 16
	DefaultMaxInFlightPerEndpoint = 4
	DefaultRequestTimeout         = 15 * time.Second
	DefaultLeaseMargin            = 30 * time.Second // LeaseDuration = RequestTimeout + this
	DefaultPollInterval           = 500 * time.Millisecond
	DefaultMaxAttempts            = 12
	DefaultRetryBaseDelay         = 5 * time.Second
	DefaultRetryMaxDelay          = time.Hour
	DefaultMaxRetryAfter          = time.Hour
	DefaultMaxResponseBytes       = 64 << 10
	DefaultRetention              = 7 * 24 * time.Hour
	DefaultCleanupInterval        = time.Minute
	DefaultCleanupBatch           = 1000
	DefaultUserAgent              = "oncely-webhooks/1"

	DefaultFailureThreshold = 5
	DefaultCoolDown         = 30 * time.Second
	DefaultPauseAfter       = 24 * time.Hour
)

// BreakerConfig shapes the circuit breaker of every endpoint. Its state lives
// in Postgres (table webhook_breakers), so all dispatchers of all replicas
// share it; they should share this configuration too.
type BreakerConfig struct {
	// FailureThreshold is how many consecutive failed attempts (retryable
	// answers: 408, 425, 429, 5xx, other non-2xx that are not terminal, and
	// network errors) open the breaker. Default 5.
	FailureThreshold int
	// CoolDown is how long an open breaker holds the endpoint's deliveries
	// (without spending their attempts) before one probe attempt is let
	// through. Default 30s.
	CoolDown time.Duration
	// PauseAfter pauses the subscription (Subscription.PausedAt, with a
	// reason) when its endpoint has failed without a single success for
	// this long; its deliveries then wait for ResumeSubscription. Default
	// 24h; negative: never pause automatically.
	PauseAfter time.Duration
}

// DispatcherConfig configures a Dispatcher. Zero values take the documented
// defaults.
type DispatcherConfig struct {
	// Store is the schema of the webhook tables. Default as in Config.
	Store Config
	// Pool runs the dispatcher's short transactions (claims, outcomes).
	// Required. Workers hold a connection only to claim and to record an
	// outcome, never during a request, so a pool much smaller than Workers
	// does (workers then queue for it briefly).
	Pool *pgxpool.Pool

	// Workers is how many attempts this dispatcher makes at once. Default 16.
	Workers int
	// MaxInFlightPerEndpoint caps the attempts in flight to one endpoint
	// (subscription) across all dispatchers and replicas (give them all the
	// same value), so that a slow or dead endpoint occupies at most this many
	// workers and the others keep flowing. Default 4.
	MaxInFlightPerEndpoint int

	// RequestTimeout bounds one attempt: connecting, sending, and reading
	// the answer. Default 15s.
	RequestTimeout time.Duration
	// LeaseDuration is how long a claimed attempt is reserved for its
	// worker. If the worker disappears (process killed, connection lost),
	// the delivery becomes due again when the lease expires and is retried
	// with the same webhook-id and the next attempt number. It must exceed
	// RequestTimeout: the request is cancelled before the lease ends, so no
	// two attempts of a delivery are in flight at once. Default
	// RequestTimeout + 30s.
	LeaseDuration time.Duration
	// PollInterval is how often an idle dispatcher looks for due deliveries.
	// Default 500ms.
	PollInterval time.Duration
	// DrainTimeout is how long Run, once its context is done, lets attempts
	// in flight finish before cancelling them (a cancelled attempt is
	// recorded as a retry, due at once). Default RequestTimeout.
	DrainTimeout time.Duration

	// MaxAttempts is how many attempts a delivery gets; after the last one
	// fails it is dead. Default 12.
	MaxAttempts int
	// RetryBaseDelay and RetryMaxDelay shape the delay before retry n:
	// uniformly random in [0, min(RetryMaxDelay, RetryBaseDelay*2^(n-1))]
	// (exponential backoff with full jitter). Defaults 5s and 1h.
	RetryBaseDelay, RetryMaxDelay time.Duration
	// MaxRetryAfter caps a Retry-After header (seconds or an HTTP date) on
	// a retryable answer. The retry waits as long as the header says, up to
	// this cap, and the endpoint's other deliveries wait as well. Default
	// 1h.
	MaxRetryAfter time.Duration
	// MaxResponseBytes bounds how much of a response body is read; the rest
	// is discarded unread. Default 64 KiB.
	MaxResponseBytes int64

	// Breaker shapes the per-endpoint circuit breakers.
	Breaker BreakerConfig

	// AllowNetworks lists address ranges that may be dialled although they
	// are loopback, private, link-local, CGNAT, multicast, unspecified,
	// reserved or documentation addresses, or embed one, which are refused
	// by default (checked on the resolved address at dial time). For tests
	// (127.0.0.0/8) and deliberate internal endpoints. A cloud metadata or
	// platform address (169.254.169.254, 168.63.129.16, ...) opens only when
	// it is listed as a single address (/32, /128). Default: none.
	AllowNetworks []netip.Prefix
	// TLSClientConfig is used for https endpoints. Default: Go's defaults
	// (system roots, TLS 1.2+).
	TLSClientConfig *tls.Config
	// UserAgent is sent with every request. Default "oncely-webhooks/1".
	UserAgent string

	// Retention is how long delivered rows are kept before they are deleted
	// in batches of CleanupBatch every CleanupInterval. Dead rows are kept
	// for redrive. Default 7 days; negative: never delete.
	Retention       time.Duration
	CleanupInterval time.Duration // default 1m
	CleanupBatch    int           // default 1000

	// ID names this dispatcher in lease records (webhook_deliveries.lease_holder)
	// and logs. Default: host name, process id and a random suffix.
	ID string

	// MeterProvider and TracerProvider instrument the dispatcher: metrics per
	// endpoint (see the package documentation) and a CLIENT span per
	// attempt. Default: the global providers.
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
	// Logger receives the dispatcher's logs. Default: discard.
	Logger *slog.Logger
}

// withDefaults validates cfg and fills in the defaults. Errors name the field.
func (cfg DispatcherConfig) withDefaults() (DispatcherConfig, error) {
	const p = "outbound: DispatcherConfig."
	if cfg.Pool == nil {
		return cfg, errors.New(p + "Pool: a *pgxpool.Pool is required")
	}
	for _, f := range []struct {
		name string
		v    int64
	}{
		{"Workers", int64(cfg.Workers)}, {"MaxInFlightPerEndpoint", int64(cfg.MaxInFlightPerEndpoint)},
		{"RequestTimeout", int64(cfg.RequestTimeout)}, {"LeaseDuration", int64(cfg.LeaseDuration)},
		{"PollInterval", int64(cfg.PollInterval)}, {"DrainTimeout", int64(cfg.DrainTimeout)},
		{"MaxAttempts", int64(cfg.MaxAttempts)}, {"RetryBaseDelay", int64(cfg.RetryBaseDelay)},
		{"RetryMaxDelay", int64(cfg.RetryMaxDelay)}, {"MaxRetryAfter", int64(cfg.MaxRetryAfter)},
		{"MaxResponseBytes", cfg.MaxResponseBytes}, {"CleanupInterval", int64(cfg.CleanupInterval)},
		{"CleanupBatch", int64(cfg.CleanupBatch)}, {"Breaker.FailureThreshold", int64(cfg.Breaker.FailureThreshold)},
		{"Breaker.CoolDown", int64(cfg.Breaker.CoolDown)},
	} {
		if f.v < 0 {
			return cfg, fmt.Errorf("%s%s: must not be negative, got %d", p, f.name, f.v)
		}
	}
	cfg.Workers = cmp.Or(cfg.Workers, DefaultWorkers)
	cfg.MaxInFlightPerEndpoint = cmp.Or(cfg.MaxInFlightPerEndpoint, DefaultMaxInFlightPerEndpoint)
	cfg.RequestTimeout = cmp.Or(cfg.RequestTimeout, DefaultRequestTimeout)
	cfg.LeaseDuration = cmp.Or(cfg.LeaseDuration, cfg.RequestTimeout+DefaultLeaseMargin)
	cfg.PollInterval = cmp.Or(cfg.PollInterval, DefaultPollInterval)
	cfg.DrainTimeout = cmp.Or(cfg.DrainTimeout, cfg.RequestTimeout)
	cfg.MaxAttempts = cmp.Or(cfg.MaxAttempts, DefaultMaxAttempts)
	cfg.RetryBaseDelay = cmp.Or(cfg.RetryBaseDelay, DefaultRetryBaseDelay)
	cfg.RetryMaxDelay = cmp.Or(cfg.RetryMaxDelay, DefaultRetryMaxDelay)
	cfg.MaxRetryAfter = cmp.Or(cfg.MaxRetryAfter, DefaultMaxRetryAfter)
	cfg.MaxResponseBytes = cmp.Or(cfg.MaxResponseBytes, DefaultMaxResponseBytes)
	cfg.Retention = cmp.Or(cfg.Retention, DefaultRetention)
	cfg.CleanupInterval = cmp.Or(cfg.CleanupInterval, DefaultCleanupInterval)
	cfg.CleanupBatch = cmp.Or(cfg.CleanupBatch, DefaultCleanupBatch)
	cfg.UserAgent = cmp.Or(cfg.UserAgent, DefaultUserAgent)
	cfg.Breaker.FailureThreshold = cmp.Or(cfg.Breaker.FailureThreshold, DefaultFailureThreshold)
	cfg.Breaker.CoolDown = cmp.Or(cfg.Breaker.CoolDown, DefaultCoolDown)
	cfg.Breaker.PauseAfter = cmp.Or(cfg.Breaker.PauseAfter, DefaultPauseAfter)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	if cfg.ID == "" {
		host, _ := os.Hostname()
		cfg.ID = fmt.Sprintf("%s:%d:%s", cmp.Or(host, "unknown"), os.Getpid(), randomSuffix())
	}
	switch {
	case cfg.LeaseDuration <= cfg.RequestTimeout:
		return cfg, fmt.Errorf("%sLeaseDuration: %s must exceed RequestTimeout %s", p, cfg.LeaseDuration, cfg.RequestTimeout)
	case cfg.RetryMaxDelay < cfg.RetryBaseDelay:
		return cfg, fmt.Errorf("%sRetryMaxDelay: %s is below RetryBaseDelay %s", p, cfg.RetryMaxDelay, cfg.RetryBaseDelay)
	case cfg.MaxAttempts > 1000:
		return cfg, fmt.Errorf("%sMaxAttempts: %d is above 1000", p, cfg.MaxAttempts)
	case len(cfg.ID) > 200:
		return cfg, fmt.Errorf("%sID: %d bytes, at most 200", p, len(cfg.ID))
	}
	for i, n := range cfg.AllowNetworks {
		if !n.IsValid() {
			return cfg, fmt.Errorf("%sAllowNetworks[%d]: invalid prefix", p, i)
		}
	}
	return cfg, nil
}
