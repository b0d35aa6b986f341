#!/bin/sh
# Install the system binaries the tests need when they are missing: PgBouncer (Debian).
set -e
missing=""
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing="$missing pgbouncer"
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: missing:$missing (install with your package manager; tests needing it skip, or fail under CI=true)" >&2
    exit 0
fi
echo "system-deps: installing$missing with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
# shellcheck disable=SC2086
apt-get install -y -q --no-install-recommends $missing >/dev/null
