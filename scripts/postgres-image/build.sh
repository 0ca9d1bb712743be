#!/usr/bin/env bash
# Builds a Postgres container image (default tag localhost/oncely-postgres:15)
# out of this machine's own Debian PostgreSQL 15 install, for testcontainers-go
# on machines that reach no container registry. The image is a root file
# system assembled by hand and imported with `podman import`:
#
#   - busybox-static provides /bin/sh and the small tools the entrypoint and
#     testcontainers' readiness checks use;
#   - PostgreSQL's binaries, extensions and share files are copied from
#     /usr/lib/postgresql/15 and /usr/share/postgresql/15 (without the LLVM
#     JIT, which would add some 150 MB), with every shared library ldd lists;
#   - entrypoint.sh, beside this script, initialises a data directory the way
#     the official image does (POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB,
#     POSTGRES_HOST_AUTH_METHOD, /docker-entrypoint-initdb.d) and starts the
#     server.
#
# Usage: scripts/postgres-image/build.sh [TAG]   (as root; needs podman, busybox-static)
set -euo pipefail

tag="${1:-localhost/oncely-postgres:15}"
here="$(cd "$(dirname "$0")" && pwd)"
version=15
pglib=/usr/lib/postgresql/$version
pgshare=/usr/share/postgresql/$version
for need in "$pglib/bin/postgres" /bin/busybox; do
	if [ ! -e "$need" ]; then
		echo "postgres-image: $need is missing (packages postgresql-$version and busybox-static)" >&2
		exit 1
	fi
done

rootfs="$(mktemp -d /tmp/oncely-pgimage.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT

# A merged-/usr layout, as Debian has: /bin, /sbin, /lib and /lib64 point
# into /usr, so library paths that ldd prints resolve inside the image too.
mkdir -p "$rootfs"/usr/{bin,sbin,lib,lib64,local/bin,share} \
	"$rootfs"/{etc,root,tmp,run/postgresql,proc,sys,dev,docker-entrypoint-initdb.d} \
	"$rootfs"/var/lib/postgresql
for d in bin sbin lib lib64; do ln -s "usr/$d" "$rootfs/$d"; done
ln -s ../run "$rootfs/var/run"
chmod 1777 "$rootfs/tmp"

# The shell and its tools: one busybox binary, a link per applet.
install -m 0755 /bin/busybox "$rootfs/usr/bin/busybox"
for applet in $(/bin/busybox --list); do
	[ -e "$rootfs/usr/bin/$applet" ] || ln -s busybox "$rootfs/usr/bin/$applet"
done
# initdb asks `locale -a` for the collations to import; busybox has no such
# applet, and an empty answer is fine (the cluster uses the C locale).
printf '#!/bin/sh\nexit 0\n' >"$rootfs/usr/bin/locale"
chmod 0755 "$rootfs/usr/bin/locale"

# PostgreSQL itself.
mkdir -p "$rootfs/usr/lib/postgresql" "$rootfs/usr/share/postgresql"
cp -a "$pglib" "$rootfs/usr/lib/postgresql/"
rm -rf "$rootfs$pglib/lib/bitcode" "$rootfs$pglib"/lib/llvmjit*
cp -a "$pgshare" "$rootfs/usr/share/postgresql/"
rm -rf "$rootfs$pgshare/man"
cp -a /usr/share/zoneinfo "$rootfs/usr/share/"

# Every library the binaries and extensions load, copied through symlinks to
# the same path inside the image.
for bin in "$rootfs$pglib"/bin/* "$rootfs$pglib"/lib/*.so; do
	ldd "${bin#"$rootfs"}" 2>/dev/null || true
done | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\/lib64\// { print $1 }' | sort -u |
	while read -r lib; do
		mkdir -p "$rootfs$(dirname "$lib")"
		cp -L "$lib" "$rootfs$lib"
	done

# Accounts: postgres runs as uid 999, as in the official image.
printf '%s\n' 'root:x:0:0:root:/root:/bin/sh' \
	'postgres:x:999:999:PostgreSQL:/var/lib/postgresql:/bin/sh' \
	'nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin' >"$rootfs/etc/passwd"
printf '%s\n' 'root:x:0:' 'postgres:x:999:' 'nogroup:x:65534:' >"$rootfs/etc/group"
printf '%s\n' 'passwd: files' 'group: files' 'shadow: files' 'hosts: files dns' >"$rootfs/etc/nsswitch.conf"
printf '%s\n' '127.0.0.1 localhost' '::1 localhost' >"$rootfs/etc/hosts"
chown -R 999:999 "$rootfs/var/lib/postgresql" "$rootfs/run/postgresql"
chmod 3777 "$rootfs/run/postgresql"

install -m 0755 "$here/entrypoint.sh" "$rootfs/usr/local/bin/docker-entrypoint.sh"

tar --numeric-owner -C "$rootfs" -cf - . | podman import \
	--change 'ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]' \
	--change 'CMD ["postgres"]' \
	--change "ENV PATH=$pglib/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
	--change 'ENV PGDATA=/var/lib/postgresql/data' \
	--change 'USER postgres' \
	--change 'EXPOSE 5432' \
	--change 'STOPSIGNAL SIGINT' \
	--change 'WORKDIR /var/lib/postgresql' \
	- "$tag"
