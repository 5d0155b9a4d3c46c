#!/usr/bin/env bash
# Installs a headless browser for the console's browser test (tests/console/test_browser.py) and the
# console benchmark's page timing: Debian's `chromium` and `chromium-driver` (chromedriver, which
# selenium drives), and returns at once when they are there already. Selenium itself comes with the
# `dev` extra (pyproject.toml).
# Usage: benchmarks/setup_browser.sh
set -euo pipefail

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    bash "$(dirname "$0")/apt_install.sh" browser chromium chromium-driver
fi
