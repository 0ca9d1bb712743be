package integration_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/jsoncheck"
	"github.com/oncely/oncely/internal/kafkaflags"
	"github.com/oncely/oncely/internal/testenv"
)

// The CLI's commands against Kafka, run as a user runs them: the oncely
// binary, built for the test, one process per command line. (Its commands
// that need only Postgres are tested in cmd/oncely.)

// cliFunc runs one command line of the CLI.
type cliFunc func(t *testing.T, args ...string) (code int, stdout, stderr string)

// cliEnv is the CLI built for the test (oncelyCLI), a schema the CLI has
// migrated, and a topic on k with its dead-letter topic.
func cliEnv(t *testing.T, k *testenv.Kafka) (oncely cliFunc, db *testenv.DB, topic, dlqTopic string) {
	t.Helper()
	oncely = oncelyCLI(t)
	db = testenv.Postgres(t)
	topic = k.CreateTopic(t, "orders", 1)
	dlqTopic = dlq.DefaultTopic(topic)
	k.CreateTopicNamed(t, dlqTopic, 1)
	if code, out, errs := oncely(t, "migrate", "up", "--database-url", db.URL, "--schema", db.Schema); code != 0 {
		t.Fatalf("migrate: %s %s", out, errs)
	}
	return oncely, db, topic, dlqTopic
}

// oncelyCLI builds cmd/oncely into the test's temporary directory and
// returns a function that runs one command line with it.
func oncelyCLI(t *testing.T) cliFunc {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "oncely")
	if out, err := exec.CommandContext(t.Context(), "go", "build", "-o", bin, "github.com/oncely/oncely/cmd/oncely").CombinedOutput(); err != nil {
		t.Fatalf("go build cmd/oncely: %v\n%s", err, out)
	}
	return func(t *testing.T, args ...string) (int, string, string) {
		t.Helper()
		var out, errb bytes.Buffer
		cmd := exec.CommandContext(t.Context(), bin, args...)
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		var exit *exec.ExitError
		if err != nil && !errors.As(err, &exit) {
			t.Fatalf("run oncely %q: %v", args, err)
		}
		return cmd.ProcessState.ExitCode(), out.String(), errb.String()
	}
}

// The dlq commands end to end: a consumer dead-letters three records, the
// CLI lists, filters and shows them, and redrives one to a fixed consumer.
func TestCLIDLQCommands(t *testing.T) {
	t.Parallel()
	k := testenv.NewKafka(t)
	oncely, db, topic, dlqTopic := cliEnv(t, k)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE effects (id text)`); err != nil {
		t.Fatal(err)
	}
	producer := k.Client(t)
	for _, r := range []struct{ id, value string }{{"a", "bad"}, {"b", "boom"}, {"c", "bad"}} {
		rec := &kgo.Record{Topic: topic, Value: []byte(r.value), Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(r.id)}}}
		if err := producer.ProduceSync(ctx, rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	group := testenv.UniqueName("g")
	runConsumer := func(h consumer.Handler) (*consumer.Consumer, func()) {
		return startTwoAttemptConsumer(t, k, db, topic, group, h)
	}
	c1, stop1 := runConsumer(func(_ context.Context, _ pgx.Tx, m *consumer.Message) error {
		if string(m.Value) == "bad" {
			return dlq.Permanent(errors.New("rejected by v1"))
		}
		return errors.New("flaky")
	})
	testenv.Eventually(t, time.Minute, "three records dead-lettered", func() bool { return c1.Stats().DeadLettered == 3 })
	stop1()

	kafka := []string{"--brokers", strings.Join(k.Brokers, ","), "--topic", dlqTopic}
	code, out, errs := oncely(t, append([]string{"dlq", "list"}, kafka...)...)
	if code != 0 || !strings.Contains(out, "3 records") || !strings.Contains(out, "rejected by v1") || !strings.Contains(out, "max_attempts") {
		t.Fatalf("list: %d %q %q", code, out, errs)
	}
	code, out, _ = oncely(t, append([]string{"dlq", "list", "--class", "permanent", "--json"}, kafka...)...)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != 0 || len(lines) != 2 {
		t.Fatalf("list --class permanent --json: %d %q", code, out)
	}
	var je struct {
		Info struct {
			MessageID string `json:"message_id"`
		} `json:"info"`
		Headers map[string]string `json:"headers"`
	}
	if err := json.Unmarshal([]byte(lines[0]), &je); err != nil || je.Info.MessageID != "a" || je.Headers[dlq.HeaderGroup] != group {
		t.Fatalf("json entry %+v, %v", je, err)
	}
	if code, out, _ = oncely(t, append([]string{"dlq", "list", "--since", "1h", "--until", "1h"}, kafka...)...); code != 0 || !strings.Contains(out, "0 records") {
		t.Errorf("list with an empty time window: %d %q", code, out)
	}
	code, out, _ = oncely(t, append(append([]string{"dlq", "show"}, kafka...), "0/1")...)
	if code != 0 || !strings.Contains(out, "record "+dlqTopic+"/0/1") || !strings.Contains(out, dlq.HeaderAttempts+": 2") || !strings.Contains(out, "value: boom") {
		t.Fatalf("show: %d %q", code, out)
	}

	// v2 accepts everything; redrive record "a" only.
	c2, stop2 := runConsumer(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID)
		return err
	})
	defer stop2()
	code, out, _ = oncely(t, append([]string{"dlq", "redrive", "--dry-run", "--message-id", "a"}, kafka...)...)
	if code != 0 || !strings.Contains(out, "would-redrive") || !strings.Contains(out, "1 would be redriven") {
		t.Fatalf("dry run: %d %q", code, out)
	}
	dbArgs := []string{"--database-url", db.URL, "--schema", db.Schema} // the consumers' database holds the redrive grants
	code, out, _ = oncely(t, append(append([]string{"dlq", "redrive", "--message-id", "a"}, kafka...), dbArgs...)...)
	if code != 0 || !strings.Contains(out, "1 redriven") {
		t.Fatalf("redrive: %d %q", code, out)
	}
	testenv.Eventually(t, time.Minute, "redriven record processed", func() bool { return c2.Stats().Processed == 1 })
	code, out, _ = oncely(t, append(append([]string{"dlq", "redrive", "--message-id", "a"}, kafka...), dbArgs...)...)
	if code != 0 || !strings.Contains(out, "1 skipped (processed)") {
		t.Fatalf("second redrive: %d %q", code, out)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE id = 'a'`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("effects of a = %d, %v; want 1", n, err)
	}
	if s := c2.Stats(); s.Processed != 1 || s.DeadLettered != 0 {
		t.Errorf("v2 stats %+v: only the redriven record should have run", s)
	}
}

