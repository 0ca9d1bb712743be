#!/usr/bin/env bash
# Installs Debian's chromium for the operator console's browser test
# (integration_test/console_browser_test.go), if it is missing. Needs root
# (apt-get). Takes about 40 s on this project's machines.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
	echo "chromium: $(chromium --version 2>/dev/null || echo present)"
	exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium >/dev/null
echo "chromium: $(chromium --version)"
