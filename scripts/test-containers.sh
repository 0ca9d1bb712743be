#!/usr/bin/env bash
# make test-containers: run the integration suite with every Postgres started
# by testcontainers-go, on machines without Docker and without a registry.
#
# As root it installs podman, runc and busybox-static if missing, writes
# /etc/containers/containers.conf if absent, starts podman's Docker-compatible
# API service (stopped by PID on exit), builds localhost/oncely-postgres:15
# from the host's PostgreSQL 15 with scripts/postgres-image/build.sh, and runs
# `go test -race` on the integration suite with DATABASE_URL unset. Kafka
# stays the in-process kfake broker.
#
# Arguments replace the default test arguments, e.g.
#   scripts/test-containers.sh -run TestPostgresOutage -count=3 ./integration_test/
set -euo pipefail

root="$(git rev-parse --show-toplevel)"
cd "$root"

image=localhost/oncely-postgres:15 # built below from the host's PostgreSQL 15
# A socket of this run's own: another run on the machine may start and stop
# its service meanwhile (podman's storage is shared, the services are not).
socket="/run/podman/oncely-test-$$.sock"
build_script="$root/scripts/postgres-image/build.sh"
if [ "$#" -gt 0 ]; then
	test_args=("$@")
else
	test_args=(-race -count=1 -timeout 20m ./integration_test/...)
fi

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }
log() { echo "test-containers: $*"; }

t_start=$(now)
log "start $(date -u +%FT%TZ)"

if [ "$(id -u)" -ne 0 ]; then
	echo "test-containers: must run as root (it installs packages and runs podman's rootful API service)" >&2
	exit 1
fi

# --- packages -----------------------------------------------------------------
# (Outputs go to variables before grep: with pipefail, grep -q closing the
# pipe early would make the pipeline fail.)
installed() {
	local status
	status=$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)
	[ "$status" = "install ok installed" ]
}
has_candidate() {
	local policy
	policy=$(apt-cache policy "$1" 2>/dev/null || true)
	grep -q 'Candidate: [^(]' <<<"$policy"
}
missing=()
for p in podman runc busybox-static; do
	installed "$p" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
	t=$(now)
	log "installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt_log=$(mktemp /tmp/oncely-apt.XXXXXX.log)
	for p in "${missing[@]}"; do
		if ! has_candidate "$p"; then
			log "apt-get update (no candidate for $p)"
			apt-get update -q >>"$apt_log" 2>&1
			break
		fi
	done
	if ! apt-get install -y -q "${missing[@]}" >>"$apt_log" 2>&1; then
		log "install failed; retrying after apt-get update"
		apt-get update -q >>"$apt_log" 2>&1
		if ! apt-get install -y -q "${missing[@]}" >>"$apt_log" 2>&1; then
			cat "$apt_log" >&2
			echo "test-containers: could not install ${missing[*]}" >&2
			exit 1
		fi
	fi
	log "installed ${missing[*]} in $(since "$t") (log: $apt_log)"
fi

if [ ! -e /etc/containers/containers.conf ]; then
	log "writing /etc/containers/containers.conf (runc, no default ulimits)"
	mkdir -p /etc/containers
	cat >/etc/containers/containers.conf <<'CONF'
[containers]
default_ulimits = []
pids_limit = 0
[engine]
runtime = "runc"
CONF
fi

# --- podman API service ---------------------------------------------------------
ping() { curl -fsS --max-time 2 --unix-socket "$socket" http://d/_ping >/dev/null 2>&1; }
podman_pid=
podman_log=$(mktemp /tmp/oncely-podman-service.XXXXXX.log)
run_id="run-$$-$(date +%s)"
cleanup() {
	# Tests terminate their containers; a test binary that was killed or timed
	# out could not, and without Ryuk nothing else does. Remove what this run left.
	local left
	left=$(podman ps -aq --filter "label=oncely.test-run=$run_id" 2>/dev/null || true)
	if [ -n "$left" ]; then
		log "removing containers this run left behind: $(echo $left)"
		podman rm -f $left >/dev/null 2>&1 || true
	fi
	if [ -n "$podman_pid" ]; then
		kill "$podman_pid" 2>/dev/null || true
		wait "$podman_pid" 2>/dev/null || true
		rm -f "$socket"
		log "stopped podman service (pid $podman_pid)"
	fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

t=$(now)
mkdir -p "$(dirname "$socket")"
podman system service --time=0 "unix://$socket" >"$podman_log" 2>&1 &
podman_pid=$!
for _ in $(seq 1 150); do
	ping && break
	if ! kill -0 "$podman_pid" 2>/dev/null; then
		echo "test-containers: podman system service exited; its log:" >&2
		cat "$podman_log" >&2
		exit 1
	fi
	sleep 0.2
done
if ! ping; then
	echo "test-containers: podman service (pid $podman_pid) did not answer on $socket within 30s; its log:" >&2
	cat "$podman_log" >&2
	exit 1
fi
log "podman service pid $podman_pid answering on $socket after $(since "$t") (log: $podman_log)"

# --- image ----------------------------------------------------------------------
t=$(now)
old_id=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
build_log=$(mktemp /tmp/oncely-image-build.XXXXXX.log)
if ! "$build_script" "$image" >"$build_log" 2>&1; then
	cat "$build_log" >&2
	echo "test-containers: building $image with $build_script failed" >&2
	exit 1
fi
new_id=$(podman image inspect --format '{{.Id}}' "$image")
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
	podman rmi "$old_id" >/dev/null 2>&1 || true # the untagged previous build, unless a container uses it
fi
t_image=$(since "$t")
log "built $image (${new_id:0:12}) in $t_image"

# --- tests ----------------------------------------------------------------------
export DOCKER_HOST="unix://$socket"
export TESTCONTAINERS_RYUK_DISABLED=true      # the Ryuk image cannot be pulled; tests clean up themselves
export TESTCONTAINERS_HOST_OVERRIDE=localhost # the VM looks like a container to testcontainers
export ONCELY_TEST_POSTGRES_IMAGE="$image"
unset DATABASE_URL                            # every Postgres comes from testcontainers
export ONCELY_TEST_RUN_ID="$run_id"           # testenv labels its containers with it

# -v so that the testenv lines (container ids) reach the log of passing
# packages; the summary keeps those, test results and package lines. The full
# output is printed when the run fails.
test_log=$(mktemp /tmp/oncely-test-containers.XXXXXX.log)
t=$(now)
log "go test ${test_args[*]} (DATABASE_URL unset, DOCKER_HOST=$DOCKER_HOST)"
set +e
go test -v "${test_args[@]}" >"$test_log" 2>&1
rc=$?
set -e
t_test=$(since "$t")
grep -E '^(testenv: |--- (PASS|FAIL|SKIP)|ok |FAIL|panic:)|^    --- (FAIL|SKIP)' "$test_log" || true
if [ "$rc" -ne 0 ]; then
	echo "test-containers: go test failed (exit $rc); full output:"
	cat "$test_log"
fi
containers=$(grep -c '^testenv: postgres container ' "$test_log" || true)
log "go test took $t_test; $containers Postgres container(s) started by testcontainers (full log: $test_log)"
log "timings: image build $t_image, go test $t_test, total $(since "$t_start")"
exit "$rc"
