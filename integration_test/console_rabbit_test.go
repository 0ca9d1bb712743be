package integration_test

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
)

// rabbitConsoleEnv is a RabbitMQ queue whose consumer (still running)
// dead-lettered five messages, and the console on its dead-letter queue
// (RabbitMQ only; actions enabled).
type rabbitConsoleEnv struct {
	*rabbitEnv
	*redriveRuns
}

// seedRabbitConsole dead-letters, through a real rabbitconsumer that gives
// a message two attempts: a (JSON), c (binary) and e permanently
// ("rejected: schema v1"), b and d after max attempts ("flaky
// downstream").
func seedRabbitConsole(t *testing.T) *rabbitConsoleEnv {
	t.Helper()
	env := &rabbitConsoleEnv{rabbitEnv: newRabbitEnv(t), redriveRuns: newRedriveRuns()}
	for _, m := range []struct{ id, body string }{{"a", `{"order":"a","amount":10}`}, {"b", "boom"},
		{"c", string([]byte{0, 1, 2, 0xff})}, {"d", "boom"}, {"e", "bad"}} {
		env.publish(env.queue, m.body, m.id, nil)
	}
	cfg := env.config(env.handler())
	cfg.MaxAttempts = 2
	r := env.start(t.Context(), cfg)
	testenv.Eventually(t, 30*time.Second, "five dead letters", func() bool { return r.c.Stats().DeadLettered == 5 })
	env.settledIn(env.dlq, 5)
	srv := mountConsole(t, console.Config{Pool: env.db.Pool, Schema: env.db.Schema, AMQPURL: rabbitURL,
		DeadLetterQueues: []string{env.dlq}, Actions: true, Logger: slog.New(slog.NewTextHandler(env.logs, nil))})
	env.base = srv.URL + "/ops/"
	return env
}

var rabbitRefRE = regexp.MustCompile(`<a href="record\?queue=[^&]+&amp;ref=(0/\d+)">`)

// refOf is the console's ref of message id's dead letter, from the list
// filtered by the id.
func (env *rabbitConsoleEnv) refOf(op *operator, id string) string {
	env.t.Helper()
	page := op.get(env.base + "dlq?" + url.Values{"queue": {env.dlq}, "message_id": {id}}.Encode())
	m := rabbitRefRE.FindAllStringSubmatch(page, -1)
	if len(m) != 1 {
		env.t.Fatalf("dead letter of %s: %d rows, want 1:\n%s", id, len(m), page)
	}
	return m[0][1]
}

// ranOnce is redriveRuns.ranOnce on the queue's consumer.
func (env *rabbitConsoleEnv) ranOnce(ids ...string) {
	env.t.Helper()
	env.redriveRuns.ranOnce(env.sourceDB, func() { env.settledIn(env.queue, 0) }, ids...)
}

