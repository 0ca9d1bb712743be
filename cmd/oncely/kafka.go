package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/internal/kafkaflags"
)

// kafkaFlags are the connection flags every Kafka command takes: the seed
// brokers, the timeout, and the TLS and SASL flags shared with the example.
type kafkaFlags struct {
	brokers  string
	timeout  time.Duration
	security kafkaflags.Flags
}

func (k *kafkaFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&k.brokers, "brokers", os.Getenv("KAFKA_BROKERS"), "comma-separated seed brokers (env KAFKA_BROKERS)")
	fs.DurationVar(&k.timeout, "timeout", 15*time.Second, "how long to wait for Kafka (and Postgres)")
	k.security.Register(fs, os.Getenv)
}

// opts validates the flags and returns the franz-go options they describe.
func (k *kafkaFlags) opts() ([]kgo.Opt, error) {
	var brokers []string
	for _, b := range strings.Split(k.brokers, ",") {
		if b = strings.TrimSpace(b); b != "" {
			brokers = append(brokers, b)
		}
	}
	if len(brokers) == 0 {
		return nil, errors.New("--brokers: no seed brokers (set --brokers or KAFKA_BROKERS)")
	}
	if k.timeout <= 0 {
		return nil, fmt.Errorf("--timeout: must be positive, got %s", k.timeout)
	}
	security, err := k.security.Opts()
	if err != nil {
		return nil, err
	}
	return append([]kgo.Opt{kgo.SeedBrokers(brokers...), kgo.DialTimeout(min(k.timeout, 10*time.Second))}, security...), nil
}