// Over TLS with SASL SCRAM: a consumer (its client options from the shared
// flags) dead-letters a record, and the CLI lists it with --tls-ca and the
// --sasl-* flags; a wrong password fails with a hint and quotes neither
// password.
func TestCLIDLQListOverTLSAndSCRAM(t *testing.T) {
	t.Parallel()
	k := testenv.NewSecureKafka(t)
	oncely, db, topic, dlqTopic := cliEnv(t, k.Kafka)
	ctx := context.Background()
	rec := &kgo.Record{Topic: topic, Value: []byte("bad"), Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte("a")}}}
	if err := k.Client(t).ProduceSync(ctx, rec).FirstErr(); err != nil {
		t.Fatal(err)
	}

	pw := k.Passwords[testenv.SCRAM256User]
	var security kafkaflags.Flags
	security.TLSCA, security.SASLMechanism, security.SASLUser, security.SASLPassword = k.CAFile, "scram-sha-256", testenv.SCRAM256User, pw
	clientOpts, err := security.Opts()
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(consumer.Config{Brokers: k.Brokers, Topics: []string{topic}, Group: testenv.UniqueName("g"),
		Pool: db.Pool, Schema: db.Schema, ClientOpts: clientOpts,
		Handler: func(context.Context, pgx.Tx, *consumer.Message) error { return dlq.Permanent(errors.New("rejected")) }})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(cctx) }()
	testenv.Eventually(t, time.Minute, "the consumer to dead-letter the record over TLS and SASL", func() bool {
		return c.Stats().DeadLettered == 1
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}

	flags := []string{"dlq", "list", "--brokers", strings.Join(k.Brokers, ","), "--topic", dlqTopic, "--timeout", "5s",
		"--tls-ca", k.CAFile, "--sasl-mechanism", "scram-sha-256", "--sasl-user", testenv.SCRAM256User}
	if code, out, errs := oncely(t, append(flags, "--sasl-password", pw)...); code != 0 || !strings.Contains(out, "1 record") {
		t.Fatalf("dlq list over TLS and SCRAM: exit %d, stdout %q, stderr %q", code, out, errs)
	}
	wrong := "wrong-" + testenv.UniqueName("pw")
	code, out, errs := oncely(t, append(flags, "--sasl-password", wrong)...)
	if code != 1 || !strings.Contains(errs, "refused the credentials") {
		t.Fatalf("dlq list with a wrong password: exit %d, stderr %q; want exit 1 and a hint at the credentials", code, errs)
	}
	if strings.Contains(out+errs, wrong) || strings.Contains(out+errs, pw) {
		t.Fatalf("a password is in the output: %q %q", out, errs)
	}
	if code, _, errs := oncely(t, "dlq", "list", "--brokers", strings.Join(k.Brokers, ","), "--topic", dlqTopic, "--timeout", "3s"); code != 1 ||
		!strings.Contains(errs, "is TLS missing?") {
		t.Fatalf("dlq list without TLS: exit %d, stderr %q; want exit 1 saying TLS is missing", code, errs)
	}
}