// The console on a RabbitMQ dead-letter queue, as on a Kafka topic: the
// overview counts its dead letters by class; the list filters them by
// class, error text, source queue and message id; the record page shows
// the value (pretty JSON, hex) and the source queue; every view gives the
// messages back. A redrive by filter (max_attempts: b and d) dry-runs,
// then, although another redrive (of the queue's first dead letter,
// outside the filter) shifted the queue's positions and a matching dead
// letter came after the dry run, redrives exactly the two the dry run
// showed: each runs exactly once more and leaves the queue; the others
// and the late one stay. The same confirmation again redrives nothing; a
// confirmation numbered by another console process (or without the
// console's numbering) is refused; every action is logged with the
// operator's name.
func TestConsoleRabbitDeadLetters(t *testing.T) {
	env := seedRabbitConsole(t)
	op := newOperator(t, "alice")
	q := func(kv ...string) url.Values {
		v := url.Values{"queue": {env.dlq}}
		for i := 0; i+1 < len(kv); i += 2 {
			v.Set(kv[i], kv[i+1])
		}
		return v
	}

	over := op.get(env.base)
	mustContain(t, "overview", over, `id="dlq-queues"`, "No Kafka configured.", "Nothing found not ready.", "every queue)")
	row := regexp.MustCompile(`<a href="dlq\?queue=` + regexp.QuoteMeta(env.dlq) + `">[^<]+</a></td>((?:<td class="n">\d+</td>)+)`).FindStringSubmatch(over)
	if row == nil {
		t.Fatalf("overview: no row of %s:\n%s", env.dlq, over)
	}
	// undecodable, permanent, max_attempts, panic, oversized, crash_loop, total
	if got := regexp.MustCompile(`\d+`).FindAllString(row[1], -1); !slices.Equal(got, []string{"0", "3", "2", "0", "0", "0", "5"}) {
		t.Errorf("overview counts of %s: %v, want 3 permanent, 2 max_attempts, 5 in all", env.dlq, got)
	}

	for what, c := range map[string]struct {
		q    url.Values
		want string
	}{
		"all":         {q(), "5 dead letters match"},
		"permanent":   {q("class", "permanent"), "3 dead letters match"},
		"text":        {q("text", "FLAKY"), "2 dead letters match"},
		"queue":       {q("source", env.queue), "5 dead letters match"},
		"other queue": {q("source", env.queue+"-other"), "0 dead letters match"},
		"id":          {q("message_id", "c"), "1 dead letters match"},
		"until":       {q("until", "2000-01-01"), "0 dead letters match"},
	} {
		mustContain(t, "dlq "+what, op.get(env.base+"dlq?"+c.q.Encode()), c.want)
	}
	list := op.get(env.base + "dlq?" + q().Encode())
	mustContain(t, "dlq list", list, `<select name="queue"><option selected>`+env.dlq+`</option>`, "source queue")
	refs := map[string]string{}
	for _, id := range []string{"a", "b", "c", "d", "e"} {
		refs[id] = env.refOf(op, id)
	}
	env.settledIn(env.dlq, 5) // every view gave the messages back
	// Views one after the other each see every dead letter: the console
	// waits for a listing's messages to be back before the next.
	for i := range 30 {
		if page := op.get(env.base + "dlq?" + q().Encode()); !strings.Contains(page, "5 dead letters match") {
			t.Fatalf("view %d of 30 in a row: %s", i+1, matchRE.FindString(page))
		}
	}

	rec := op.get(env.base + "record?" + q("ref", refs["a"]).Encode())
	mustContain(t, "record a", rec, `&#34;amount&#34;: 10`, "queue "+env.queue+", delivery", "rejected: schema v1",
		`<a href="dlq?queue=`+env.dlq+`">`)
	mustContain(t, "record c", op.get(env.base+"record?"+q("ref", refs["c"]).Encode()), "(hex, 4 bytes)", "00 01 02 ff")

	// The dry run of the max_attempts ones (b and d, dead-lettered after
	// a retry: after the permanent ones in the queue).
	confirmQ := q("class", "max_attempts", "source", env.queue)
	confirmQ.Set("all", "1")
	confirm := op.get(env.base + "dlq-confirm?" + confirmQ.Encode())
	mustContain(t, "confirm", confirm, "<strong>2</strong> would be redriven", "<th>queue</th><td>"+env.dlq+"</td>")
	env.settledIn(env.dlq, 5)

	// Then the first dead letter of the queue, outside the filter, is
	// redriven from its page (the positions of b and d shift), and a
	// matching dead letter comes.
	first := slices.MinFunc([]string{"a", "c", "e"}, func(x, y string) int { return strings.Compare(refs[x], refs[y]) })
	if num := func(id string) int { n, _ := strconv.Atoi(strings.TrimPrefix(refs[id], "0/")); return n }; num(first) > min(num("b"), num("d")) {
		t.Fatalf("dead letters numbered %v: b or d before %s, the redrive of which would not shift them", refs, first)
	}
	env.fixed.Store(true)
	recFirst := op.get(env.base + "record?" + q("ref", refs[first]).Encode())
	bare := url.Values{"csrf": {csrfOf(t, recFirst)}, "queue": {env.dlq}, "ref": {refs[first]}}
	if code, body, _ := op.post(env.base+"dlq-redrive", bare, ""); code != http.StatusBadRequest || !strings.Contains(body, "run the dry run again") {
		t.Fatalf("redrive %s without the console's numbering: %d %s, want 400", first, code, body)
	}
	code, body, hdr := op.post(env.base+"dlq-redrive", confirmForm(t, recFirst), "")
	if code != http.StatusSeeOther {
		t.Fatalf("redrive %s from its page: %d %s", first, code, body)
	}
	mustContain(t, "redrive one", op.get(env.base+hdr.Get("Location")), "redrove 1 of 1")
	env.publishDeadLetterOf(env.dlq, "late", dlq.ClassMaxAttempts)
	env.settledIn(env.dlq, 5) // 2 of a c e, b, d, late
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, env.base+"record?"+q("ref", refs[first]).Encode(), nil)
	if code, body, _ := op.do(req); code != http.StatusBadRequest || !strings.Contains(body, "no record "+refs[first]) {
		t.Errorf("the record page of %s, redriven: %d %s, want 400 no record", first, code, body)
	}

	// A confirmation numbered by another console process is refused.
	form := confirmForm(t, confirm)
	if form.Get("numbering") == "" {
		t.Fatalf("the confirmation carries no numbering: %v", form)
	}
	forged := withoutCSRF(form)
	forged.Set("csrf", form.Get("csrf"))
	forged.Set("numbering", "another-process")
	if code, body, _ := op.post(env.base+"dlq-redrive", forged, ""); code != http.StatusBadRequest || !strings.Contains(body, "run the dry run again") {
		t.Errorf("a confirmation of another numbering: %d %s, want 400", code, body)
	}

	code, body, hdr = op.post(env.base+"dlq-redrive", form, "")
	if code != http.StatusSeeOther || !strings.HasPrefix(hdr.Get("Location"), "dlq?") {
		t.Fatalf("confirm: %d %s %v", code, body, hdr)
	}
	mustContain(t, "after redrive", op.get(env.base+hdr.Get("Location")), "redrove 2 of 2 selected dead letters")
	env.ranOnce(first, "b", "d")
	env.settledIn(env.dlq, 3)
	left := slices.DeleteFunc([]string{"a", "c", "e", "late"}, func(id string) bool { return id == first })
	if ids, _ := env.deadLetterIDs(); !slices.Equal(slices.Sorted(slices.Values(ids)), left) {
		t.Fatalf("left in the dead-letter queue: %v, want %v (outside the filter, and late: after the dry run)", ids, left)
	}

	// The same confirmation again: b and d are gone, late is not its.
	code, _, hdr = op.post(env.base+"dlq-redrive", form, "")
	if code != http.StatusSeeOther {
		t.Fatalf("second confirm: %d", code)
	}
	mustContain(t, "second redrive", op.get(env.base+hdr.Get("Location")), "redrove 0 of 0")
	env.settledIn(env.dlq, 3)
	env.ranOnce(first, "b", "d")
	if logs := env.logs.String(); strings.Count(logs, "who=alice") != 5 || !strings.Contains(logs, "queue="+env.dlq) {
		t.Errorf("want 5 actions logged with the operator and the queue (3 redrives, 2 refused):\n%s", logs)
	}
}

