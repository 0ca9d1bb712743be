package integration_test

import (
	"context"
	"net/http/httptest"
	"regexp"
	"strconv"
	"testing"

	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/internal/testenv"
)

var inboxTotalRE = regexp.MustCompile(`<th>all groups</th><td></td><td></td><td class="n">(≈ )?(\d+)</td>`)

// Above 100,000 rows the inbox is estimated, and says so: from its pages
// while the planner has no statistics of it, from the planner's row count
// once analyzed; within a few percent either way. Exact counts are there on
// request. Every group is listed, the one too small to be sampled too.
func TestConsoleInboxCountsAreEstimatedAndSaySo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.Migrated(t)
	for _, q := range []string{
		`ALTER TABLE inbox SET (autovacuum_enabled = false)`, // no statistics until the test analyzes
		`INSERT INTO inbox (consumer_group, message_id, outcome)
			SELECT 'big-' || (i % 2), 'm-' || i, CASE WHEN i % 10 = 0 THEN 'dead_lettered' ELSE 'processed' END
			FROM generate_series(1, 200000) i`,
		`INSERT INTO inbox (consumer_group, message_id) VALUES ('tiny', 'only')`,
	} {
		if _, err := db.Pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	h, err := console.New(console.Config{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	total := func(page string) (int, bool) {
		t.Helper()
		m := inboxTotalRE.FindStringSubmatch(page)
		if m == nil {
			t.Fatalf("no total in:\n%s", page)
		}
		n, _ := strconv.Atoi(m[2])
		return n, m[1] != ""
	}
	near := func(what string, got, want int, within float64) {
		t.Helper()
		if d := float64(got-want) / float64(want); d > within || d < -within {
			t.Errorf("%s: %d rows, want %d ± %.0f%%", what, got, want, within*100)
		}
	}

	page := getPage(t, srv.URL+"/inbox")
	n, est := total(page)
	mustContain(t, "never analyzed", page, "never analyzed", "<td>tiny</td>", "<td>big-0</td>", `href="inbox?exact=1"`)
	if !est {
		t.Errorf("the total of a 200,001-row table is not marked as estimated")
	}
	near("from the pages", n, 200001, 0.15)

	page = getPage(t, srv.URL+"/inbox?exact=1")
	if n, est := total(page); n != 200001 || est {
		t.Errorf("exact counts: %d (estimated %v), want 200001 exactly", n, est)
	}
	mustContain(t, "exact", page, `<td>tiny</td><td class="n">1</td>`)

	if _, err := db.Pool.Exec(ctx, `ANALYZE inbox`); err != nil {
		t.Fatal(err)
	}
	page = getPage(t, srv.URL+"/inbox")
	n, est = total(page)
	if !est || regexp.MustCompile("never analyzed").MatchString(page) {
		t.Errorf("after ANALYZE: estimated %v, or still said to be from the pages", est)
	}
	near("from the planner", n, 200001, 0.05)
}
