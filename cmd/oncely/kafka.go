package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// kafkaFlags are the connection flags every Kafka command takes.
type kafkaFlags struct {
	brokers                 string
	tls, tlsInsecure        bool
	tlsCA, tlsCert, tlsKey  string
	saslMechanism, saslUser string
	saslPassword            string
	timeout                 time.Duration
}

func (k *kafkaFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&k.brokers, "brokers", os.Getenv("KAFKA_BROKERS"), "comma-separated seed brokers (env KAFKA_BROKERS)")
	fs.BoolVar(&k.tls, "tls", false, "connect with TLS")
	fs.StringVar(&k.tlsCA, "tls-ca", "", "PEM file of CA certificates to trust (implies --tls)")
	fs.StringVar(&k.tlsCert, "tls-cert", "", "PEM client certificate (implies --tls; needs --tls-key)")
	fs.StringVar(&k.tlsKey, "tls-key", "", "PEM client key")
	fs.BoolVar(&k.tlsInsecure, "tls-insecure-skip-verify", false, "do not verify the brokers' certificates")
	fs.StringVar(&k.saslMechanism, "sasl-mechanism", "", "SASL mechanism: plain, scram-sha-256 or scram-sha-512")
	fs.StringVar(&k.saslUser, "sasl-user", os.Getenv("KAFKA_SASL_USER"), "SASL user (env KAFKA_SASL_USER)")
	fs.StringVar(&k.saslPassword, "sasl-password", os.Getenv("KAFKA_SASL_PASSWORD"), "SASL password (env KAFKA_SASL_PASSWORD)")
	fs.DurationVar(&k.timeout, "timeout", 15*time.Second, "how long to wait for Kafka (and Postgres)")
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
	opts := []kgo.Opt{kgo.SeedBrokers(brokers...), kgo.DialTimeout(min(k.timeout, 10*time.Second))}
	if k.tls || k.tlsCA != "" || k.tlsCert != "" || k.tlsInsecure {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: k.tlsInsecure} //nolint:gosec // opt-in flag
		if k.tlsCA != "" {
			pem, err := os.ReadFile(k.tlsCA)
			if err != nil {
				return nil, fmt.Errorf("--tls-ca: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("--tls-ca: no PEM certificates in %s", k.tlsCA)
			}
			cfg.RootCAs = pool
		}
		if (k.tlsCert == "") != (k.tlsKey == "") {
			return nil, errors.New("--tls-cert and --tls-key: give both or neither")
		}
		if k.tlsCert != "" {
			cert, err := tls.LoadX509KeyPair(k.tlsCert, k.tlsKey)
			if err != nil {
				return nil, fmt.Errorf("--tls-cert/--tls-key: %w", err)
			}
			cfg.Certificates = []tls.Certificate{cert}
		}
		opts = append(opts, kgo.DialTLSConfig(cfg))
	}
	switch strings.ToLower(k.saslMechanism) {
	case "":
	case "plain":
		opts = append(opts, kgo.SASL(plain.Auth{User: k.saslUser, Pass: k.saslPassword}.AsMechanism()))
	case "scram-sha-256":
		opts = append(opts, kgo.SASL(scram.Auth{User: k.saslUser, Pass: k.saslPassword}.AsSha256Mechanism()))
	case "scram-sha-512":
		opts = append(opts, kgo.SASL(scram.Auth{User: k.saslUser, Pass: k.saslPassword}.AsSha512Mechanism()))
	default:
		return nil, fmt.Errorf("--sasl-mechanism: unknown mechanism %q (want plain, scram-sha-256 or scram-sha-512)", k.saslMechanism)
	}
	if k.saslMechanism != "" && k.saslUser == "" {
		return nil, errors.New("--sasl-user: required with --sasl-mechanism")
	}
	return opts, nil
}
