#!/usr/bin/env bash
# Starts the local Postgres and Redis that the test suite uses, when they are not already up.
set -euo pipefail
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  echo "starting PostgreSQL"
  if command -v pg_ctlcluster >/dev/null; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n1)" main start
  else
    service postgresql start
  fi
  for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/forgeboard.log
  for _ in $(seq 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 1; done
fi
pg_isready -h 127.0.0.1 -p 5432
redis-cli -h 127.0.0.1 -p 6379 ping
