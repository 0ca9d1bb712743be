package integration_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
)

var (
	matchRE = regexp.MustCompile(`(\d+) dead letters match`)
	refRE   = regexp.MustCompile(`<a href="record\?(?:topic|stream)=[^&]+&amp;ref=(\d+/\d+)">`)
	nextRE  = regexp.MustCompile(`<a class="next" href="dlq\?([^"]+)">`)
)

// The console's dead-letter pages read the topic once and then only what
// was appended, yet list what dlq.List lists on the whole topic: the same
// records in the same order, copies of one dead-lettering once (as the copy
// first in partition and offset order, even when it arrived last), records
// that are not dead letters, filters decided on the first copy, and nothing
// that retention deleted. Every page of 100 is walked through its next links.
func TestConsoleDeadLetterIndexFollowsTheTopic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	k := testenv.NewKafka(t)
	db := testenv.Migrated(t)
	dlqTopic := k.CreateTopic(t, "idx.dlq", 3)
	producer := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	opts := append([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, k.ClientOpts...)
	h, err := console.New(console.Config{Pool: db.Pool, Schema: db.Schema, KafkaOpts: opts, ViewWait: testViewWait, DeadLetterTopics: []string{dlqTopic}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	classes := []dlq.Class{dlq.ClassPermanent, dlq.ClassMaxAttempts, dlq.ClassUndecodable}
	info := func(i int) *dlq.Info {
		return &dlq.Info{Topic: "orders", Partition: int32(i % 2), Offset: int64(i), Group: "g" + strconv.Itoa(i%2),
			MessageID: "m-" + strconv.Itoa(i), Attempts: 2, FirstFailure: time.Now(), LastFailure: time.Now(),
			Class: classes[i%3], Error: "failure " + strconv.Itoa(i%7)}
	}
	produce := func(p int32, headers []kgo.RecordHeader, key string) {
		t.Helper()
		rec := &kgo.Record{Topic: dlqTopic, Partition: p, Key: []byte(key), Value: []byte("v"), Headers: headers}
		if err := producer.ProduceSync(ctx, rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 240 {
		produce(int32(i%3), info(i).Headers(), "k-"+strconv.Itoa(i%5))
	}
	// A copy of 4 (first in partition 1) in partition 2; a record that is
	// not a dead letter.
	produce(2, info(4).Headers(), "k-4")
	produce(1, []kgo.RecordHeader{{Key: "message-id", Value: []byte("stray")}}, "")

	check := func(step string) {
		t.Helper()
		pagesListAsWhole(t, step, srv.URL+"/dlq", url.Values{"topic": {dlqTopic}}, func(f dlq.Filter) ([]dlq.Entry, error) {
			return dlq.List(ctx, opts, dlqTopic, f)
		})
	}
	check("first read")

	// More dead letters, among them a copy of 7 (first in partition 1) in
	// partition 0: it is listed instead of the record the index held.
	for i := 240; i < 260; i++ {
		produce(int32(i%3), info(i).Headers(), "k-"+strconv.Itoa(i%5))
	}
	produce(0, info(7).Headers(), "k-7")
	check("appended")

	// Retention deletes the first 30 records of partition 0, the copy of 4
	// stays; 4's first copy is deleted with partition 1's first 10.
	adm := kadm.NewClient(producer)
	var del kadm.Offsets
	del.AddOffset(dlqTopic, 0, 30, -1)
	del.AddOffset(dlqTopic, 1, 10, -1)
	res, err := adm.DeleteRecords(ctx, del)
	if err == nil {
		err = res.Error()
	}
	if err != nil {
		t.Fatal(err)
	}
	check("after retention")
}

// pagesListAsWhole fails the test unless the console's dead-letter pages
// of a place (placeQ: topic or stream), walked through their next links,
// list for each of a few filters what list (the broker's dead-letter
// tool, reading the place whole) lists, in the same order.
func pagesListAsWhole(t *testing.T, step, pageURL string, placeQ url.Values, list func(dlq.Filter) ([]dlq.Entry, error)) {
	t.Helper()
	filters := []url.Values{{}, {"class": {"permanent"}}, {"group": {"g1"}, "text": {"failure 3"}}, {"key": {"k-2"}}}
	for _, f := range filters {
		want, err := list(filterOf(t, f))
		if err != nil {
			t.Fatal(err)
		}
		if f.Has("text") || f.Has("key") {
			want = slices.DeleteFunc(want, func(e dlq.Entry) bool {
				return f.Has("key") && string(e.Record.Key) != f.Get("key") ||
					f.Has("text") && (e.Info == nil || !strings.Contains(strings.ToLower(e.Info.Error), f.Get("text")))
			})
		}
		wantRefs := make([]string, len(want))
		for i, e := range want {
			wantRefs[i] = fmt.Sprintf("%d/%d", e.Record.Partition, e.Record.Offset)
		}
		q := url.Values{}
		for k, v := range placeQ {
			q[k] = v
		}
		for k, v := range f {
			q[k] = v
		}
		var got []string
		for pages := 0; q != nil; pages++ {
			body := getPage(t, pageURL+"?"+q.Encode())
			m := matchRE.FindStringSubmatch(body)
			if m == nil || m[1] != strconv.Itoa(len(want)) {
				t.Fatalf("%s, filter %v: page says %v dead letters match, the whole read %d", step, f, m, len(want))
			}
			for _, r := range refRE.FindAllStringSubmatch(body, -1) {
				got = append(got, r[1])
			}
			q = nil
			if n := nextRE.FindStringSubmatch(body); n != nil {
				if q, err = url.ParseQuery(htmlUnescape(n[1])); err != nil {
					t.Fatal(err)
				}
			}
			if pages > 10 {
				t.Fatalf("%s: more pages than records: %v %v", step, q, got[:5])
			}
		}
		if !slices.Equal(got, wantRefs) {
			t.Fatalf("%s, filter %v: the pages list\n%v\nthe whole read lists\n%v", step, f, got, wantRefs)
		}
	}
}

// filterOf is the dlq.Filter of the console's query fields, but for text
// and key, which the console applies itself.
func filterOf(t *testing.T, f url.Values) dlq.Filter {
	t.Helper()
	return dlq.Filter{Class: dlq.Class(f.Get("class")), Group: f.Get("group"), SourceTopic: f.Get("source"), MessageID: f.Get("message_id")}
}

func getPage(t *testing.T, u string) string {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %v\n%s", u, resp.StatusCode, err, b)
	}
	return string(b)
}

// The console reads a dead-letter topic whole once and then only what it
// gained: a view with nothing new fetches nothing, and a view after three
// records more fetches only from where the last read ended, on the one
// partition that grew.
func TestConsoleReadsOnlyWhatTheTopicGained(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	k, db, topic, id := kfakeDeadLetterTopic(t, "gain", 2, "counts the fetch requests of the in-process broker (kfake)")
	producer := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	produce := func(p int32, n int) {
		t.Helper()
		for i := range n {
			info := &dlq.Info{Topic: "orders", Offset: int64(i), Group: "g", MessageID: fmt.Sprintf("m-%d-%d-%d", p, i, time.Now().UnixNano()),
				Attempts: 1, FirstFailure: time.Now(), LastFailure: time.Now(), Class: dlq.ClassPermanent, Error: "no"}
			if err := producer.ProduceSync(ctx, &kgo.Record{Topic: topic, Partition: p, Value: []byte("v"), Headers: info.Headers()}).FirstErr(); err != nil {
				t.Fatal(err)
			}
		}
	}
	produce(0, 25)
	produce(1, 25)

	var mu sync.Mutex
	fetched := map[int32][]int64{} // partition -> the offsets fetched from
	k.Cluster.ControlKey(int16(kmsg.Fetch), func(req kmsg.Request) (kmsg.Response, error, bool) {
		mu.Lock()
		defer mu.Unlock()
		for _, ft := range req.(*kmsg.FetchRequest).Topics {
			if ft.Topic == topic || ft.TopicID == id {
				for _, fp := range ft.Partitions {
					fetched[fp.Partition] = append(fetched[fp.Partition], fp.FetchOffset)
				}
			}
		}
		return nil, nil, false // observe only
	})
	take := func() map[int32][]int64 {
		mu.Lock()
		defer mu.Unlock()
		out := fetched
		fetched = map[int32][]int64{}
		return out
	}
	opts := append([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, k.ClientOpts...)
	h, err := console.New(console.Config{Pool: db.Pool, Schema: db.Schema, KafkaOpts: opts, ViewWait: testViewWait, DeadLetterTopics: []string{topic}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	view := func(want int) {
		t.Helper()
		if m := matchRE.FindStringSubmatch(getPage(t, srv.URL+"/dlq?topic="+topic)); m == nil || m[1] != strconv.Itoa(want) {
			t.Fatalf("page says %v dead letters match, want %d", m, want)
		}
	}

	view(50)
	if f := take(); len(f[0]) == 0 || f[0][0] != 0 || len(f[1]) == 0 || f[1][0] != 0 {
		t.Fatalf("first view fetched from %v, want each partition from offset 0", f)
	}
	view(50)
	if f := take(); len(f) != 0 {
		t.Fatalf("a view with nothing new fetched %v", f)
	}
	produce(0, 3)
	view(53)
	f := take()
	if len(f[1]) != 0 || len(f[0]) == 0 {
		t.Fatalf("after 3 records on partition 0, fetched %v: want partition 0 only", f)
	}
	for _, o := range f[0] {
		if o < 25 {
			t.Fatalf("after 3 records on partition 0, fetched from offset %d: the first 25 were read already", o)
		}
	}
}

// A console whose Run has not read a dead-letter topic shows its first
// view once Config.ViewWait has passed, though the read of the topic is
// not done (here: the broker holds the fetches back), with a note that it
// goes on; the read goes on in the background, and a later view shows the
// whole topic without a note.
func TestConsoleFirstViewWithinViewWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	k, db, topic, _ := kfakeDeadLetterTopic(t, "slow", 1, "holds the in-process broker's (kfake) fetches back")
	producer := k.Client(t)
	for i := range 20 {
		info := &dlq.Info{Topic: "orders", Offset: int64(i), Group: "g", MessageID: fmt.Sprintf("m-%d", i),
			Attempts: 1, FirstFailure: time.Now(), LastFailure: time.Now(), Class: dlq.ClassPermanent, Error: "no"}
		if err := producer.ProduceSync(ctx, &kgo.Record{Topic: topic, Value: []byte("v"), Headers: info.Headers()}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	release := make(chan struct{})
	var releaseOnce sync.Once
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
	k.Cluster.ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		k.Cluster.SleepControl(func() { <-release })
		return nil, nil, false
	})
	opts := append([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, k.ClientOpts...)
	h, err := console.New(console.Config{Pool: db.Pool, Schema: db.Schema, KafkaOpts: opts, ViewWait: 50 * time.Millisecond,
		DeadLetterTopics: []string{topic}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	page := getPage(t, srv.URL+"/dlq?topic="+topic)
	mustContain(t, "first view", page, "0 dead letters match", `class="note"`, "Still reading Kafka topic "+topic, "the 0 records read so far")
	releaseOnce.Do(func() { close(release) })
	testenv.Eventually(t, 30*time.Second, "the whole topic in a view", func() bool {
		page := getPage(t, srv.URL+"/dlq?topic="+topic)
		return strings.Contains(page, "20 dead letters match") && !strings.Contains(page, `class="note"`)
	})
}

// kfakeDeadLetterTopic makes a dead-letter topic of partitions on the
// in-process broker, or skips the test (why: what it needs kfake for)
// when the tests run on another, and a migrated database.
func kfakeDeadLetterTopic(t *testing.T, prefix string, partitions int32, why string) (*testenv.Kafka, *testenv.DB, string, kadm.TopicID) {
	t.Helper()
	k := testenv.NewKafka(t)
	if k.Cluster == nil {
		t.Skip(why)
	}
	topic := testenv.UniqueName(prefix) + ".dlq"
	return k, testenv.Migrated(t), topic, k.CreateTopicNamed(t, topic, partitions)
}
