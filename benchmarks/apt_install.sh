#!/usr/bin/env bash
# apt-get installs the OS packages named, as root, waiting for another apt run's lock instead of
# failing: the setup scripts of the benchmarks and tests call it when something they need is missing.
# Usage: benchmarks/apt_install.sh WHO PACKAGE...   (WHO names the caller in the error message)
set -euo pipefail

who=$1
shift
if [ "$(id -u)" != 0 ]; then
    echo "$who setup: need root to apt-get install $*" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
APT=(apt-get -q -y -o DPkg::Lock::Timeout=300)
"${APT[@]}" update >/dev/null
"${APT[@]}" install --no-install-recommends "$@" >/dev/null
