#!/usr/bin/env bash
# inbox-cost.sh: what an inbox row costs Postgres, without Kafka or Go.
#
# pgbench runs the same per-record transaction in variants, four clients,
# prepared statements, and the script reports the CPU time of the whole
# machine (every process: Postgres, its WAL writer, pgbench itself) per
# transaction, from /proc/stat, so that the figure depends little on how
# busy the machine was. Each variant runs ROUNDS times, in turn; the median
# is printed with every round's figure.
#
#   effect       BEGIN; the effect row (no index); COMMIT          (the naive consumer)
#   inbox        BEGIN; inbox claim; effect; COMMIT                 (naive + inbox)
#   pipelined    BEGIN and the claim in one round trip; effect; COMMIT  (oncely)
#   minimal      pipelined, into an inbox of (group, id) with only its primary key
#
# Usage: bench/pgbench/inbox-cost.sh   (DATABASE_URL, ROUNDS=5, TX=20000 per round)
set -euo pipefail
cd "$(dirname "$0")"
url=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}
rounds=${ROUNDS:-5}
tx=${TX:-20000}
clients=4
schema=oncely_inbox_cost_$$

psql -q "$url" -v ON_ERROR_STOP=1 <<SQL
CREATE SCHEMA $schema;
SET search_path = $schema;
CREATE TABLE effects (seq bigint GENERATED ALWAYS AS IDENTITY, message_id text NOT NULL,
  key text NOT NULL, part int NOT NULL, off bigint NOT NULL, amount bigint NOT NULL);
-- The inbox as migrations/sql/0001_inbox.up.sql creates it.
CREATE TABLE inbox (consumer_group text NOT NULL, message_id text NOT NULL,
  topic text NOT NULL DEFAULT '', partition integer NOT NULL DEFAULT -1, "offset" bigint NOT NULL DEFAULT -1,
  outcome text NOT NULL DEFAULT 'processed' CHECK (outcome IN ('processed', 'dead_lettered')),
  processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (consumer_group, message_id));
CREATE INDEX ON inbox (processed_at);
CREATE TABLE inbox_minimal (consumer_group text NOT NULL, message_id text NOT NULL,
  PRIMARY KEY (consumer_group, message_id));
SQL
work=$(mktemp -d)
trap 'rm -rf "$work"; psql -q "$url" -c "SET client_min_messages = warning; DROP SCHEMA $schema CASCADE"' EXIT
id="md5(:client_id || '-' || :a)"
effect="INSERT INTO $schema.effects (message_id, key, part, off, amount) VALUES ($id, 'k', 1, 2, 3);"
claim="INSERT INTO $schema.inbox (consumer_group, message_id, topic, partition, \"offset\", outcome) VALUES ('g', $id, 't', 1, 2, 'processed') ON CONFLICT (consumer_group, message_id) DO NOTHING;"
minimal="INSERT INTO $schema.inbox_minimal (consumer_group, message_id) VALUES ('g', $id) ON CONFLICT (consumer_group, message_id) DO NOTHING;"
rand='\set a random(1, 2000000000)'
printf '%s\nBEGIN;\n%s\nCOMMIT;\n' "$rand" "$effect" >"$work/effect.sql"
printf '%s\nBEGIN;\n%s\n%s\nCOMMIT;\n' "$rand" "$claim" "$effect" >"$work/inbox.sql"
printf '%s\n\\startpipeline\nBEGIN;\n%s\n\\endpipeline\n%s\nCOMMIT;\n' "$rand" "$claim" "$effect" >"$work/pipelined.sql"
printf '%s\n\\startpipeline\nBEGIN;\n%s\n\\endpipeline\n%s\nCOMMIT;\n' "$rand" "$minimal" "$effect" >"$work/minimal.sql"

busy() { awk '/^cpu / {print $2+$3+$4+$7+$8}' /proc/stat; }
hz=$(getconf CLK_TCK)
variants=(effect inbox pipelined minimal)
declare -A res
for ((r = 1; r <= rounds; r++)); do
	for v in "${variants[@]}"; do
		b0=$(busy)
		pgbench -n -M prepared -c $clients -j 2 -t $((tx / clients)) -f "$work/$v.sql" "$url" >/dev/null 2>"$work/err" || { cat "$work/err"; exit 1; }
		b1=$(busy)
		res[$v]+=" $(echo "($b1 - $b0) * 1000000 / $hz / $tx" | bc)"
	done
done
median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
base=$(echo "${res[effect]}" | median)
printf '%-10s %12s %9s   %s\n' variant "us CPU/tx" "/ effect" "rounds"
for v in "${variants[@]}"; do
	m=$(echo "${res[$v]}" | median)
	printf '%-10s %12s %9s  %s\n' "$v" "$m" "$(echo "scale=2; $m / $base" | bc)" "${res[$v]}"
done
