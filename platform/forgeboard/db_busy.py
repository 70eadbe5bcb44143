"""A database busy for a moment is a 503 with Retry-After, not a 500.

A lock held past its timeout (SQLite's "database is locked", Postgres's lock or statement timeout), a deadlock or
serialization failure, or a connection lost or refused mid-request: the request's transaction is rolled back, so
nothing it did is kept, and the same request can simply be sent again (the CI client does, with the same
Idempotency-Key). Any other database error is a bug and stays a 500.
"""

from __future__ import annotations

import sqlite3

from django.db import InterfaceError, OperationalError
from django.http import HttpResponse

from forgeboard.errors import ServiceError

RETRY_AFTER_S = 2
# Postgres SQLSTATEs: serialization failure, deadlock, lock timeout, statement timeout, shutting down, too many
# connections; and any connection exception (class 08).
_PG_TRANSIENT = {"40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03", "53300"}
_SQLITE_TRANSIENT = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}


class DatabaseBusy(ServiceError):
    status = 503
    code = "database_busy"


def is_database_busy(exc: BaseException) -> bool:
    if not isinstance(exc, OperationalError | InterfaceError):
        return False
    cause = exc.__cause__
    if isinstance(cause, sqlite3.Error):
        return cause.sqlite_errorcode & 0xFF in _SQLITE_TRANSIENT  # an extended code keeps its primary in the low byte
    sqlstate = getattr(cause, "sqlstate", None)
    if sqlstate is not None:
        return sqlstate in _PG_TRANSIENT or sqlstate.startswith("08")
    text = str(exc)  # psycopg gives a connection that failed or closed no SQLSTATE
    return "connection" in text and ("closed" in text or "refused" in text)


def busy_error() -> DatabaseBusy:
    return DatabaseBusy(f"the database is busy: nothing was changed; send the request again in {RETRY_AFTER_S} s")


def with_retry_after(response: HttpResponse) -> HttpResponse:
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response