// A read-only console shows a RabbitMQ dead-letter queue but offers no
// action and refuses a redrive (403), leaving the queue as it was; a
// queue named that does not exist is an error on the page; the console
// refuses RabbitMQ without queue names, and never shows the password.
func TestConsoleRabbitReadOnly(t *testing.T) {
	e := newRabbitEnv(t)
	e.publishDeadLetter(e.dlq, "x")
	missing := e.dlq + "-missing"
	srv := mountConsole(t, console.Config{Pool: e.db.Pool, Schema: e.db.Schema, AMQPURL: rabbitURL,
		DeadLetterQueues: []string{e.dlq, missing}})
	op := newOperator(t, "bob")
	page := op.get(srv.URL + "/ops/dlq?" + url.Values{"queue": {e.dlq}}.Encode())
	mustContain(t, "read-only list", page, "1 dead letters match", "<td>x</td>")
	if strings.Contains(page, "Redrive") {
		t.Errorf("actions on a read-only console:\n%s", page)
	}
	if code, _, _ := op.post(srv.URL+"/ops/dlq-redrive", url.Values{"queue": {e.dlq}, "all": {"1"}}, ""); code != http.StatusForbidden {
		t.Errorf("a redrive on a read-only console: %d, want 403", code)
	}
	e.settledIn(e.dlq, 1)
	page = op.get(srv.URL + "/ops/dlq?" + url.Values{"queue": {missing}}.Encode())
	mustContain(t, "missing queue", page, `class="err"`, "does not exist")
	e.settledIn(e.dlq, 1)

	// RabbitMQ unreachable: the page says where, without the password.
	down := mountConsole(t, console.Config{Pool: e.db.Pool, Schema: e.db.Schema, AMQPURL: "amqp://guest:s3cret@127.0.0.1:1/",
		DeadLetterQueues: []string{e.dlq}})
	page = op.get(down.URL + "/ops/dlq")
	mustContain(t, "unreachable", page, `class="err"`, "RabbitMQ at amqp://REDACTED@127.0.0.1:1/")
	if over := op.get(down.URL + "/ops/"); strings.Contains(page+over, "s3cret") {
		t.Errorf("a page shows the AMQP password:\n%s\n%s", page, over)
	}
	if _, err := console.New(console.Config{Pool: e.db.Pool, AMQPURL: rabbitURL}); err == nil || !strings.Contains(err.Error(), "DeadLetterQueues") {
		t.Errorf("RabbitMQ without queue names: %v, want a Config.DeadLetterQueues error", err)
	}
	if _, err := console.New(console.Config{Pool: e.db.Pool, AMQPURL: "http://guest:s3cret@host/", DeadLetterQueues: []string{"q"}}); err == nil || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("a URL that is not AMQP: %v, want an error without the password", err)
	}
}

