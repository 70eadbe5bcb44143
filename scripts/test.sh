#!/usr/bin/env bash
# The whole test suite: installs what is missing, starts Postgres and Redis if they are down, then runs, side by side,
# the tests that start real processes (marked slow: Monarch, SLURM, servers, workers) on Postgres + Redis, and the
# rest on Postgres + Redis followed by the control-plane tests again on the embedded default (SQLite); then the
# browser tests. The live tests spend much of their time waiting on processes and SLURM, which the others fill.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
bash scripts/slurm.sh
VENV="${FORGEBOARD_VENV:-.venv}"
PY="$(cd "$VENV" && pwd)/bin/python"
export FORGEBOARD_ENV=test FORGEBOARD_TEST_VENV="$(cd "$VENV" && pwd)"
export FORGEBOARD_DATA_DIR="${FORGEBOARD_DATA_DIR:-$PWD/var/test}"
DATABASE="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/forgeboard}"
REDIS="${TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
# The second lane: a database, a Redis database and a data folder of its own.
LANE_DATABASE="${TEST_LANE_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/forgeboard_lane}"
LANE_REDIS="${TEST_LANE_REDIS_URL:-redis://127.0.0.1:6379/14}"
mkdir -p "$FORGEBOARD_DATA_DIR"
lane_log="$FORGEBOARD_DATA_DIR/lane.log"

lane() {
  echo "== the other tests on PostgreSQL and Redis"
  DATABASE_URL="$LANE_DATABASE" REDIS_URL="$LANE_REDIS" FORGEBOARD_DATA_DIR="$FORGEBOARD_DATA_DIR/lane" \
    "$PY" -m pytest tests -m "not slow" "$@" || status=$?
  echo "== control plane on the embedded default (SQLite, filesystem broker, SQLite channel layer)"
  env -u DATABASE_URL -u REDIS_URL FORGEBOARD_DATA_DIR="$FORGEBOARD_DATA_DIR/embedded" \
    "$PY" -m pytest tests/platform "$@" || status=$?
  return "${status:-0}"
}
lane "$@" > "$lane_log" 2>&1 &
lane_pid=$!

echo "== tests that start real processes, on PostgreSQL and Redis (the other tests run meanwhile: $lane_log)"
live_status=0
DATABASE_URL="$DATABASE" REDIS_URL="$REDIS" "$PY" -m pytest tests -m slow "$@" || live_status=$?
lane_status=0
wait "$lane_pid" || lane_status=$?
cat "$lane_log"

echo "== browser tests in Chromium (their own pytest process: Playwright's loop upsets pytest-asyncio)"
bash scripts/browser.sh
browser_status=0
DATABASE_URL="$DATABASE" REDIS_URL="$REDIS" DJANGO_ALLOW_ASYNC_UNSAFE=true \
  "$PY" -m pytest tests/e2e "$@" || browser_status=$?

echo "== exit: live tests $live_status, other tests $lane_status, browser tests $browser_status"
[ "$live_status" = 0 ] && [ "$lane_status" = 0 ] && [ "$browser_status" = 0 ]
