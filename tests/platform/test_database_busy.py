"""A database locked past its timeout answers 503 with Retry-After (not a 500), keeps nothing, and the same
request succeeds once the lock is gone (forgeboard/db_busy.py)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator

import psycopg
import pytest
from django.db import OperationalError, connection

from forgeboard.db_busy import is_database_busy
from forgeboard.idempotency.models import IdempotentRequest
from forgeboard.runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


@contextlib.contextmanager
def runs_locked_by_another_session() -> Iterator[None]:
    """Another session holds a write lock on the runs (SQLite: the whole database) while this one waits 0.2 s."""
    params = connection.settings_dict
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            other = psycopg.connect(host=params["HOST"] or "127.0.0.1", port=params["PORT"] or 5432,
                                    dbname=params["NAME"], user=params["USER"] or None)
            other.execute(f'LOCK TABLE "{Run._meta.db_table}" IN EXCLUSIVE MODE')
            cursor.execute("SET lock_timeout = '200ms'")
            restore = "SET lock_timeout = DEFAULT"
        else:
            other = sqlite3.connect(params["NAME"], isolation_level=None)
            other.execute("BEGIN IMMEDIATE")
            cursor.execute("PRAGMA busy_timeout = 200")
            restore = "PRAGMA busy_timeout = 10000"
        try:
            yield
        finally:
            other.rollback()
            other.close()
            cursor.execute(restore)


def test_a_launch_while_the_database_is_locked_is_a_503_that_keeps_nothing_and_can_be_sent_again(
        client, team, grpo_yaml):
    client.force_login(team.member)
    path, body, key = f"/api/v1/experiments/{team.experiment.pk}/runs", json.dumps({"config_yaml": grpo_yaml}), "k-1"
    form = {"experiment": str(team.experiment.pk), "config_yaml": grpo_yaml, "overrides": "", "priority": "0"}
    with runs_locked_by_another_session():
        busy = client.post(path, data=body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key)
        page = client.post("/p/alpha/launch/", form)
    assert busy.status_code == 503 and busy["Retry-After"] == "2", busy.content
    assert busy.json() == {"code": "database_busy", "errors": [],
                           "message": "the database is busy: nothing was changed; send the request again in 2 s"}
    assert page.status_code == 503 and page["Retry-After"] == "2"
    assert "the database is busy: nothing was changed" in page.content.decode()
    assert not Run.objects.exists() and not IdempotentRequest.objects.exists()

    again = client.post(path, data=body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key)
    assert again.status_code == 201 and "Idempotent-Replayed" not in again, again.content
    assert client.post("/p/alpha/launch/", form).status_code == 302 and Run.objects.count() == 2


def _django_error_from_sqlite(statement: str, tmp_path) -> OperationalError:
    """Django's OperationalError raised from what SQLite itself answers, while another connection holds the write
    lock (the same way Django wraps a driver's error: the driver's is its cause)."""
    path = str(tmp_path / "busy.sqlite3")
    holder, waiter = sqlite3.connect(path, isolation_level=None), sqlite3.connect(path, timeout=0, isolation_level=None)
    holder.execute("CREATE TABLE IF NOT EXISTS t (x)")
    holder.execute("BEGIN IMMEDIATE")
    try:
        waiter.execute(statement)
    except sqlite3.Error as driver_error:
        error = OperationalError(str(driver_error))
        error.__cause__ = driver_error
        return error
    finally:
        holder.rollback()
        holder.close()
        waiter.close()
    raise AssertionError(f"{statement} did not fail")


def test_only_a_passing_database_condition_counts_as_busy(tmp_path):
    locked = _django_error_from_sqlite("INSERT INTO t VALUES (1)", tmp_path)
    assert str(locked) == "database is locked" and is_database_busy(locked)
    assert not is_database_busy(_django_error_from_sqlite("SELECT nope FROM t", tmp_path))  # no such column
    assert not is_database_busy(OperationalError("database is locked")), "a message alone is not SQLite's answer"
    assert not is_database_busy(ValueError("database is locked"))
