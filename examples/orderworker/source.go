package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/natsconsumer"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/rabbitconsumer"
	"github.com/oncely/oncely/webhook/outbound"
)

// Sources of --source: the broker the orders come from and the events go
// to.
const (
	sourceKafka     = "kafka"
	sourceJetStream = "jetstream"
	sourceRabbitMQ  = "rabbitmq"
)

// defaultAMQPURL is --amqp's default: the local RabbitMQ's guest account.
const defaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"

// parseSource checks --source.
func parseSource(s string) (string, error) {
	switch s {
	case sourceKafka, sourceJetStream, sourceRabbitMQ:
		return s, nil
	}
	return "", fmt.Errorf("want %s, %s or %s, got %q", sourceKafka, sourceJetStream, sourceRabbitMQ, s)
}

// jetStreamConcurrency is how many transactions (batches, or single orders
// with --batch-size 1) the JetStream worker runs at once.
const jetStreamConcurrency = 4

// streamName is the JetStream stream that captures subject: its name in
// upper case, with the characters a stream name cannot hold replaced.
func streamName(subject string) string {
	return strings.ToUpper(strings.NewReplacer(".", "_", "*", "_", ">", "_", " ", "_").Replace(subject))
}

// jetStreamConn connects to the NATS server at url; the caller closes it.
func jetStreamConn(url, name string) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := nats.Connect(url, nats.Name(name), nats.MaxReconnects(-1), nats.Timeout(10*time.Second))
	if err != nil {
		return nil, nil, fmt.Errorf("orderworker: NATS at %s: %w", url, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// ensureStreams creates the worker's streams where they do not exist: the
// orders (subject topic), their dead letters (natsconsumer's default
// subject for topic) and the events (subject eventsTopic). An existing
// stream is left as it is; one that captures another subject makes the
// consumer's start-up checks fail, naming it. As the in-process Kafka
// cluster creates its topics, this is the example making its own broker
// ready: a production service would have its streams made by whoever owns
// the NATS account.
func ensureStreams(ctx context.Context, js jetstream.JetStream, topic, eventsTopic string) error {
	for _, subject := range []string{topic, natsconsumer.DefaultDeadLetterSubject(topic), eventsTopic} {
		name := streamName(subject)
		_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subject}, Storage: jetstream.FileStorage})
		if err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return fmt.Errorf("orderworker: create stream %s for %s: %w", name, subject, err)
		}
	}
	return nil
}

// jetStreamWorker is the JetStream consumer of the orders subject: the same
// handlers as the Kafka consumer's, in batches of --batch-size.
type jetStreamWorker struct {
	*natsconsumer.Consumer
	name string
}

// addJetStreamWorker adds the JetStream consumer of cfg.Topic's stream to
// r, as the durable cfg.Group, logging to log and reporting to tel's
// providers as the Kafka consumer does through the runner.
func addJetStreamWorker(r *oncely.Runner, pool *pgxpool.Pool, cfg workerConfig, js jetstream.JetStream, st *store, log *slog.Logger, tel *telemetry) (*jetStreamWorker, error) {
	stream := streamName(cfg.Topic)
	ncfg := natsconsumer.Config{
		JetStream: js, Stream: stream, Durable: cfg.Group,
		Pool: pool, Schema: cfg.Schema, Handler: st.handler(), BatchSize: cfg.BatchSize,
		Concurrency: jetStreamConcurrency, AckWait: cfg.AckWait, ShutdownTimeout: shutdownTimeout - 2*time.Second,
		Logger: log, TracerProvider: tel.tracerProvider, MeterProvider: tel.meterProvider,
	}
	if cfg.BatchSize > 1 && !cfg.RecordHandler {
		// The set-based handler, as on Kafka: it takes each customer's
		// balance row in customer order, so concurrent batches that share
		// customers wait for each other instead of deadlocking.
		ncfg.BatchHandler = st.batchHandler()
	}
	c, err := natsconsumer.New(ncfg)
	if err != nil {
		return nil, err
	}
	w := &jetStreamWorker{Consumer: c, name: "jetstream " + stream + "/" + cfg.Group}
	return w, r.AddWorker(w.name, c)
}