// produceDeadLetters writes n valid dead-letter records (ids d0, d1, ...)
// to topic, as a consumer of source would have.
func produceDeadLetters(t *testing.T, cl *kgo.Client, topic, source string, n int) {
	t.Helper()
	now := time.Now().UTC().Truncate(time.Millisecond)
	for i := range n {
		info := dlq.Info{Topic: source, Partition: 0, Offset: int64(i), Timestamp: now, Group: "g", MessageID: "d" + strconv.Itoa(i),
			Attempts: 1, FirstFailure: now, LastFailure: now, Class: dlq.ClassPermanent, Error: "rejected"}
		rec := &kgo.Record{Topic: topic, Key: []byte("k"), Value: []byte("v" + strconv.Itoa(i)), Headers: info.Headers()}
		if err := cl.ProduceSync(t.Context(), rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
}

// oncely dlq list on a topic that is not a dead-letter topic (the source
// topic, given by mistake) stops at its first record with an error that
// names it and exits 1, printing no rows; --skip-invalid skips such
// records. A dead-letter topic with one stray record is refused at that
// record, and --skip-invalid lists the valid ones.
func TestCLIDLQRefusesATopicOfOtherRecords(t *testing.T) {
	t.Parallel()
	oncely := oncelyCLI(t)
	k := testenv.NewKafka(t)
	source := k.CreateTopic(t, "payments", 1)
	cl := k.Client(t)
	for i := range 500 {
		rec := &kgo.Record{Topic: source, Value: []byte(`{"n":` + strconv.Itoa(i) + `}`)}
		if err := cl.ProduceSync(t.Context(), rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	brokers := []string{"--brokers", strings.Join(k.Brokers, ",")}
	for _, sub := range []string{"list", "show", "redrive"} {
		args := append([]string{"dlq", sub, "--topic", source}, brokers...)
		switch sub {
		case "show":
			args = append(args, "0/3")
		case "redrive":
			args = append(args, "--all", "--dry-run")
		}
		code, out, errs := oncely(t, args...)
		if code != 1 || !strings.Contains(errs, source+" is not a dead-letter topic") || !strings.Contains(errs, source+"/0/0") ||
			!strings.Contains(errs, "--skip-invalid") {
			t.Errorf("dlq %s on a source topic: exit %d, stderr %q; want exit 1 naming the first record", sub, code, errs)
		}
		if out != "" {
			t.Errorf("dlq %s on a source topic printed %d bytes of rows: %.200q", sub, len(out), out)
		}
	}
	code, out, errs := oncely(t, append([]string{"dlq", "list", "--topic", source, "--skip-invalid"}, brokers...)...)
	if code != 0 || !strings.Contains(out, "0 records") || !strings.Contains(errs, "skipped 500 records") {
		t.Errorf("--skip-invalid: exit %d, %q %q", code, out, errs)
	}

	dlqTopic := k.CreateTopic(t, "orders.dlq", 1)
	produceDeadLetters(t, cl, dlqTopic, "orders", 2)
	if err := cl.ProduceSync(t.Context(), &kgo.Record{Topic: dlqTopic, Value: []byte("stray")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	produceDeadLetters(t, cl, dlqTopic, "orders", 1)
	code, _, errs = oncely(t, append([]string{"dlq", "list", "--topic", dlqTopic}, brokers...)...)
	if code != 1 || !strings.Contains(errs, dlqTopic+"/0/2") {
		t.Errorf("a dead-letter topic with a stray record: exit %d, %q; want exit 1 naming %s/0/2", code, errs, dlqTopic)
	}
	code, out, _ = oncely(t, append([]string{"dlq", "list", "--topic", dlqTopic, "--skip-invalid"}, brokers...)...)
	if code != 0 || !strings.Contains(out, "2 records") { // d0 and d1; the third repeats d0's identity: a copy
		t.Errorf("--skip-invalid on a dead-letter topic: exit %d, %q", code, out)
	}
}

// The dlq commands' --json: JSON Lines with snake_case keys, the same
// casing as every other oncely command.
func TestCLIDLQJSON(t *testing.T) {
	t.Parallel()
	oncely := oncelyCLI(t)
	k := testenv.NewKafka(t)
	dlqTopic := k.CreateTopic(t, "orders.dlq", 1)
	produceDeadLetters(t, k.Client(t), dlqTopic, "orders", 2)
	brokers := []string{"--brokers", strings.Join(k.Brokers, ","), "--topic", dlqTopic, "--json"}
	for _, tc := range []struct {
		args  []string
		lines int
	}{
		{[]string{"dlq", "list"}, 2},
		{[]string{"dlq", "show", "0/1"}, 1},
		{[]string{"dlq", "redrive", "--all", "--dry-run"}, 2},
	} {
		code, out, errs := oncely(t, append(tc.args, brokers...)...)
		if code != 0 {
			t.Fatalf("oncely %q --json: exit %d %q", tc.args, code, errs)
		}
		n := jsoncheck.CheckJSONLines(t, strings.Join(tc.args, " "), out, "headers")
		if n != tc.lines {
			t.Errorf("oncely %q --json: %d lines, want %d:\n%s", tc.args, n, tc.lines, out)
		}
		if tc.args[1] == "list" && !strings.Contains(out, `"message_id":"d1"`) {
			t.Errorf("dlq list --json does not carry info.message_id: %s", out)
		}
	}
}
