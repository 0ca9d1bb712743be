package consumer

import (
	"errors"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
)

// The start-up topic check waits on topic errors the brokers get over (a
// leader not elected yet just after a topic's creation) and fails Run only
// on a missing topic or an error that waiting would not end.
func TestTopicsErrorWaitsOnlyOnRetriableErrors(t *testing.T) {
	md := func(errs map[string]error) kadm.Metadata {
		m := kadm.Metadata{Topics: kadm.TopicDetails{}}
		for topic, err := range errs {
			m.Topics[topic] = kadm.TopicDetail{Topic: topic, Err: err}
		}
		return m
	}
	topics := []string{"a", "a.dlq"}
	for _, tc := range []struct {
		name    string
		md      kadm.Metadata
		retry   bool
		wantErr error  // nil: no error
		names   string // in the error
	}{
		{"all there", md(map[string]error{"a": nil, "a.dlq": nil}), false, nil, ""},
		{"leader not available", md(map[string]error{"a": kerr.LeaderNotAvailable, "a.dlq": nil}), true, kerr.LeaderNotAvailable, "a: "},
		{"not leader", md(map[string]error{"a": nil, "a.dlq": kerr.NotLeaderForPartition}), true, kerr.NotLeaderForPartition, "a.dlq"},
		{"unknown topic", md(map[string]error{"a": nil, "a.dlq": kerr.UnknownTopicOrPartition}), false, ErrMissingTopics, "a.dlq"},
		{"absent from the answer", md(map[string]error{"a": nil}), false, ErrMissingTopics, "a.dlq"},
		{"missing wins over retriable", md(map[string]error{"a": kerr.LeaderNotAvailable}), false, ErrMissingTopics, "a.dlq"},
		{"not authorized", md(map[string]error{"a": kerr.TopicAuthorizationFailed, "a.dlq": kerr.LeaderNotAvailable}), false, kerr.TopicAuthorizationFailed, "a: "},
	} {
		err, retry := topicsError(topics, tc.md)
		if retry != tc.retry {
			t.Errorf("%s: retry %v, want %v (err %v)", tc.name, retry, tc.retry, err)
		}
		if tc.wantErr == nil {
			if err != nil {
				t.Errorf("%s: err %v, want none", tc.name, err)
			}
			continue
		}
		if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), tc.names) {
			t.Errorf("%s: err %v, want %v naming %q", tc.name, err, tc.wantErr, tc.names)
		}
	}
}
