package integration_test

import (
	"context"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	"github.com/oncely/oncely/natsconsumer"
)

// chromiumPath finds Debian's chromium. The browser test is skipped without
// it unless ONCELY_BROWSER_TEST=1 (scripts/install-chromium.sh installs it).
func chromiumPath(t *testing.T) string {
	t.Helper()
	for _, p := range []string{os.Getenv("CHROMIUM"), "/usr/bin/chromium", "/usr/bin/chromium-browser"} {
		if p != "" {
			if _, err := exec.LookPath(p); err == nil {
				return p
			}
		}
	}
	if os.Getenv("ONCELY_BROWSER_TEST") == "1" {
		t.Fatal("ONCELY_BROWSER_TEST=1 but no chromium: run scripts/install-chromium.sh")
	}
	t.Skip("no chromium (scripts/install-chromium.sh installs it; ONCELY_BROWSER_TEST=1 makes its absence a failure)")
	return ""
}

// The console in a real headless Chromium: an operator filters the dead
// letters, redrives every match through the dry run and its confirmation,
// retries the parked outbox row and pauses the failing webhook endpoint by
// clicking through the pages; the effects are checked in Kafka and
// Postgres. With ONCELY_CONSOLE_SCREENSHOTS=dir each page is saved there as
// a PNG (make console-screenshots writes docs/console/).
func TestConsoleInBrowser(t *testing.T) {
	env := seedConsole(t)
	run, shot := browser(t)
	var text string

	run("overview", chromedp.Navigate(env.base), chromedp.WaitVisible("h1"), chromedp.Text("main", &text), shot("overview"))
	if !strings.Contains(text, env.dlqTopic) || !strings.Contains(text, env.group) {
		t.Errorf("overview shows no dead-letter topic or group:\n%s", text)
	}
	// Each part of the overview is rendered and visible: what is not ready
	// (the parked row), the lag per group and topic with its trend, the
	// dead letters per hour and per day, the outbox per topic, the inbox's
	// horizon and the endpoints by breaker state.
	for sel, want := range map[string]string{
		`#not-ready`:     "1 parked rows hold their keys' later rows back",
		`#lag tr.total`:  env.group,
		`#lag`:           "trend",
		`#dlq-hours`:     "last 24 hours, by hour",
		`#dlq-days`:      "last 14 days, by day",
		`#outbox-topics`: "payments",
		`#inbox-counts`:  env.group,
		`#inbox-horizon`: "Oldest row:",
		`#webhooks`:      "breaker closed",
	} {
		run("overview "+sel, chromedp.WaitVisible(sel), chromedp.Text(sel, &text))
		if !strings.Contains(text, want) {
			t.Errorf("overview %s: %q, want it to say %q", sel, text, want)
		}
	}

	// Filter: permanent failures whose error mentions schema v1.
	run("filter",
		chromedp.Navigate(env.base+"dlq"), chromedp.WaitVisible(`form.filter`),
		chromedp.SetValue(`select[name="class"]`, "permanent"),
		chromedp.SendKeys(`input[name="text"]`, "schema v1"),
		chromedp.Click(`form.filter button[type="submit"]`),
		chromedp.WaitVisible(`//p[contains(., "3 dead letters match")]`),
		shot("dead-letters"))
	run("dry run",
		chromedp.Click(`button[name="all"]`),
		chromedp.WaitVisible(`#dry-run`), chromedp.Text(`#dry-run`, &text), shot("redrive-confirm"))
	if !strings.Contains(text, "3 would be redriven") {
		t.Fatalf("dry run: %q", text)
	}
	run("confirm",
		chromedp.Click(`button.danger`),
		chromedp.WaitVisible(`p.done`), chromedp.Text(`p.done`, &text))
	if !strings.Contains(text, "redrove 3 of 3") {
		t.Fatalf("after the confirmation: %q", text)
	}
	if got := redrivenIDs(t, env); !slices.Equal(got, []string{"a", "c", "e"}) {
		t.Fatalf("redriven to Kafka: %v, want [a c e] (b and d are outside the filter)", got)
	}
	env.runFixed(t, "a", "c", "e")

	run("record", chromedp.Navigate(env.base+"record?"+url.Values{"topic": {env.dlqTopic}, "ref": {"0/0"}}.Encode()),
		chromedp.WaitVisible(`pre.value`), chromedp.Text(`pre.value`, &text), shot("dead-letter-record"))
	if !strings.Contains(text, `"amount": 10`) {
		t.Errorf("record value not pretty JSON: %q", text)
	}
	run("inbox", chromedp.Navigate(env.base+"inbox?message_id=a"), chromedp.WaitVisible(`#lookup`),
		chromedp.Text(`#lookup`, &text), shot("inbox"))
	if !strings.Contains(text, "processed") {
		t.Errorf("inbox lookup of a after its redrive: %q", text)
	}

	// Retry the parked outbox row.
	id := strconv.FormatInt(env.parkedID, 10)
	run("outbox", chromedp.Navigate(env.base+"outbox"), chromedp.WaitVisible(`#retry-`+id), shot("outbox"),
		chromedp.Click(`#retry-`+id), chromedp.WaitVisible(`p.done`), chromedp.Text(`p.done`, &text))
	if !strings.Contains(text, "un-parked") {
		t.Errorf("after retry: %q", text)
	}
	var parked bool
	if err := env.db.Pool.QueryRow(context.Background(), `SELECT parked_at IS NOT NULL FROM outbox WHERE id = $1`, env.parkedID).Scan(&parked); err != nil || parked {
		t.Errorf("outbox row %s still parked (%v)", id, err)
	}

	// Pause the failing endpoint.
	run("webhooks", chromedp.Navigate(env.base+"webhooks"), chromedp.WaitVisible(`#subs`), shot("webhooks"),
		chromedp.Click(`form[action="webhooks-pause"] button`), chromedp.WaitVisible(`p.done`), chromedp.Text(`#subs`, &text))
	if !strings.Contains(text, "paused in the console by browser-operator") {
		t.Errorf("webhooks after pause: %q", text)
	}
	if s, err := env.store.GetSubscription(context.Background(), env.db.Pool, env.sub.ID); err != nil || !s.Paused() {
		t.Errorf("subscription not paused in Postgres: %v", err)
	}
	if logs := env.logs.String(); strings.Count(logs, "who=browser-operator") != 3 {
		t.Errorf("want 3 actions logged with the operator's name:\n%s", logs)
	}
}

