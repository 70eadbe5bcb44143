#!/usr/bin/env bash
# One command on a fresh machine: install, migrate, seed the demo, and run the web server and a worker
# on the embedded default (SQLite, filesystem broker, SQLite channel layer). Open http://127.0.0.1:8000/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${FORGEBOARD_VENV:-.venv}"
# This checkout's code, whatever checkout the venv was first installed from.
export PYTHONPATH="$PWD/platform:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m forgeboard.cli serve --demo --port "${FORGEBOARD_PORT:-8000}"
