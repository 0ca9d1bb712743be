package integration_test

import (
	"context"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// A topic whose leader the brokers have not elected yet (just after its
// creation) is waited for at start-up, not taken for a configuration
// error: the consumer starts once the brokers describe it.
func TestStartWaitsForTopicLeader(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	if e.kafka.Cluster == nil {
		t.Skip("needs the in-process kfake cluster")
	}
	host, port, err := net.SplitHostPort(e.kafka.Cluster.ListenAddrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	p, _ := strconv.Atoi(port)
	var refused atomic.Int32
	const refusals = 3
	// The start-up check's metadata request (the source and dead-letter
	// topics together) gets LEADER_NOT_AVAILABLE for its first answers.
	e.kafka.Cluster.ControlKey(kmsg.Metadata.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.kafka.Cluster.KeepControl()
		mreq := req.(*kmsg.MetadataRequest)
		if len(mreq.Topics) != 2 || refused.Load() >= refusals {
			return nil, nil, false
		}
		refused.Add(1)
		resp := mreq.ResponseKind().(*kmsg.MetadataResponse)
		resp.Brokers = []kmsg.MetadataResponseBroker{{NodeID: 0, Host: host, Port: int32(p)}}
		for _, rt := range mreq.Topics {
			st := kmsg.NewMetadataResponseTopic()
			st.Topic, st.ErrorCode = rt.Topic, kerr.LeaderNotAvailable.Code
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	m := e.start(context.Background(), e.config("a", recordEffect("a")))
	e.produce(t, []msg{{id: "m", partition: 0}})
	eventually(t, time.Minute, "the record processed", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == 1
	})
	if n := refused.Load(); n != refusals {
		t.Errorf("the start-up check was answered LEADER_NOT_AVAILABLE %d times, want %d", n, refusals)
	}
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
}
