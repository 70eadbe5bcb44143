"""The flush between transactional tests survives losing a deadlock to another session (tests/support/flush.py)."""

from __future__ import annotations

import re
import threading
import time

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.color import no_style
from django.core.management.sql import sql_flush
from django.db import connection

from forgeboard.accounts.models import User

pytestmark = pytest.mark.django_db(transaction=True)


def _other_session() -> psycopg.Connection:
    params = connection.settings_dict
    return psycopg.connect(host=params["HOST"] or "127.0.0.1", port=params["PORT"] or 5432, dbname=params["NAME"],
                           user=params["USER"] or None, password=params["PASSWORD"] or None)


def _wait_until_a_session_waits_for_a_lock(session: psycopg.Connection, *, other_than: int) -> None:
    for _ in range(200):
        waiting = session.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> %s "
            "AND wait_event_type = 'Lock'", (other_than,)).fetchone()[0]
        if waiting:
            return
        time.sleep(0.05)
    raise AssertionError("the flush never waited for the other session's lock")


def test_a_flush_that_postgres_aborts_to_break_a_deadlock_runs_again_and_empties_the_tables(team):
    if connection.vendor != "postgresql":
        pytest.skip("SQLite locks the whole database: two sessions cannot deadlock on tables")
    tables = re.findall(r'"([^"]+)"', sql_flush(no_style(), connection)[0])
    first, last = tables[0], tables[-1]
    assert User.objects.count() == 5

    watcher = _other_session()
    watcher.autocommit = True
    blocker = _other_session()
    blocker.execute("SET deadlock_timeout = '20s'")  # the flush (1 s) finds the cycle first: it is the victim
    blocker.execute(f'LOCK TABLE "{last}" IN ACCESS SHARE MODE')
    outcome: dict[str, BaseException | None] = {}

    def flush_in_its_own_session():
        try:
            call_command("flush", verbosity=0, interactive=False, inhibit_post_migrate=True)
            outcome["error"] = None
        except BaseException as error:  # noqa: BLE001 - the test reads it
            outcome["error"] = error
        finally:
            connection.close()

    flusher = threading.Thread(target=flush_in_its_own_session)
    flusher.start()
    try:
        _wait_until_a_session_waits_for_a_lock(watcher, other_than=blocker.info.backend_pid)
        # The flush holds the first table and waits for the last; this session holds the last and now waits for the
        # first. Postgres aborts the flush; this lock is granted once it has.
        started = time.monotonic()
        blocker.execute(f'LOCK TABLE "{first}" IN ACCESS SHARE MODE')
        assert time.monotonic() - started < 15, "Postgres should have aborted the flush, not this session"
        assert flusher.is_alive(), "the flush ran again and waits for this session to end"
        blocker.commit()
        flusher.join(timeout=30)
    finally:
        blocker.close()
        watcher.close()
    assert not flusher.is_alive()
    assert outcome["error"] is None, outcome["error"]
    assert User.objects.count() == 0
