"""Migrations apply from scratch to an empty database, and the models have no unmigrated changes."""

from __future__ import annotations

import subprocess
import sys
import uuid

import psycopg
import pytest
from django.db import connection

from tests.support.processes import REPO_DIR, platform_env


def _manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_DIR / "manage.py"), *args], env=platform_env(**env),
                          capture_output=True, text=True, timeout=300)


def test_no_missing_migrations(db):
    result = _manage("makemigrations", "--check", "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.django_db
def test_migrations_apply_to_an_empty_database(tmp_path):
    if connection.vendor == "postgresql":
        params = connection.settings_dict
        name = f"forgeboard_scratch_{uuid.uuid4().hex[:8]}"
        admin = dict(host=params["HOST"] or "127.0.0.1", port=params["PORT"] or 5432, user=params["USER"],
                     password=params["PASSWORD"] or None, dbname="postgres", autocommit=True)
        with psycopg.connect(**admin) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        try:
            url = f"postgres://{params['USER']}@{admin['host']}:{admin['port']}/{name}"
            result = _manage("migrate", "--noinput", DATABASE_URL=url)
            assert result.returncode == 0, result.stderr
            with psycopg.connect(**(admin | {"dbname": name})) as conn:
                tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname='public'")}
        finally:
            with psycopg.connect(**admin) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    else:
        url = f"sqlite://{tmp_path / 'scratch.sqlite3'}"
        result = _manage("migrate", "--noinput", DATABASE_URL=url, FORGEBOARD_DATA_DIR=str(tmp_path))
        assert result.returncode == 0, result.stderr
        import sqlite3

        with sqlite3.connect(tmp_path / "scratch.sqlite3") as conn:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    expected = {"accounts_project", "accounts_membership", "accounts_apitoken", "experiments_experiment",
                "experiments_configsnapshot", "runs_run", "runs_command", "telemetry_metricseries",
                "telemetry_metricpoint", "telemetry_runevent", "cluster_host", "cluster_device", "audit_auditevent"}
    assert expected <= tables, expected - tables
