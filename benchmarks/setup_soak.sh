#!/usr/bin/env bash
# Installs what the chaos soak (benchmarks/soak.py) needs beyond the WAN emulator and PostgreSQL, and
# returns at once when it is there already: libfaketime (Debian `faketime`), which shifts the wall clock
# one process sees, so that clock jumps hit one service without touching the machine's clock.
# Usage: benchmarks/setup_soak.sh
set -euo pipefail

if ! compgen -G "/usr/lib/*/faketime/libfaketime.so.1" >/dev/null; then
    bash "$(dirname "$0")/apt_install.sh" soak faketime
fi
