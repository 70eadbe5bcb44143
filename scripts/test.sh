#!/usr/bin/env bash
# The whole test suite: installs what is missing, starts Postgres and Redis if they are down, then runs
# the suite on Postgres + Redis, and the control-plane tests again on the embedded default (SQLite).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
bash scripts/slurm.sh
VENV="${FORGEBOARD_VENV:-.venv}"
PY="$(cd "$VENV" && pwd)/bin/python"
export FORGEBOARD_ENV=test FORGEBOARD_TEST_VENV="$(cd "$VENV" && pwd)"
export FORGEBOARD_DATA_DIR="${FORGEBOARD_DATA_DIR:-$PWD/var/test}"

echo "== suite on PostgreSQL and Redis"
DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/forgeboard}" \
REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379/15}" \
  "$PY" -m pytest tests "$@"

echo "== browser tests in Chromium (their own pytest process: Playwright's loop upsets pytest-asyncio)"
bash scripts/browser.sh
DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/forgeboard}" \
REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379/15}" DJANGO_ALLOW_ASYNC_UNSAFE=true \
  "$PY" -m pytest tests/e2e "$@"

echo "== control plane on the embedded default (SQLite, filesystem broker, SQLite channel layer)"
env -u DATABASE_URL -u REDIS_URL FORGEBOARD_DATA_DIR="$FORGEBOARD_DATA_DIR/embedded" \
  "$PY" -m pytest tests/platform "$@"
