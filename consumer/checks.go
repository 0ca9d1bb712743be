package consumer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// ErrMissingTopics is returned by Run when a topic of Config.Topics, or the
// dead-letter topic of one, does not exist. The error names them.
var ErrMissingTopics = errors.New("consumer: topics do not exist")

// checkKafka fails Run at start-up when a source or dead-letter topic does
// not exist: a missing source topic would consume nothing, and a missing
// dead-letter topic would hold its partition at the first poison record.
// Brokers that do not answer are waited for, as they would be once running
// (a broker restarting must not fail every member), but not silently: past
// Config.BrokerTimeout an ERROR names them, and NotReady says so until one
// answers. It returns nil, unchecked, when ctx ends first.
func (r *run) checkKafka(ctx context.Context) error {
	c := r.c
	start := time.Now()
	logged := false
	for {
		topics := c.checkedTopics()
		mctx, cancel := context.WithTimeout(ctx, min(c.cfg.BrokerTimeout, 10*time.Second))
		err := r.cl.Ping(mctx)
		var md kadm.Metadata
		if err == nil {
			md, err = kadm.NewClient(r.cl).Metadata(mctx, topics...)
		}
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		if err == nil {
			r.brokers.Up()
			terr, retry := topicsError(topics, md)
			if !retry {
				return terr
			}
			// A topic just created, say, whose leader is not elected yet.
			c.outage.Warn(ctx, "oncely consumer waits for topics the brokers are still setting up",
				"group", c.cfg.Group, "err", terr)
		} else if waited := time.Since(start); waited >= c.cfg.BrokerTimeout {
			r.brokers.SetDown(fmt.Sprintf("no Kafka broker answers (%s) since start-up %s ago: %v",
				strings.Join(c.cfg.Brokers, ", "), waited.Truncate(time.Second), err))
			if !logged {
				logged = true
				c.cfg.Logger.Error("oncely consumer cannot reach any Kafka broker; waiting, not ready",
					"group", c.cfg.Group, "brokers", c.cfg.Brokers, "waited", waited, "err", err)
			}
		}
		t := time.NewTimer(250 * time.Millisecond)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
}

// topicsError returns ErrMissingTopics naming each of topics that md says
// does not exist, or the errors the brokers gave for topics. retry says
// that every error is one the brokers are expected to get over (a leader
// not elected yet just after the topic's creation, kerr.IsRetriable), to
// be waited for: then err says which.
func topicsError(topics []string, md kadm.Metadata) (err error, retry bool) {
	var missing []string
	var failed, retriable []error
	for _, t := range topics {
		d, ok := md.Topics[t]
		switch {
		case !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition):
			missing = append(missing, t)
		case d.Err != nil && kerr.IsRetriable(d.Err):
			retriable = append(retriable, fmt.Errorf("%s: %w", t, d.Err))
		case d.Err != nil:
			failed = append(failed, fmt.Errorf("%s: %w", t, d.Err))
		}
	}
	switch {
	case len(missing) > 0:
		return fmt.Errorf("%w: %s (Config.Topics and their dead-letter topics, Config.DeadLetterTopic, must exist: the consumer does not create topics)",
			ErrMissingTopics, strings.Join(missing, ", ")), false
	case len(failed) > 0:
		return fmt.Errorf("consumer: describe topics: %w", errors.Join(failed...)), false
	case len(retriable) > 0:
		return fmt.Errorf("consumer: describe topics: %w", errors.Join(retriable...)), true
	}
	return nil, false
}

// checkedTopics are the topics the consumer needs: its source topics and
// their dead-letter topics, without repeats.
func (c *Consumer) checkedTopics() []string {
	topics := slices.Clone(c.cfg.Topics)
	for _, t := range c.cfg.Topics {
		topics = append(topics, c.cfg.DeadLetterTopic(t))
	}
	slices.Sort(topics)
	return slices.Compact(topics)
}

// brokerCheckInterval is how often a running consumer checks that a broker
// answers (NotReady).
const brokerCheckInterval = 2 * time.Second

// fallbackLog rate-limits the WARN of one partition's records without a
// message id.
type fallbackLog struct {
	mu     sync.Mutex
	last   time.Time
	missed int64 // fallbacks since the last WARN
}

// fallbackWarnEvery bounds how often a partition's id fallbacks are logged.
const fallbackWarnEvery = time.Minute

// checkID counts rec in oncely.consumer.id_fallback, and logs it (rate
// limited per partition), when its dedup id falls back to
// topic/partition/offset: no KeyFunc, and no message id header in any
// casing. Such a record dedups its redeliveries but not a producer's
// duplicate. It runs once per record, where the record is taken up.
func (c *Consumer) checkID(ctx context.Context, rec *kgo.Record) {
	if c.cfg.KeyFunc != nil || c.headerID(rec) != "" {
		return
	}
	c.metrics.idFallback.Add(ctx, 1, c.topicAttrs(rec))
	key := tp{rec.Topic, rec.Partition}
	v, ok := c.fallbacks.Load(key)
	if !ok {
		v, _ = c.fallbacks.LoadOrStore(key, &fallbackLog{})
	}
	fl := v.(*fallbackLog)
	fl.mu.Lock()
	now := time.Now()
	if !fl.last.IsZero() && now.Sub(fl.last) < fallbackWarnEvery {
		fl.missed++
		fl.mu.Unlock()
		return
	}
	missed := fl.missed
	fl.last, fl.missed = now, 0
	fl.mu.Unlock()
	c.cfg.Logger.Warn("oncely record without a message id; deduplicating it by topic/partition/offset, which does not catch a producer's duplicate",
		"topic", rec.Topic, "partition", rec.Partition, "offset", rec.Offset, "header", c.cfg.MessageIDHeader,
		"more_since_last_warning", missed)
}
