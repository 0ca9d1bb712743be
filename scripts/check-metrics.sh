#!/usr/bin/env bash
# Check the orderworker's GET /metrics with `promtool check metrics`: metric
# names with their unit and _total suffixes, help text, histogram buckets.
#
# It builds the orderworker, runs it briefly against DATABASE_URL (default
# the local server) with an in-process Kafka, in a schema of its own
# (dropped at the end), sends it orders through POST /orders (stored, then
# replayed) and POST /webhooks/orders (accepted, duplicate, refused), waits
# until the consumer has processed them, fetches /metrics and runs promtool
# on it. Any complaint fails the script.
#
# promtool comes from Debian's prometheus package: when it is not on PATH it
# is extracted (not installed: no service is started) from the package
# downloaded by `apt-get download`, into ${XDG_CACHE_HOME:-~/.cache}/oncely.
# CHECK_METRICS_OUT=FILE keeps the /metrics output that was checked.
set -euo pipefail

root="$(git rev-parse --show-toplevel)"
cd "$root"
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}"

log() { echo "check-metrics: $*"; }

find_promtool() {
	if command -v promtool >/dev/null 2>&1; then
		command -v promtool
		return
	fi
	local cache="${XDG_CACHE_HOME:-$HOME/.cache}/oncely/prometheus"
	if [ ! -x "$cache/usr/bin/promtool" ]; then
		local dl
		dl="$(mktemp -d)"
		if ! (cd "$dl" && apt-get download prometheus >/dev/null 2>&1); then
			log "apt-get download prometheus failed; updating the package lists and trying again" >&2
			apt-get update -qq >/dev/null
			(cd "$dl" && apt-get download prometheus >/dev/null)
		fi
		mkdir -p "$cache"
		dpkg-deb -x "$dl"/prometheus_*.deb "$cache"
		rm -rf "$dl"
	fi
	echo "$cache/usr/bin/promtool"
}

promtool="$(find_promtool)"
log "$("$promtool" --version 2>&1 | head -n1)"

work="$(mktemp -d)"
schema="check_metrics_$$"
pid=""
cleanup() {
	if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
		kill -TERM "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	fi
	psql -q "$DATABASE_URL" -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
	rm -rf "$work"
}
trap cleanup EXIT

go build -o "$work/orderworker" ./examples/orderworker

secret="whsec_$(openssl rand -base64 32)"
WEBHOOK_SECRET="$secret" KAFKA_BROKERS= "$work/orderworker" run --http-addr 127.0.0.1:0 --schema "$schema" \
	--group "$schema" >"$work/stdout" 2>"$work/worker.log" &
pid=$!

addr=""
for _ in $(seq 1 600); do
	addr="$(sed -n 's/.*msg="orderworker http listening" addr=\([^ ]*\).*/\1/p' "$work/worker.log" | head -n1)"
	[ -n "$addr" ] && break
	kill -0 "$pid" 2>/dev/null || { cat "$work/worker.log" >&2; log "the worker exited" >&2; exit 1; }
	sleep 0.1
done
[ -n "$addr" ] || { cat "$work/worker.log" >&2; log "the worker did not listen within 60s" >&2; exit 1; }
base="http://$addr"
for _ in $(seq 1 600); do
	[ "$(curl -s -o /dev/null -w '%{http_code}' "$base/healthz")" = 200 ] && break
	sleep 0.1
done

status() { curl -s -o /dev/null -w '%{http_code}' "$@"; }
expect() {
	local want="$1" what="$2"
	shift 2
	local got
	got="$(status "$@")"
	[ "$got" = "$want" ] || { cat "$work/worker.log" >&2; log "$what: answered $got, want $want" >&2; exit 1; }
}

# POST /orders: stored, then replayed.
order='{"order_id":"ord-metrics-1","customer_id":"cust-1","amount_cents":990}'
for _ in 1 2; do
	expect 202 "POST /orders" "$base/orders" -H 'Idempotency-Key: metrics-1' -H 'content-type: application/json' --data-binary "$order"
done
# POST /webhooks/orders: accepted, duplicate, and refused unsigned.
id="msg_metrics_$$" ts="$(date +%s)"
body='{"order_id":"ord-metrics-2","customer_id":"cust-2","amount_cents":1250}'
key_hex="$(printf %s "${secret#whsec_}" | base64 -d | od -An -vtx1 | tr -d ' \n')"
sign() { printf '%s.%s.%s' "$1" "$2" "$3" | openssl dgst -sha256 -mac HMAC -macopt "hexkey:$key_hex" -binary | base64; }
for _ in 1 2; do
	expect 202 "POST /webhooks/orders" "$base/webhooks/orders" -H "webhook-id: $id" -H "webhook-timestamp: $ts" \
		-H "webhook-signature: v1,$(sign "$id" "$ts" "$body")" -H 'content-type: application/json' --data-binary "$body"
done
expect 401 "unsigned POST /webhooks/orders" "$base/webhooks/orders" -H 'content-type: application/json' --data-binary "$body"
# A signed delivery that is not an order: the consumer dead-letters it.
poison='{"not":"an order"}'
expect 202 "POST /webhooks/orders (not an order)" "$base/webhooks/orders" -H "webhook-id: ${id}_poison" -H "webhook-timestamp: $ts" \
	-H "webhook-signature: v1,$(sign "${id}_poison" "$ts" "$poison")" -H 'content-type: application/json' --data-binary "$poison"

# Both orders and the poison through the outbox, the relay, Kafka and the
# consumer.
sum() { awk -v m="$1" '$1 ~ "^"m"({|$)" { s += $2 } END { print s + 0 }' "$work/metrics"; }
for _ in $(seq 1 600); do
	curl -s "$base/metrics" >"$work/metrics"
	[ "$(sum messaging_client_consumed_messages_total)" -ge 3 ] && [ "$(sum oncely_consumer_dead_lettered_total)" -ge 1 ] && break
	sleep 0.1
done
[ "$(sum oncely_consumer_dead_lettered_total)" -ge 1 ] ||
	{ cat "$work/worker.log" >&2; log "the consumer did not take the 3 records (one dead-lettered) within 60s" >&2; exit 1; }

log "$(grep -c '^# TYPE' "$work/metrics") metric families from $base/metrics"
[ -z "${CHECK_METRICS_OUT:-}" ] || cp "$work/metrics" "$CHECK_METRICS_OUT"
if ! "$promtool" check metrics <"$work/metrics"; then
	log "promtool check metrics failed on the output above" >&2
	exit 1
fi
log "ok"
