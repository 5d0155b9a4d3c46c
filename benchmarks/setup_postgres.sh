#!/usr/bin/env bash
# Installs PostgreSQL's server binaries (initdb, pg_ctl) for the throwaway clusters of the tests and
# benchmarks (benchmarks/postgres_cluster.py), and returns at once when they are there already.
# The Debian package also creates the `postgres` OS user the server runs as when we are root.
# Usage: benchmarks/setup_postgres.sh
set -euo pipefail

have_postgres() {
    if command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
        return 0
    fi
    compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null
}

if ! have_postgres; then
    bash "$(dirname "$0")/apt_install.sh" postgres postgresql
    # The package starts a system-wide cluster; the tests never use it, so it need not run.
    if command -v pg_ctlcluster >/dev/null; then
        for conf in /etc/postgresql/*/main; do
            [ -d "$conf" ] && pg_ctlcluster "$(basename "$(dirname "$conf")")" main stop 2>/dev/null || true
        done
    fi
fi
