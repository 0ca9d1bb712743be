// Package jsoncheck holds the tests' checks of the CLI's --json output:
// JSON Lines whose keys are snake_case.
package jsoncheck

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"
)

var snakeCase = regexp.MustCompile(`^[a-z][a-z0-9]*(_[a-z0-9]+)*$`)

// CheckSnakeCase fails t for every key of the decoded JSON value v, at any
// depth, that is not snake_case. The values under the keys named in data
// are data (e.g. Kafka header names) and are not checked.
func CheckSnakeCase(t testing.TB, where string, v any, data ...string) {
	t.Helper()
	switch v := v.(type) {
	case map[string]any:
	keys:
		for k, sub := range v {
			if !snakeCase.MatchString(k) {
				t.Errorf("%s: key %q is not snake_case", where, k)
			}
			for _, d := range data {
				if k == d {
					continue keys
				}
			}
			CheckSnakeCase(t, where+"."+k, sub, data...)
		}
	case []any:
		for _, sub := range v {
			CheckSnakeCase(t, where, sub, data...)
		}
	}
}

// CheckJSONLines fails t unless every line of out is a JSON object whose
// keys are snake_case (CheckSnakeCase), and returns the number of lines.
func CheckJSONLines(t testing.TB, where, out string, data ...string) int {
	t.Helper()
	n := 0
	for line := range strings.Lines(out) {
		var v map[string]any
		if err := json.Unmarshal([]byte(line), &v); err != nil {
			t.Errorf("%s: line %q is not a JSON object: %v", where, line, err)
			continue
		}
		CheckSnakeCase(t, where, v, data...)
		n++
	}
	return n
}
