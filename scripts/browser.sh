#!/usr/bin/env bash
# Debian's Chromium for the browser tests (Playwright drives it; `playwright install` cannot download here).
set -euo pipefail
if [ ! -x /usr/bin/chromium ]; then
  echo "installing Debian's chromium for the browser tests"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q >/dev/null || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >/dev/null
fi
/usr/bin/chromium --version