// jetStreamRelay is the runner's relay publishing to JetStream.
func jetStreamRelay(js jetstream.JetStream) *outbox.RelayConfig {
	return &outbox.RelayConfig{Publisher: natsconsumer.JetStreamPublisher{JetStream: js}}
}

// jetStreamPublish returns a function that publishes a delivery to
// subject and waits for its PubAck. The dedup id travels in the message-id
// header, not Nats-Msg-Id: the stream's duplicate window would drop the
// duplicates before the worker's inbox could show it deduplicates them.
func jetStreamPublish(js jetstream.JetStream, subject string) func(context.Context, delivery) error {
	return func(ctx context.Context, d delivery) error {
		rec := d.record(subject)
		m := nats.NewMsg(subject)
		m.Data = rec.Value
		m.Header.Set(consumer.DefaultMessageIDHeader, d.MessageID)
		m.Header.Set(natsconsumer.HeaderKey, string(rec.Key))
		if _, err := js.PublishMsg(ctx, m); err != nil {
			return fmt.Errorf("publish to %s: %w", subject, err)
		}
		return nil
	}
}

// ensureQueues declares the worker's RabbitMQ queues where they do not
// exist: the orders (queue topic), their dead letters (rabbitconsumer's
// default dead-letter queue of topic) and the events (queue eventsTopic,
// which the relay's publishes reach through the default exchange), all
// quorum queues: a quorum queue counts the deliveries a crash ended, which
// is how a message that kills the worker is found (see package
// rabbitconsumer). The retry queue is the consumer's own to declare.
func ensureQueues(url, topic, eventsTopic string) error {
	conn, err := amqp.Dial(url)
	if err != nil {
		return fmt.Errorf("orderworker: RabbitMQ at %s: %w", outbound.RedactURL(url), err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	for _, q := range []string{topic, rabbitconsumer.DefaultDeadLetterRoutingKey(topic), eventsTopic} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			return fmt.Errorf("orderworker: declare queue %s: %w", q, err)
		}
	}
	return nil
}

// addRabbitWorker adds the RabbitMQ consumer of the cfg.Topic queue to r,
// as the group cfg.Group: the same handlers as the Kafka consumer's, in
// batches of --batch-size, jetStreamConcurrency transactions at once,
// logging to log and reporting to tel's providers.
func addRabbitWorker(r *oncely.Runner, pool *pgxpool.Pool, cfg workerConfig, st *store, log *slog.Logger, tel *telemetry) (*rabbitconsumer.Consumer, error) {
	rcfg := rabbitconsumer.Config{
		URL: cfg.AMQPURL, Queues: []string{cfg.Topic}, Group: cfg.Group,
		Pool: pool, Schema: cfg.Schema, Handler: st.handler(), BatchSize: cfg.BatchSize,
		Concurrency: jetStreamConcurrency, ShutdownTimeout: shutdownTimeout - 2*time.Second,
		Logger: log, TracerProvider: tel.tracerProvider, MeterProvider: tel.meterProvider,
	}
	if cfg.BatchSize > 1 && !cfg.RecordHandler {
		rcfg.BatchHandler = st.batchHandler() // as on JetStream (addJetStreamWorker)
	}
	c, err := rabbitconsumer.New(rcfg)
	if err != nil {
		return nil, err
	}
	return c, r.AddWorker("rabbitmq "+cfg.Topic+"/"+cfg.Group, c)
}

// publishRabbit publishes ds to the queue topic through the default
// exchange with rabbitconsumer.Publisher (the relay's publisher:
// persistent, mandatory, each after the previous one's publisher
// confirmation), paced and retried as o says (publishEach), and returns
// how many publishes were repeats after a failure. The dedup id, in the
// message-id header, becomes the message_id property: RabbitMQ does not
// deduplicate, so the duplicates reach the worker's inbox.
func publishRabbit(ctx context.Context, url, topic, eventsTopic string, ds []delivery, o publishOpts) (int, error) {
	if err := ensureQueues(url, topic, eventsTopic); err != nil {
		return 0, err
	}
	pub := &rabbitconsumer.Publisher{URL: url}
	defer pub.Close()
	return publishEach(ctx, ds, o, func(ctx context.Context, d delivery) error {
		if err := pub.Publish(ctx, []*kgo.Record{d.record(topic)})[0]; err != nil {
			return fmt.Errorf("publish to %s: %w", topic, err)
		}
		return nil
	})
}
