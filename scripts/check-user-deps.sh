#!/usr/bin/env bash
# make check-user-deps: the dependency graph a user of the library gets.
#
# Makes a throwaway module that imports every public package of the library
# (replace pointing at this checkout), runs `go mod tidy` in it, prints the
# number of modules and go.sum lines it pulled, and fails if go.sum names a
# test-only dependency (testcontainers, docker, moby, kfake): those belong to
# the nested test modules, never to the module users import.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
GO=${GO:-go}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Public packages: not main, not internal. GOWORK=off: the root module alone,
# as a user sees it.
mapfile -t pkgs < <(cd "$root" && GOWORK=off $GO list -e -f '{{if and .GoFiles (ne .Name "main")}}{{.ImportPath}}{{end}}' ./... | grep -v '/internal/' | grep .)
if [ ${#pkgs[@]} -eq 0 ]; then
	echo "check-user-deps: no library packages found" >&2
	exit 1
fi

{
	echo "module example.com/oncelyuser"
	echo
	echo "go $(cd "$root" && GOWORK=off $GO list -m -f '{{.GoVersion}}')"
	echo
	echo "require github.com/oncely/oncely v0.0.0"
	echo
	echo "replace github.com/oncely/oncely => $root"
} >"$tmp/go.mod"
{
	echo "package main"
	echo
	echo "import ("
	for p in "${pkgs[@]}"; do echo "	_ \"$p\""; done
	echo ")"
	echo
	echo "func main() {}"
} >"$tmp/main.go"

(cd "$tmp" && GOWORK=off GOFLAGS=-mod=mod $GO mod tidy)
(cd "$tmp" && GOWORK=off $GO build ./...)

lines=$(wc -l <"$tmp/go.sum")
sum_modules=$(awk '{print $1}' "$tmp/go.sum" | sort -u | wc -l)
graph_modules=$(cd "$tmp" && GOWORK=off $GO list -m all | wc -l)
echo "check-user-deps: ${#pkgs[@]} library packages imported; go.sum: $lines lines, $sum_modules modules; go list -m all: $graph_modules modules"

if bad=$(grep -Ei 'testcontainers|docker|moby|kfake' "$tmp/go.sum"); then
	echo "check-user-deps: a user's go.sum names test-only dependencies:" >&2
	echo "$bad" | awk '{print "  " $1 " " $2}' | sort -u >&2
	exit 1
fi
echo "check-user-deps: no testcontainers, docker, moby or kfake in a user's go.sum"
