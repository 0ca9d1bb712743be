#!/bin/sh
# Entrypoint of the image scripts/postgres-image/build.sh makes (busybox sh).
# On a first start it creates the cluster the way the official postgres image
# does: POSTGRES_USER (default postgres) with POSTGRES_PASSWORD, or no
# password with POSTGRES_HOST_AUTH_METHOD=trust; the database POSTGRES_DB
# (default: the user's name); then the *.sql, *.sql.gz and *.sh files of
# /docker-entrypoint-initdb.d, run against a server that listens on its unix
# socket only. Then it runs the server in the foreground. (Like the official
# image, it logs "ready to accept connections" twice on a first start, which
# is what testcontainers-go's Postgres module waits for.)
set -eu
export PATH="/usr/lib/postgresql/15/bin:$PATH"
export PGDATA="${PGDATA:-/var/lib/postgresql/data}"
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
auth="${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}"

# No arguments, or only server options: the server.
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
	set -- postgres "$@"
fi
if [ "$1" != postgres ]; then
	exec "$@"
fi
shift

if [ ! -s "$PGDATA/PG_VERSION" ]; then
	if [ "$auth" != trust ] && [ -z "${POSTGRES_PASSWORD:-}" ]; then
		echo "entrypoint: POSTGRES_PASSWORD is empty: set it, or POSTGRES_HOST_AUTH_METHOD=trust" >&2
		exit 1
	fi
	mkdir -p "$PGDATA"
	chmod 0700 "$PGDATA"
	pwfile="$(mktemp)"
	printf '%s\n' "${POSTGRES_PASSWORD:-}" >"$pwfile"
	initdb --username="$user" --pwfile="$pwfile" --encoding=UTF8 --locale=C \
		--auth-local=trust --auth-host="$auth"
	rm -f "$pwfile"
	echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
	echo "host all all all $auth" >>"$PGDATA/pg_hba.conf"

	# A server for the initialisation only: on the unix socket, no TCP.
	pg_ctl -w -o "-c listen_addresses='' -p 5432" start
	export PGHOST=/var/run/postgresql PGPORT=5432 PGUSER="$user"
	if [ "$db" != postgres ]; then
		psql -v ON_ERROR_STOP=1 -q -d postgres -c "CREATE DATABASE \"$db\""
	fi
	for f in /docker-entrypoint-initdb.d/*; do
		case "$f" in
		*.sh) echo "entrypoint: running $f"; . "$f" ;;
		*.sql) echo "entrypoint: running $f"; psql -v ON_ERROR_STOP=1 -d "$db" -f "$f" ;;
		*.sql.gz) echo "entrypoint: running $f"; gunzip -c "$f" | psql -v ON_ERROR_STOP=1 -d "$db" ;;
		*/\*) ;; # the directory is empty
		*) echo "entrypoint: ignoring $f" ;;
		esac
	done
	pg_ctl -w -m fast stop
	unset PGHOST PGPORT PGUSER
	echo "entrypoint: initialisation done; starting the server"
fi
exec postgres "$@"