// browser starts a headless Chromium for the test (skipping it without
// one, see chromiumPath) and returns run, which runs actions in it and
// fails the test on an error, and shot, an action that saves a PNG of the
// whole page as ONCELY_CONSOLE_SCREENSHOTS/name.png when that is set. The
// browser sends X-User: browser-operator, which the tests' Auth hook takes
// for the operator's name.
func browser(t *testing.T) (run func(what string, actions ...chromedp.Action), shot func(name string) chromedp.Action) {
	t.Helper()
	chromium := chromiumPath(t)
	shots := os.Getenv("ONCELY_CONSOLE_SCREENSHOTS")

	// A fresh profile; chromium's helper processes may still write to it
	// for a moment after the browser exits, so it is removed best effort
	// rather than by t.TempDir's strict cleanup.
	profile, err := os.MkdirTemp("", "oncely-chromium-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for i := 0; i < 50 && os.RemoveAll(profile) != nil; i++ {
			time.Sleep(100 * time.Millisecond) // a helper process still writing
		}
	})
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromium),
		chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun, chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(profile),
		chromedp.WindowSize(1280, 860),
	}
	actx, cancelA := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancelA)
	bctx, cancelB := chromedp.NewContext(actx)
	t.Cleanup(cancelB)
	ctx, cancel := context.WithTimeout(bctx, 2*time.Minute)
	t.Cleanup(cancel)

	run = func(what string, actions ...chromedp.Action) {
		t.Helper()
		if err := chromedp.Run(ctx, actions...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	shot = func(name string) chromedp.Action {
		return chromedp.ActionFunc(func(ctx context.Context) error {
			if shots == "" {
				return nil
			}
			var png []byte
			if err := chromedp.FullScreenshot(&png, 100).Do(ctx); err != nil { // the whole page, as PNG
				return err
			}
			return os.WriteFile(filepath.Join(shots, name+".png"), png, 0o644)
		})
	}
	run("start", network.Enable(), network.SetExtraHTTPHeaders(network.Headers{"X-User": "browser-operator"}))
	return run, shot
}

// The JetStream dead-letter pages in a real headless Chromium, on a
// console with JetStream only: the overview counts the stream's dead
// letters, the operator filters them, redrives every match through the dry
// run and its confirmation, each redriven message runs exactly once more,
// and a record shows its value and provenance.
func TestConsoleJetStreamInBrowser(t *testing.T) {
	env := seedNATSConsole(t)
	run, shot := browser(t)
	redriveInBrowser(t, run, shot, env.redriveRuns, "stream", env.dlq, env.subject, "jetstream", env.stream)
	env.ranOnce("a", "c", "e")
	var text string
	run("record",
		chromedp.Navigate(env.base+"record?"+url.Values{"stream": {env.dlq}, "ref": {env.refs["a"]}}.Encode()),
		chromedp.WaitVisible(`pre.value`), chromedp.Text(`main`, &text), shot("jetstream-dead-letter-record"))
	if !strings.Contains(text, `"amount": 10`) || !strings.Contains(text, natsconsumer.HeaderStream) {
		t.Errorf("record a: no pretty JSON or no provenance header:\n%s", text)
	}
	if logs := env.logs.String(); strings.Count(logs, "who=browser-operator") != 1 {
		t.Errorf("want the redrive logged with the operator's name:\n%s", logs)
	}
}

// The RabbitMQ dead-letter pages in a real headless Chromium, on a console
// with RabbitMQ only: the overview counts the queue's dead letters, the
// operator filters them, redrives every match through the dry run and its
// confirmation, each redriven message runs exactly once more while the
// others stay in the queue, and a record shows its value and source queue.
func TestConsoleRabbitMQInBrowser(t *testing.T) {
	env := seedRabbitConsole(t)
	run, shot := browser(t)
	redriveInBrowser(t, run, shot, env.redriveRuns, "queue", env.dlq, env.queue, "rabbitmq", env.queue)
	env.ranOnce("a", "c", "e")
	env.settledIn(env.dlq, 2)
	if ids, _ := env.deadLetterIDs(); !slices.Equal(slices.Sorted(slices.Values(ids)), []string{"b", "d"}) {
		t.Errorf("left in the dead-letter queue: %v, want b and d", ids)
	}
	env.settledIn(env.dlq, 2)
	ref := env.refOf(newOperator(t, "reader"), "b")
	var text string
	run("record",
		chromedp.Navigate(env.base+"record?"+url.Values{"queue": {env.dlq}, "ref": {ref}}.Encode()),
		chromedp.WaitVisible(`pre.value`), chromedp.Text(`main`, &text), shot("rabbitmq-dead-letter-record"))
	if !strings.Contains(text, "boom") || !strings.Contains(text, "queue "+env.queue+", delivery") {
		t.Errorf("record b: no value or no source queue:\n%s", text)
	}
	if logs := env.logs.String(); strings.Count(logs, "who=browser-operator") != 1 {
		t.Errorf("want the redrive logged with the operator's name:\n%s", logs)
	}
}

// redriveInBrowser drives the dead-letter pages of a broker's place (a
// stream, a queue: noun) in the browser: the overview's table of them
// shows place; the operator follows it, filters the permanent dead
// letters of source with "schema v1" (3 of them), dry-runs a redrive of
// every match, fixes r's handler and confirms. prefix names the
// screenshots and the overview's section of the broker's backlog (its
// queues, its consumers), which shows backlog (a queue, a stream) with its
// consumer.
func redriveInBrowser(t *testing.T, run func(string, ...chromedp.Action), shot func(string) chromedp.Action, r *redriveRuns,
	noun, place, source, prefix, backlog string) {
	t.Helper()
	var text, lag string
	table := "#dlq-" + noun + "s"
	run("overview", chromedp.Navigate(r.base), chromedp.WaitVisible(table), chromedp.Text(table, &text),
		chromedp.Text("#"+prefix+"-lag", &lag), shot(prefix+"-overview"))
	if !strings.Contains(text, place) {
		t.Errorf("overview shows no dead-letter %s:\n%s", noun, text)
	}
	if !strings.Contains(lag, backlog) {
		t.Errorf("overview shows no backlog of %s:\n%s", backlog, lag)
	}
	run("filter",
		chromedp.Click(table+" a"), chromedp.WaitVisible(`form.filter`),
		chromedp.SetValue(`select[name="class"]`, "permanent"),
		chromedp.SendKeys(`input[name="text"]`, "schema v1"),
		chromedp.SendKeys(`input[name="source"]`, source),
		chromedp.Click(`form.filter button[type="submit"]`),
		chromedp.WaitVisible(`//p[contains(., "3 dead letters match")]`),
		shot(prefix+"-dead-letters"))
	run("dry run",
		chromedp.Click(`button[name="all"]`), chromedp.WaitVisible(`#dry-run`), chromedp.Text(`#dry-run`, &text),
		shot(prefix+"-redrive-confirm"))
	if !strings.Contains(text, "3 would be redriven") {
		t.Fatalf("dry run: %q", text)
	}
	r.fixed.Store(true)
	run("confirm", chromedp.Click(`button.danger`), chromedp.WaitVisible(`p.done`), chromedp.Text(`p.done`, &text))
	if !strings.Contains(text, "redrove 3 of 3") {
		t.Fatalf("after the confirmation: %q", text)
	}
}
