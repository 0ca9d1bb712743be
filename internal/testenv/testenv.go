// Package testenv gives oncely's integration tests, the example's and the
// CLI's tests their services, following the rules in the design brief. It is
// a module of its own (it needs testcontainers and kfake, which the module
// users import must not carry); the library packages' own tests use
// internal/pgtest, whose helpers this package shares.
//
// Postgres: DATABASE_URL when set; otherwise, when a container engine is
// reachable, one testcontainers Postgres container per test package (image
// from ONCELY_TEST_POSTGRES_IMAGE, default postgres:16-alpine); otherwise the
// test fails with a message saying how to provide one. Every test gets its own
// schema, so tests run in parallel.
//
// Kafka: KAFKA_BROKERS when set; otherwise a Redpanda container when
// ONCELY_TEST_CONTAINERS=1 and an engine is reachable; otherwise an in-process
// kfake cluster per test.
package testenv

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/api/types/network"
	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
	"github.com/testcontainers/testcontainers-go/modules/redpanda"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/internal/pgtest"
)

// DefaultPostgresImage is the image used for the testcontainers path unless
// ONCELY_TEST_POSTGRES_IMAGE says otherwise.
const DefaultPostgresImage = "postgres:16-alpine"

var shared struct {
	once      sync.Once
	url       string
	err       error
	pg        *tcpostgres.PostgresContainer
	rpOnce    sync.Once
	rpBrokers []string
	rpErr     error
	rp        *redpanda.Container
}

// Main runs the package's tests, checks that every goroutine they started
// has stopped (pgtest.CheckLeaks), and then removes any container the
// package started. Use it from TestMain: os.Exit(testenv.Main(m)).
func Main(m *testing.M) int {
	code := pgtest.CheckLeaks(m.Run())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if shared.pg != nil {
		if err := shared.pg.Terminate(ctx); err != nil {
			fmt.Fprintf(os.Stderr, "testenv: terminate postgres container: %v\n", err)
		}
	}
	if shared.rp != nil {
		if err := shared.rp.Terminate(ctx); err != nil {
			fmt.Fprintf(os.Stderr, "testenv: terminate redpanda container: %v\n", err)
		}
	}
	return code
}

// ContainerEngineReachable reports whether testcontainers can reach a Docker
// API (Docker, or podman's compatible service through DOCKER_HOST).
func ContainerEngineReachable(ctx context.Context) bool {
	if os.Getenv("DOCKER_HOST") == "" {
		if _, err := os.Stat("/var/run/docker.sock"); err != nil {
			return false
		}
	}
	p, err := testcontainers.NewDockerProvider()
	if err != nil {
		return false
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return p.Health(ctx) == nil
}

// PostgresImage returns the image for the testcontainers path.
func PostgresImage() string {
	if img := os.Getenv("ONCELY_TEST_POSTGRES_IMAGE"); img != "" {
		return img
	}
	return DefaultPostgresImage
}

// noPostgres says how to give the tests a Postgres.
const noPostgres = "no Postgres for the tests: set DATABASE_URL " +
	"(e.g. DATABASE_URL='postgres://postgres@127.0.0.1:5432/test?sslmode=disable', " +
	"or run `make test`, which sets it for the local server), or make a container engine " +
	"reachable for testcontainers-go (Docker, or DOCKER_HOST pointing at podman's service: " +
	"`make test-containers` sets that up)"

// DatabaseURL returns the connection string of the package's Postgres,
// starting a container the first time if DATABASE_URL is unset.
func DatabaseURL(t testing.TB) string {
	t.Helper()
	shared.once.Do(func() {
		if u := os.Getenv("DATABASE_URL"); u != "" {
			shared.url = u
			return
		}
		ctx := context.Background()
		if !ContainerEngineReachable(ctx) {
			shared.err = errors.New(noPostgres)
			return
		}
		ctr, url, err := runPostgres(ctx, "package "+packageName())
		if err != nil {
			shared.err = err
			if ctr != nil {
				_ = ctr.Terminate(ctx)
			}
			return
		}
		shared.pg, shared.url = ctr, url
	})
	if shared.err != nil {
		t.Fatalf("testenv: %v", shared.err)
	}
	return shared.url
}

// RunLabel is the label every container testenv starts carries, with the
// value of ONCELY_TEST_RUN_ID (scripts/test-containers.sh sets it and removes
// the run's containers afterwards, in case a test binary died before its
// cleanup).
const RunLabel = "oncely.test-run"

// runPostgres starts a Postgres container (PostgresImage, database, user and
// password "oncely") and returns it with its connection string. It prints
// the container's id to stderr, so that logs show which databases came from
// containers. On error the container, if any, is returned for cleanup.
func runPostgres(ctx context.Context, owner string, opts ...testcontainers.ContainerCustomizer) (*tcpostgres.PostgresContainer, string, error) {
	start := time.Now()
	img := PostgresImage()
	ctr, err := tcpostgres.Run(ctx, img, append([]testcontainers.ContainerCustomizer{
		tcpostgres.WithDatabase("oncely"),
		tcpostgres.WithUsername("oncely"),
		tcpostgres.WithPassword("oncely"),
		tcpostgres.BasicWaitStrategies(),
		// Lets a runner remove what a killed test binary left behind (no Ryuk).
		testcontainers.WithLabels(map[string]string{RunLabel: os.Getenv("ONCELY_TEST_RUN_ID")}),
	}, opts...)...)
	if err != nil {
		return ctr, "", fmt.Errorf("start postgres container (%s): %w", img, err)
	}
	url, err := ctr.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		return ctr, "", fmt.Errorf("postgres container %.12s: connection string: %w", ctr.GetContainerID(), err)
	}
	fmt.Fprintf(os.Stderr, "testenv: postgres container %.12s (%s) for %s ready in %s at %s\n",
		ctr.GetContainerID(), img, owner, time.Since(start).Round(time.Millisecond), url)
	return ctr, url, nil
}

