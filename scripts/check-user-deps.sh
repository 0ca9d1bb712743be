#!/usr/bin/env bash
# make check-user-deps: the dependency graph a user of the library gets.
#
# Makes a throwaway module that imports every public package of the library
# (replace pointing at this checkout), runs `go mod tidy` in it, prints the
# number of modules and go.sum lines it pulled, and fails if go.sum names a
# test-only dependency (testcontainers, docker, moby, kfake): those belong to
# the nested modules, never to the module users import. A second module
# imports the test kit, oncelytest, as a user's tests do: kfake is expected
# there, a container library is not.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
GO=${GO:-go}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# userModule DIR PACKAGES...: a module in DIR whose main package imports
# PACKAGES, tidied and built as a user's would be (GOWORK=off: no workspace).
userModule() {
	local dir=$1
	shift
	mkdir -p "$dir"
	{
		echo "module example.com/oncelyuser"
		echo
		echo "go $(cd "$root" && GOWORK=off $GO list -m -f '{{.GoVersion}}')"
		echo
		echo "require ("
		echo "	github.com/oncely/oncely v0.0.0"
		echo "	github.com/oncely/oncely/oncelytest v0.0.0"
		echo ")"
		echo
		echo "replace ("
		echo "	github.com/oncely/oncely => $root"
		echo "	github.com/oncely/oncely/oncelytest => $root/oncelytest"
		echo ")"
	} >"$dir/go.mod"
	{
		echo "package main"
		echo
		echo "import ("
		for p in "$@"; do echo "	_ \"$p\""; done
		echo ")"
		echo
		echo "func main() {}"
	} >"$dir/main.go"
	(cd "$dir" && GOWORK=off GOFLAGS=-mod=mod $GO mod tidy && GOWORK=off $GO build ./...)
}

# report DIR WHAT PATTERN: print DIR's counts; fail if its go.sum matches PATTERN.
report() {
	local dir=$1 what=$2 pattern=$3 lines sum_modules graph_modules bad
	lines=$(wc -l <"$dir/go.sum")
	sum_modules=$(awk '{print $1}' "$dir/go.sum" | sort -u | wc -l)
	graph_modules=$(cd "$dir" && GOWORK=off $GO list -m all | wc -l)
	echo "check-user-deps: $what: go.sum $lines lines, $sum_modules modules; go list -m all: $graph_modules modules"
	if bad=$(grep -Ei "$pattern" "$dir/go.sum"); then
		echo "check-user-deps: $what: go.sum names test-only dependencies:" >&2
		echo "$bad" | awk '{print "  " $1 " " $2}' | sort -u >&2
		return 1
	fi
}

# Public packages: not main, not internal. GOWORK=off: the root module alone,
# as a user sees it.
mapfile -t pkgs < <(cd "$root" && GOWORK=off $GO list -e -f '{{if and .GoFiles (ne .Name "main")}}{{.ImportPath}}{{end}}' ./... | grep -v '/internal/' | grep .)
if [ ${#pkgs[@]} -eq 0 ]; then
	echo "check-user-deps: no library packages found" >&2
	exit 1
fi

userModule "$tmp/library" "${pkgs[@]}"
report "$tmp/library" "the ${#pkgs[@]} library packages" 'testcontainers|docker|moby|kfake'
userModule "$tmp/testkit" "${pkgs[@]}" github.com/oncely/oncely/oncelytest
report "$tmp/testkit" "the library and oncelytest" 'testcontainers|docker|moby'
echo "check-user-deps: no testcontainers, docker or moby for users, and kfake only with oncelytest"
