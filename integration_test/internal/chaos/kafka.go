package chaos

import (
	"errors"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// KafkaFaults drops and delays requests of chosen kinds in a kfake cluster.
// A dropped request closes the client's connection before the broker acts
// on it, as a broker or network failure would; the client sees the
// connection die and retries. A delayed request is held for a while, and
// the requests behind it on its connection with it, before the broker
// handles it as usual.
//
// Faults are armed as budgets ("drop the next 2 OffsetCommit requests") and
// counted when a request actually meets them.
type KafkaFaults struct {
	c *kfake.Cluster
	// Produce requests are dropped only when they write to one of these
	// topics (by name or, in newer request versions, by id), so that the
	// faults reach the producers under test and not the test's own.
	produceTopics map[string]bool
	produceIDs    map[[16]byte]bool

	mu      sync.Mutex
	drops   map[kmsg.Key]int // requests left to drop
	delays  map[kmsg.Key][]time.Duration
	dropped map[kmsg.Key]int
	delayed map[kmsg.Key]int
}

// errDropped closes the client's connection (kfake's answer to a control
// function's error).
var errDropped = errors.New("chaos: request dropped")

// NewKafkaFaults installs a control function for each key in c, inert until
// Drop or Delay arm it. Produce drops apply to requests that write to one
// of produceTopics (topic name to topic id).
func NewKafkaFaults(c *kfake.Cluster, keys []kmsg.Key, produceTopics map[string][16]byte) *KafkaFaults {
	f := &KafkaFaults{
		c: c, produceTopics: make(map[string]bool), produceIDs: make(map[[16]byte]bool),
		drops: make(map[kmsg.Key]int), delays: make(map[kmsg.Key][]time.Duration),
		dropped: make(map[kmsg.Key]int), delayed: make(map[kmsg.Key]int),
	}
	for name, id := range produceTopics {
		f.produceTopics[name], f.produceIDs[id] = true, true
	}
	for _, key := range keys {
		c.ControlKey(int16(key), func(req kmsg.Request) (kmsg.Response, error, bool) {
			c.KeepControl()
			drop, delay := f.take(key, req)
			switch {
			case drop:
				return nil, errDropped, true
			case delay > 0:
				c.SleepControl(func() {
					t := time.NewTimer(delay)
					defer t.Stop()
					<-t.C
				})
			}
			return nil, nil, false // the broker handles it
		})
	}
	return f
}

// take consumes a budget for req, if one applies: drop it, or delay it.
func (f *KafkaFaults) take(key kmsg.Key, req kmsg.Request) (drop bool, delay time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.drops[key] > 0 && (key != kmsg.Produce || f.writesToFaultTopic(req)) {
		f.drops[key]--
		f.dropped[key]++
		return true, 0
	}
	if ds := f.delays[key]; len(ds) > 0 {
		f.delays[key] = ds[1:]
		f.delayed[key]++
		return false, ds[0]
	}
	return false, 0
}

func (f *KafkaFaults) writesToFaultTopic(req kmsg.Request) bool {
	p, ok := req.(*kmsg.ProduceRequest)
	if !ok {
		return false
	}
	for _, t := range p.Topics {
		if f.produceTopics[t.Topic] || f.produceIDs[t.TopicID] {
			return true
		}
	}
	return false
}

// Drop arms the next n requests of key (a key given to NewKafkaFaults) to
// be dropped.
func (f *KafkaFaults) Drop(key kmsg.Key, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.drops[key] += n
}

// Delay arms the next request of key to be held for d; calls queue up.
func (f *KafkaFaults) Delay(key kmsg.Key, d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.delays[key] = append(f.delays[key], d)
}

// Off disarms every fault not met yet; the control functions stay, inert.
func (f *KafkaFaults) Off() {
	f.mu.Lock()
	defer f.mu.Unlock()
	clear(f.drops)
	clear(f.delays)
}

// Dropped and Delayed count the requests of key met by a fault so far.
func (f *KafkaFaults) Dropped(key kmsg.Key) int { return f.count(f.dropped, key) }

// Delayed: see Dropped.
func (f *KafkaFaults) Delayed(key kmsg.Key) int { return f.count(f.delayed, key) }

func (f *KafkaFaults) count(m map[kmsg.Key]int, key kmsg.Key) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return m[key]
}
