#!/usr/bin/env bash
# Installs bubblewrap (`bwrap`), which the sandbox for model-written code needs (mesh/sandbox/,
# docs/SANDBOX.md), and returns at once when it is there already.
# Usage: benchmarks/setup_sandbox.sh
set -euo pipefail

if ! command -v bwrap >/dev/null; then
    bash "$(dirname "$0")/apt_install.sh" sandbox bubblewrap
fi
