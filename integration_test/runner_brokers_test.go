package integration_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/testenv"
)

// The runner's start-up topic check asks each consumer's own brokers about
// its topics: with no Config.Brokers at all, or with Config.Brokers naming
// another cluster, it checks the cluster the consumer reads.
func TestRunnerChecksTopicsOnEachConsumersBrokers(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)            // the topics exist here
	other := testenv.NewKafka(t) // and not here
	for _, tc := range []struct {
		name             string
		runner, consumer []string
		missing          bool
	}{
		{"no runner brokers", nil, e.kafka.Brokers, false},
		{"runner brokers of another cluster", other.Brokers, e.kafka.Brokers, false},
		{"consumer brokers of another cluster", e.kafka.Brokers, other.Brokers, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := oncely.New(oncely.Config{Pool: e.runnerPool(t, e.db.URL), Schema: e.db.Schema, Brokers: tc.runner,
				HealthInterval: 100 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			group := testenv.UniqueName("g")
			if _, err := r.AddConsumer(consumer.Config{Brokers: tc.consumer, Topics: []string{e.topic}, Group: group,
				Handler: recordEffect(group)}); err != nil {
				t.Fatal(err)
			}
			cancel, done := runRunner(t, r)
			defer cancel()
			if tc.missing {
				err := waitRun(t, done, time.Minute)
				if !errors.Is(err, oncely.ErrMissingTopic) || !strings.Contains(err.Error(), `topic "`+e.topic+`"`) {
					t.Fatalf("Run = %v; want ErrMissingTopic naming %s, missing on the consumer's brokers", err, e.topic)
				}
				return
			}
			e.produce(t, []msg{{id: group + "-m", partition: 0}})
			eventually(t, time.Minute, "the runner's consumer to process a record", func() bool {
				return e.count(t, `SELECT count(*) FROM effects WHERE member = $1 AND message_id = $2`, group, group+"-m") == 1
			})
			if !r.Started() {
				t.Error("a record was processed, but the runner is not started")
			}
			cancel()
			if err := waitRun(t, done, 30*time.Second); err != nil {
				t.Fatalf("Run = %v after a clean shutdown", err)
			}
		})
	}
}

// Options from which no Kafka client can be made are a configuration
// error: Run fails at start-up naming them, instead of waiting for brokers
// as if they were away.
func TestRunnerKafkaOptionsErrorFailsAtStart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	r, err := oncely.New(oncely.Config{Pool: e.runnerPool(t, e.db.URL), Schema: e.db.Schema, Brokers: e.kafka.Brokers,
		KafkaOpts: []kgo.Opt{kgo.TransactionalID("")}, HealthInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.AddConsumer(consumer.Config{Topics: []string{e.topic}, Group: e.group, Handler: recordEffect("a")}); err != nil {
		t.Fatal(err)
	}
	_, done := runRunner(t, r)
	err = waitRun(t, done, time.Minute)
	if !errors.Is(err, oncely.ErrInvalidConfig) || !strings.Contains(err.Error(), "KafkaOpts") || !strings.Contains(err.Error(), e.group) {
		t.Fatalf("Run = %v; want ErrInvalidConfig naming the group's Kafka options", err)
	}
}
