#!/usr/bin/env bash
# Installs what the WAN emulator needs, and returns at once when it is all there already:
# Debian iptables, iproute2 and procps (namespaces, veths, tbf, the NFQUEUE rule, per-namespace
# sysctls). The delayer speaks NFQUEUE's netlink protocol itself (nfqueue.py): no library to build.
# Usage: benchmarks/wan/setup.sh
set -euo pipefail

have_debian() {
    command -v iptables >/dev/null && command -v ip >/dev/null && command -v tc >/dev/null \
        && command -v sysctl >/dev/null
}

if ! have_debian; then
    bash "$(dirname "$0")/../apt_install.sh" wan iptables iproute2 procps
fi

# The NFQUEUE target and the tbf qdisc come from kernel modules; load them when the kernel has
# them as modules (built-in or already loaded is fine, so a failure here is not an error).
if command -v modprobe >/dev/null; then
    modprobe -q nfnetlink_queue 2>/dev/null || true
    modprobe -q sch_tbf 2>/dev/null || true
fi