// Confirmations of one dry run, sent at once, and views beside them: each
// redriven dead letter runs exactly once, the confirmations together
// redrive each once (a later one finds them gone: it redrives nothing, or
// reports them no longer in the queue), and every view sees the queue
// before or after a redrive, whole: never a listing's messages missing.
func TestConsoleRabbitConcurrentConfirmations(t *testing.T) {
	env := seedRabbitConsole(t)
	op := newOperator(t, "carol")
	confirmQ := url.Values{"queue": {env.dlq}, "class": {"max_attempts"}, "all": {"1"}}
	confirm := op.get(env.base + "dlq-confirm?" + confirmQ.Encode())
	mustContain(t, "confirm", confirm, "<strong>2</strong> would be redriven")
	form := confirmForm(t, confirm)
	env.fixed.Store(true)

	const confirmations, viewers = 4, 4
	var wg sync.WaitGroup
	var mu sync.Mutex
	redrove, seen := 0, map[string]int{}
	for range confirmations {
		wg.Go(func() {
			code, body, hdr := op.post(env.base+"dlq-redrive", form, "")
			mu.Lock()
			defer mu.Unlock()
			switch {
			case code == http.StatusSeeOther:
				loc, _ := url.Parse(hdr.Get("Location"))
				var n int
				if _, err := fmt.Sscanf(loc.Query().Get("done"), "redrove %d of", &n); err != nil {
					t.Errorf("confirmation: %q", loc.Query().Get("done"))
				}
				redrove += n
			case code == http.StatusInternalServerError && strings.Contains(body, "no longer in queue"):
			default:
				t.Errorf("confirmation: %d %s", code, body)
			}
		})
	}
	for range viewers {
		wg.Go(func() {
			for range 5 {
				page := op.get(env.base + "dlq?" + url.Values{"queue": {env.dlq}}.Encode())
				mu.Lock()
				seen[matchRE.FindString(page)]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if redrove != 2 {
		t.Errorf("the confirmations redrove %d dead letters in all, want 2", redrove)
	}
	if seen["5 dead letters match"]+seen["3 dead letters match"] != viewers*5 {
		t.Errorf("views saw %v, want only 5 (before) or 3 (after)", seen)
	}
	env.ranOnce("b", "d")
	env.settledIn(env.dlq, 3)
}

// The RabbitMQ pages are served from a snapshot, the queue's last listing:
// views while the queue's count is unchanged list nothing (the dead
// letters stay ready for other readers); a dead letter that arrives after
// the snapshot shows in a later view (the count changed: a view lists the
// queue again, in the background, and until then says that its snapshot
// is older than the queue). A redrive by filter, confirmed while dead
// letters inside and outside the filter arrived after the snapshot and
// after the dry run, redrives exactly those the dry run showed, each once,
// and touches nothing else.
func TestConsoleRabbitSnapshot(t *testing.T) {
	env := seedRabbitConsole(t)
	op := newOperator(t, "dave")
	view := func(kv ...string) string {
		v := url.Values{"queue": {env.dlq}}
		for i := 0; i+1 < len(kv); i += 2 {
			v.Set(kv[i], kv[i+1])
		}
		return op.get(env.base + "dlq?" + v.Encode())
	}
	mustContain(t, "first view", view(), "5 dead letters match")
	env.settledIn(env.dlq, 5)

	// Views of an unchanged queue: the snapshot. A listing would hold the
	// dead letters; a reader beside the views always finds all five.
	reader := env.openDLQ()
	for i := range 10 {
		if page := view(); !strings.Contains(page, "5 dead letters match") || strings.Contains(page, `class="note"`) {
			t.Fatalf("view %d of an unchanged queue: %s", i+1, matchRE.FindString(page))
		}
	}
	if all, err := reader.Entries(t.Context(), dlq.Filter{}); err != nil || len(all) != 5 {
		t.Fatalf("a listing beside the views: %d dead letters, %v; want 5 (the views hold none)", len(all), err)
	}
	_ = reader.Close()
	env.settledIn(env.dlq, 5)

	// Dead letters after the snapshot: one outside the filter to come
	// (permanent), one inside (max_attempts). Each view shows the snapshot
	// with a note until one shows them.
	env.publishDeadLetterOf(env.dlq, "after-snapshot-out", dlq.ClassPermanent)
	env.publishDeadLetterOf(env.dlq, "after-snapshot-in", dlq.ClassMaxAttempts)
	env.settledIn(env.dlq, 7)
	notes := 0
	testenv.Eventually(t, 30*time.Second, "the dead letters that came after the snapshot in a view", func() bool {
		page := view()
		if strings.Contains(page, "7 dead letters match") {
			mustContain(t, "view after the snapshot", page, "after-snapshot-out", "after-snapshot-in")
			return true
		}
		mustContain(t, "a view of the snapshot", page, "5 dead letters match", `class="note"`, "it holds 7 ready now")
		notes++
		return false
	})
	t.Logf("%d views showed the snapshot before the queue's new listing", notes)

	// The dry run of max_attempts: b, d and after-snapshot-in.
	confirm := op.get(env.base + "dlq-confirm?" + url.Values{"queue": {env.dlq}, "class": {"max_attempts"}, "all": {"1"}}.Encode())
	mustContain(t, "confirm", confirm, "<strong>3</strong> would be redriven")
	form := confirmForm(t, confirm)
	env.publishDeadLetterOf(env.dlq, "after-dry-run-in", dlq.ClassMaxAttempts)
	env.publishDeadLetterOf(env.dlq, "after-dry-run-out", dlq.ClassUndecodable)
	env.settledIn(env.dlq, 9)
	env.fixed.Store(true)
	code, body, hdr := op.post(env.base+"dlq-redrive", form, "")
	if code != http.StatusSeeOther {
		t.Fatalf("confirm: %d %s", code, body)
	}
	mustContain(t, "after redrive", op.get(env.base+hdr.Get("Location")), "redrove 3 of 3 selected dead letters", "1 dead letters match", "after-dry-run-in")
	env.ranOnce("b", "d", "after-snapshot-in")
	env.settledIn(env.dlq, 6)
	want := []string{"a", "after-dry-run-in", "after-dry-run-out", "after-snapshot-out", "c", "e"}
	if ids, _ := env.deadLetterIDs(); !slices.Equal(slices.Sorted(slices.Values(ids)), want) {
		t.Fatalf("left in the dead-letter queue: %v, want %v", ids, want)
	}
}

// A console whose ViewWait passes before a RabbitMQ queue is listed shows
// the page at once, with a note that the listing goes on, and the dead
// letters at a later view.
func TestConsoleRabbitFirstViewWait(t *testing.T) {
	e := newRabbitEnv(t)
	for i := range 3 {
		e.publishDeadLetter(e.dlq, "x"+strconv.Itoa(i))
	}
	e.settledIn(e.dlq, 3)
	srv := mountConsole(t, console.Config{Pool: e.db.Pool, Schema: e.db.Schema, AMQPURL: rabbitURL,
		DeadLetterQueues: []string{e.dlq}, ViewWait: time.Nanosecond})
	op := newOperator(t, "erin")
	page := op.get(srv.URL + "/ops/dlq?" + url.Values{"queue": {e.dlq}}.Encode())
	mustContain(t, "first view", page, "0 dead letters match", `class="note"`, "Listing queue "+e.dlq+" (3 messages ready) in the background")
	testenv.Eventually(t, 30*time.Second, "the listing's dead letters in a view", func() bool {
		return strings.Contains(op.get(srv.URL+"/ops/dlq?"+url.Values{"queue": {e.dlq}}.Encode()), "3 dead letters match")
	})
	e.settledIn(e.dlq, 3)
}
