"""Migrations apply from scratch to an empty database, and the models have no unmigrated changes."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from tests.support.processes import REPO_DIR, platform_env


def _manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_DIR / "manage.py"), *args], env=platform_env(**env),
                          capture_output=True, text=True, timeout=300)


def _migrate_without_redis(*, url: str, data_dir: Path) -> subprocess.CompletedProcess:
    """A plain `manage.py migrate`, where the cache and the channel layer live in databases too (no REDIS_URL)."""
    env = platform_env(DATABASE_URL=url, FORGEBOARD_DATA_DIR=str(data_dir))
    env.pop("REDIS_URL", None)
    return subprocess.run([sys.executable, str(REPO_DIR / "manage.py"), "migrate", "--noinput"], env=env,
                          capture_output=True, text=True, timeout=300)


def _assert_a_second_migrate_says_nothing_is_left(*, url: str, data_dir: Path) -> None:
    again = _migrate_without_redis(url=url, data_dir=data_dir)
    assert again.returncode == 0, again.stderr
    assert "No migrations to apply." in again.stdout and "already exists" not in again.stdout, again.stdout


def _sqlite_tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


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
            result = _migrate_without_redis(url=url, data_dir=tmp_path)
            assert result.returncode == 0, result.stderr
            _assert_a_second_migrate_says_nothing_is_left(url=url, data_dir=tmp_path)
            with psycopg.connect(**(admin | {"dbname": name})) as conn:
                tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname='public'")}
        finally:
            with psycopg.connect(**admin) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    else:
        url = f"sqlite://{tmp_path / 'scratch.sqlite3'}"
        result = _migrate_without_redis(url=url, data_dir=tmp_path)
        assert result.returncode == 0, result.stderr
        _assert_a_second_migrate_says_nothing_is_left(url=url, data_dir=tmp_path)
        tables = _sqlite_tables(tmp_path / "scratch.sqlite3")
    expected = {"accounts_project", "accounts_membership", "accounts_apitoken", "experiments_experiment",
                "experiments_configsnapshot", "runs_run", "runs_command", "telemetry_metricseries",
                "telemetry_metricpoint", "telemetry_runevent", "cluster_host", "cluster_device", "audit_auditevent"}
    assert expected <= tables, expected - tables
    assert "forgeboard_cache" in tables  # the database cache's table: not a migration's
    assert "channels_lite_event" in _sqlite_tables(tmp_path / "channels.sqlite3")  # the channel layer's own database


@pytest.mark.django_db(transaction=True)
def test_a_hosts_one_state_splits_into_intent_and_liveness_and_back():
    """cluster 0005: up, draining and cordoned are intents of a live host; down is liveness (its lost drain or cordon
    cannot be told), and going back joins them again."""
    from django.db.migrations.executor import MigrationExecutor

    before, after = [("cluster", "0004_host_agent_token")], [("cluster", "0005_host_intent_and_liveness")]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    try:
        executor.migrate(before)
        old = MigrationExecutor(connection).loader.project_state(before).apps.get_model("cluster", "Host")
        for state in ("up", "draining", "cordoned", "down"):
            old.objects.create(hostname=f"gpu-{state}", state=state)
        executor = MigrationExecutor(connection)
        executor.migrate(after)
        new = executor.loader.project_state(after).apps.get_model("cluster", "Host")
        assert dict(new.objects.values_list("hostname", "intent")) == {
            "gpu-up": "schedulable", "gpu-draining": "draining", "gpu-cordoned": "cordoned", "gpu-down": "schedulable"}
        assert dict(new.objects.values_list("hostname", "liveness")) == {
            "gpu-up": "up", "gpu-draining": "up", "gpu-cordoned": "up", "gpu-down": "down"}
        new.objects.filter(hostname="gpu-down").update(intent="cordoned")  # cordoned while down: down wins
        MigrationExecutor(connection).migrate(before)
        assert dict(old.objects.values_list("hostname", "state")) == {
            "gpu-up": "up", "gpu-draining": "draining", "gpu-cordoned": "cordoned", "gpu-down": "down"}
    finally:
        MigrationExecutor(connection).migrate(latest)


@pytest.mark.django_db(transaction=True)
def test_the_exports_runs_wait_for_are_recorded_as_queued_before_the_upgrade(team, grpo_yaml):
    """runs 0007: an export's state moves from its status file to a CheckpointExport row. The exports that runs were
    waiting for then are recorded as queued, attempt 0 (which the task messages queued then take), since the first
    run asked for, so the reconciler queues one again if its message was lost."""
    from django.db.migrations.executor import MigrationExecutor

    from forgeboard.accounts.services import api_token_create
    from forgeboard.runs.models import PendingChildRun
    from forgeboard.runs.services import run_launch

    before, after = [("runs", "0006_pending_child_run")], [("runs", "0007_checkpoint_export")]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    parent = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    token, _ = api_token_create(actor=team.member, project=team.project, name="ci", scope="write")
    try:
        executor.migrate(before)
        for step, kind, actor_id in ((2, "token", token.pk), (2, "user", team.member.pk), (4, "user", 999_999)):
            PendingChildRun.objects.create(parent=parent, step=step, actor_kind=kind, actor_id=actor_id)
        first = PendingChildRun.objects.filter(step=2).order_by("id").first()
        executor = MigrationExecutor(connection)
        executor.migrate(after)
        exports = executor.loader.project_state(after).apps.get_model("runs", "CheckpointExport")
        recorded = list(exports.objects.order_by("step").values_list("step", "state", "attempt", "requested_by"))
        assert recorded == [(2, "queued", 0, f"token:{token.prefix}"), (4, "queued", 0, "user 999999 (deleted)")]
        assert exports.objects.get(step=2).updated_at == first.created_at
    finally:
        MigrationExecutor(connection).migrate(latest)
