package integration_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
)

// With the database unreachable and a dead-letter topic deleted, /readyz
// names both: the periodic topic check goes on while the database is away.
func TestRunnerReadyzNamesDatabaseAndTopicTogether(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	dlqTopic := dlq.DefaultTopic(e.topic) // newEnv created it
	proxy := testenv.NewPostgresProxy(t)
	r := e.healthRunner(t, e.runnerPool(t, proxy.URL), nil)
	h := r.Handler()
	runRunner(t, r)
	eventually(t, 30*time.Second, "/readyz 200", func() bool { code, _ := readyz(t, h, false); return code == http.StatusOK })
	adm := kadm.NewClient(e.kafka.Client(t))
	topicMissing := func(body string) bool {
		return strings.Contains(body, `topic "`+dlqTopic+`": does not exist`)
	}
	// A first round with the database up: the periodic check has run, and
	// keeps its client, before the database goes.
	if _, err := adm.DeleteTopics(context.Background(), dlqTopic); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "/readyz naming the deleted topic", func() bool { _, body := readyz(t, h, false); return topicMissing(body) })
	e.kafka.CreateTopicNamed(t, dlqTopic, 1)
	eventually(t, 30*time.Second, "/readyz without the recreated topic", func() bool { _, body := readyz(t, h, false); return !topicMissing(body) })

	proxy.Cut()
	eventually(t, 30*time.Second, "/readyz naming the database", func() bool {
		_, body := readyz(t, h, false)
		return strings.Contains(body, "database: unreachable")
	})
	if _, err := adm.DeleteTopics(context.Background(), dlqTopic); err != nil {
		t.Fatal(err)
	}
	var body string
	eventually(t, 30*time.Second, "/readyz naming both the database and the deleted topic", func() bool {
		var code int
		code, body = readyz(t, h, false)
		return code == http.StatusServiceUnavailable && strings.Contains(body, "database: unreachable") && topicMissing(body)
	})
	proxy.Restore()
}
