package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestQuickstartQuotesTheExample: every Go and SQL block of
// docs/QUICKSTART.md is a run of lines of this example's files (indentation
// aside), so the guide shows code that compiles and runs.
func TestQuickstartQuotesTheExample(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/QUICKSTART.md")
	if err != nil {
		t.Fatal(err)
	}
	var sources []string
	for _, f := range []string{"main.go", "payments_test.go", "schema.sql"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		sources = append(sources, trimLines(string(b)))
	}
	blocks := regexp.MustCompile("(?s)```(?:go|sql)\n(.*?)```").FindAllStringSubmatch(string(doc), -1)
	if len(blocks) < 10 {
		t.Fatalf("%d Go and SQL blocks in QUICKSTART.md; want the guide's excerpts", len(blocks))
	}
	for _, b := range blocks {
		quoted, found := trimLines(b[1]), false
		for _, src := range sources {
			found = found || strings.Contains("\n"+src+"\n", "\n"+quoted+"\n")
		}
		if !found {
			t.Errorf("QUICKSTART.md quotes code that is not in examples/payments:\n%s", b[1])
		}
	}
}

// trimLines strips each line's leading and trailing white space.
func trimLines(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	for i, l := range lines {
		lines[i] = strings.TrimSpace(l)
	}
	return strings.Join(lines, "\n")
}
