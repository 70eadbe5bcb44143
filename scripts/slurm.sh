#!/usr/bin/env bash
# Debian's SLURM (slurmctld, slurmd, slurmdbd) and munge for the suite's real test cluster
# (tests/support/slurm_cluster.py starts and stops its own daemons), and MariaDB up for its accounting.
set -euo pipefail
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v munged >/dev/null; then
  echo "installing Debian's slurm-wlm, slurmdbd and munge for the SLURM tests"
  $SUDO apt-get update -q >/dev/null || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q slurm-wlm slurmdbd munge >/dev/null
fi
if ! mysqladmin -h 127.0.0.1 -u root status >/dev/null 2>&1; then
  echo "starting MariaDB (SLURM's accounting database)"
  command -v mysqld_safe >/dev/null || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q mariadb-server >/dev/null
  ($SUDO service mariadb start || $SUDO mysqld_safe --bind-address=127.0.0.1 >/dev/null 2>&1 &) >/dev/null 2>&1
  for _ in $(seq 30); do mysqladmin -h 127.0.0.1 -u root status >/dev/null 2>&1 && break; sleep 1; done
fi
slurmctld -V