// packageName is the import path's last element of the test binary's package.
func packageName() string {
	name := strings.TrimSuffix(filepath.Base(os.Args[0]), ".test")
	return cmp.Or(name, "tests")
}

// Container is a Postgres container that belongs to one test.
type Container struct {
	*tcpostgres.PostgresContainer
	URL string // stays valid across Stop and Start: the host port is fixed
}

// PostgresContainer starts a Postgres container for the test alone, for tests
// that stop, start or otherwise break their database. Its 5432/tcp is bound
// to a host port picked up front, so the URL is unchanged after the container
// is stopped and started again. The container is terminated when the test
// ends (testcontainers.CleanupContainer: without Ryuk nothing else would).
//
// It needs a container engine. Without one the test is skipped when
// DATABASE_URL is set (the rest of the suite runs against that server, which
// a test must not stop) and fails otherwise, saying how to provide one.
func PostgresContainer(t testing.TB) *Container {
	t.Helper()
	ctx := context.Background()
	if !ContainerEngineReachable(ctx) {
		if os.Getenv("DATABASE_URL") != "" {
			t.Skip("testenv: this test stops and restarts a Postgres of its own, which needs a container engine " +
				"for testcontainers-go, and none is reachable (DATABASE_URL names a shared server it must not stop); " +
				"run `make test-containers`, or start Docker, or point DOCKER_HOST at podman's service")
		}
		t.Fatalf("testenv: %s", noPostgres)
	}
	port, err := freePort()
	if err != nil {
		t.Fatalf("testenv: pick a host port: %v", err)
	}
	ctr, url, err := runPostgres(ctx, t.Name(), testcontainers.WithHostConfigModifier(func(hc *container.HostConfig) {
		hc.PortBindings = network.PortMap{
			network.MustParsePort("5432/tcp"): {{HostPort: strconv.Itoa(port)}},
		}
	}))
	testcontainers.CleanupContainer(t, ctr)
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	return &Container{PostgresContainer: ctr, URL: url}
}

