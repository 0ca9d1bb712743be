package oncely_test

import (
	"bufio"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReadmeSnippetsCompile: every Go snippet in README.md and docs/ is an
// excerpt of a Go file of the repository (an Example, most of them, or an
// example program), so the code a reader copies compiles and is vetted with
// the rest.
func TestReadmeSnippetsCompile(t *testing.T) {
	sources := map[string]string{} // Go file -> its lines, trimmed, joined by "\n"
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".")) && path != "." {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(path, ".go") {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			sources[path] = normalize(string(b))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	docs, _ := filepath.Glob("docs/*.md")
	for _, doc := range append([]string{"README.md"}, docs...) {
		for _, s := range goSnippets(t, doc) {
			want := normalize(s.code)
			found := false
			for _, src := range sources {
				if strings.Contains(src, want) {
					found = true
					break
				}
			}
			if !found {
				t.Errorf("%s:%d: this Go snippet is not an excerpt of any Go file of the repository; quote an Example or an example program instead:\n%s", doc, s.line, s.code)
			}
		}
	}
}

type snippet struct {
	line int
	code string
}

func goSnippets(t *testing.T, path string) []snippet {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []snippet
	var cur *snippet
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case cur == nil && strings.TrimSpace(line) == "```go":
			cur = &snippet{line: n}
		case cur != nil && strings.TrimSpace(line) == "```":
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			cur.code += line + "\n"
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// normalize trims each line and drops empty ones, so indentation and blank
// lines do not matter.
func normalize(s string) string {
	var lines []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			lines = append(lines, l)
		}
	}
	return "\n" + strings.Join(lines, "\n") + "\n"
}
