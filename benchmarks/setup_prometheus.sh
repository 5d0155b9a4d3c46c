#!/usr/bin/env bash
# Installs Prometheus and promtool (the Debian package `prometheus`) for the test that runs
# deploy/prometheus against a mini-mesh (tests/gateway/test_prometheus_deploy.py), and returns at
# once when they are there already. The package's own service is never used by the tests.
# Usage: benchmarks/setup_prometheus.sh
set -euo pipefail

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    bash "$(dirname "$0")/apt_install.sh" prometheus prometheus
fi