// freePort returns a TCP port that was free on every interface a moment ago.
func freePort() (int, error) {
	l, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", ":0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// DB is a test's own schema in the package's Postgres.
type DB = pgtest.DB

// Postgres creates a schema for the test in the package's Postgres (see
// DatabaseURL), returns a pool whose search_path is that schema, and drops
// the schema when the test ends.
func Postgres(t testing.TB) *DB {
	t.Helper()
	return pgtest.PostgresAt(t, DatabaseURL(t))
}

// PostgresAt is Postgres on the server at url, e.g. a test's own Container.
func PostgresAt(t testing.TB, url string) *DB {
	t.Helper()
	return pgtest.PostgresAt(t, url)
}

// Migrated is Postgres with every migration applied to the test's schema.
func Migrated(t testing.TB) *DB {
	t.Helper()
	return pgtest.Migrate(t, Postgres(t))
}

// NewPool opens a pool whose connections use schema as their search_path
// (pgtest.NewPool).
func NewPool(ctx context.Context, url, schema string, maxConns int32) (*pgxpool.Pool, error) {
	return pgtest.NewPool(ctx, url, schema, maxConns)
}

// PostgresProxy is a TCP proxy in front of the package's Postgres that a
// test cuts off to make the database unreachable (pgtest.PostgresProxy).
type PostgresProxy = pgtest.PostgresProxy

// NewPostgresProxy starts a proxy to the package's Postgres, stopped when
// the test ends.
func NewPostgresProxy(t testing.TB) *PostgresProxy {
	t.Helper()
	return pgtest.NewPostgresProxyAt(t, DatabaseURL(t))
}

// UniqueName returns prefix followed by 12 random hex digits, usable as a
// schema, topic or group name.
func UniqueName(prefix string) string { return pgtest.UniqueName(prefix) }

// Kafka is a test's Kafka: its seed brokers and, when in-process, the kfake
// cluster for fault injection.
type Kafka struct {
	Brokers []string
	Cluster *kfake.Cluster // nil for an external broker or a container
	// ClientOpts connect a client to it (TLS and SASL for SecureKafka).
	ClientOpts []kgo.Opt
}

// NewKafka returns the test's Kafka per the package rules. opts apply to the
// in-process kfake cluster only.
func NewKafka(t testing.TB, opts ...kfake.Opt) *Kafka {
	t.Helper()
	if b := os.Getenv("KAFKA_BROKERS"); b != "" {
		return &Kafka{Brokers: strings.Split(b, ",")}
	}
	if os.Getenv("ONCELY_TEST_CONTAINERS") == "1" && ContainerEngineReachable(context.Background()) {
		return &Kafka{Brokers: redpandaBrokers(t)}
	}
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1)}, opts...)...)
	if err != nil {
		t.Fatalf("testenv: start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return &Kafka{Brokers: c.ListenAddrs(), Cluster: c}
}

func redpandaBrokers(t testing.TB) []string {
	shared.rpOnce.Do(func() {
		ctx := context.Background()
		img := os.Getenv("ONCELY_TEST_REDPANDA_IMAGE")
		if img == "" {
			img = "docker.redpanda.com/redpandadata/redpanda:v24.2.4"
		}
		ctr, err := redpanda.Run(ctx, img, redpanda.WithAutoCreateTopics())
		if err != nil {
			shared.rpErr = fmt.Errorf("start redpanda container (%s): %w", img, err)
			if ctr != nil {
				_ = ctr.Terminate(ctx)
			}
			return
		}
		shared.rp = ctr
		b, err := ctr.KafkaSeedBroker(ctx)
		shared.rpBrokers, shared.rpErr = []string{b}, err
	})
	if shared.rpErr != nil {
		t.Fatalf("testenv: %v", shared.rpErr)
	}
	return shared.rpBrokers
}

// CreateTopic creates a uniquely named topic with the given partition count
// and returns its name.
func (k *Kafka) CreateTopic(t testing.TB, prefix string, partitions int32) string {
	t.Helper()
	topic := UniqueName(prefix)
	k.CreateTopicNamed(t, topic, partitions)
	return topic
}

// CreateTopicNamed creates the named topic and returns its id (newer
// request versions name topics by id only).
func (k *Kafka) CreateTopicNamed(t testing.TB, topic string, partitions int32) kadm.TopicID {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, k.ClientOpts...)...)
	if err != nil {
		t.Fatalf("testenv: kafka client: %v", err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := kadm.NewClient(cl).CreateTopic(ctx, partitions, 1, nil, topic)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		t.Fatalf("testenv: create topic %s: %v", topic, err)
	}
	return resp.ID
}

// Client returns a plain producer/admin client for the test, closed at cleanup.
func (k *Kafka) Client(t testing.TB, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append(append([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, k.ClientOpts...), opts...)...)
	if err != nil {
		t.Fatalf("testenv: kafka client: %v", err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// WaitFor polls cond every few milliseconds until it holds, failing the test
// when ctx ends first. Tests wait on conditions this way, never on sleeps.
func WaitFor(t testing.TB, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	pgtest.WaitFor(t, ctx, what, cond)
}

// Eventually is WaitFor with a timeout instead of a context.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	pgtest.Eventually(t, timeout, what, cond)
}
