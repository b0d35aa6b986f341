#!/bin/sh
# Install the system binaries the tests need when they are missing (Debian):
# PgBouncer, a system PostgreSQL and Redis beside the embedded ones, openssl, and chromium
# with its WebDriver for the status page's browser test.
set -e
missing=""
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing="$missing pgbouncer"
# A system PostgreSQL beside the embedded one, so two server versions are tested.
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing="$missing postgresql"
# Debian's Redis 7 beside the embedded 6.2 and Valkey 8.
[ -x /usr/bin/redis-server ] || missing="$missing redis-server"
# The TLS tests make their certificates with the openssl command.
command -v openssl >/dev/null 2>&1 || missing="$missing openssl"
# tests/test_page.py drives Debian's chromium headless through chromium-driver.
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v chromedriver >/dev/null 2>&1 || missing="$missing chromium-driver"
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
