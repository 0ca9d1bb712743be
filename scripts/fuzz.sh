#!/usr/bin/env bash
# make fuzz: run every fuzz target of the module in turn, each for FUZZTIME
# (default 30s). go test -fuzz takes one target per package invocation, so
# the targets are listed per package with `go test -list` and run one by one.
#
#   FUZZTIME=5m scripts/fuzz.sh            # every target, 5 minutes each
#   scripts/fuzz.sh ./webhook/ ./dlq/      # only these packages
#   FUZZ_PARALLEL=1 scripts/fuzz.sh        # one fuzzing worker (shared machines)
#
# A failing input is written by go test to the package's
# testdata/fuzz/FuzzXxx/ directory; commit it with the fix, as a regression seed.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

fuzztime="${FUZZTIME:-30s}"
parallel="${FUZZ_PARALLEL:-$(nproc)}"
go="${GO:-go}"
if [ "$#" -gt 0 ]; then
	pkgs=("$@")
else
	mapfile -t pkgs < <("$go" list ./...)
fi

failed=0
ran=0
for pkg in "${pkgs[@]}"; do
	targets=$("$go" test -list '^Fuzz' "$pkg" | grep '^Fuzz' || true)
	for target in $targets; do
		echo "fuzz: $pkg $target for $fuzztime"
		start=$(date +%s)
		if ! "$go" test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" -parallel "$parallel" "$pkg"; then
			echo "fuzz: $pkg $target FAILED (the failing input is under testdata/fuzz/$target/)"
			failed=$((failed + 1))
		fi
		echo "fuzz: $pkg $target took $(( $(date +%s) - start ))s"
		ran=$((ran + 1))
	done
done
echo "fuzz: $ran targets run, $failed failed"
[ "$failed" -eq 0 ]
