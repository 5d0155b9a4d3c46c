#!/usr/bin/env bash
# Installs what the WAN emulator needs, and returns at once when it is all there already:
# Debian iptables, iproute2 and procps (namespaces, veths, tbf, the NFQUEUE rule, per-namespace
# sysctls), libnetfilter-queue and a C toolchain (to build NetfilterQueue), and PyPI
# NetfilterQueue (the `wan` extra in pyproject.toml) into the project's venv.
# Usage: benchmarks/wan/setup.sh [PYTHON]   (PYTHON defaults to .venv/bin/python at the repo root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"

have_debian() {
    command -v iptables >/dev/null && command -v ip >/dev/null && command -v tc >/dev/null \
        && command -v sysctl >/dev/null \
        && [ -e /usr/include/libnetfilter_queue/libnetfilter_queue.h ] \
        && command -v gcc >/dev/null && command -v pkg-config >/dev/null
}

if ! have_debian; then
    if [ "$(id -u)" != 0 ]; then
        echo "wan setup: need root to apt-get install the emulator's packages" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    # Another apt run on the same machine holds the lock for a while; wait for it instead of failing.
    APT=(apt-get -q -y -o DPkg::Lock::Timeout=300)
    "${APT[@]}" update >/dev/null
    "${APT[@]}" install --no-install-recommends \
        iptables iproute2 procps libnetfilter-queue-dev libnfnetlink-dev gcc libc6-dev pkg-config >/dev/null
fi

if ! "$PY" -c "import netfilterqueue" 2>/dev/null; then
    "$PY" -m pip install -q "NetfilterQueue>=1.1,<2"
fi

# The NFQUEUE target and the tbf qdisc come from kernel modules; load them when the kernel has
# them as modules (built-in or already loaded is fine, so a failure here is not an error).
if command -v modprobe >/dev/null; then
    modprobe -q nfnetlink_queue 2>/dev/null || true
    modprobe -q sch_tbf 2>/dev/null || true
fi
