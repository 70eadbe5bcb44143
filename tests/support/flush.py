"""The test database's flush between transactional tests, run again when Postgres aborts it to break a deadlock.

Browser tests and the tests that start a web server or a Celery worker leave those processes their own database
sessions. A late write of theirs can lock two tables in the order opposite to the flush's one TRUNCATE, and Postgres
then aborts one of the two transactions. When that is the flush, it was rolled back whole, so it is safe to run again
once the other session has finished; without this the next test starts on the last test's rows.
"""

from __future__ import annotations

import time

from django.core.management.base import CommandError
from django.core.management.commands import flush

ATTEMPTS = 5
LOST_TO_ANOTHER_SESSION = {"40P01", "40001"}  # deadlock_detected, serialization_failure


def lost_to_another_session(error: BaseException) -> bool:
    cause = error.__cause__
    while cause is not None:
        if getattr(cause, "sqlstate", None) in LOST_TO_ANOTHER_SESSION:
            return True
        cause = cause.__cause__
    return False


class FlushRetryingDeadlocks(flush.Command):
    def handle(self, **options):
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return super().handle(**options)
            except CommandError as error:
                if attempt == ATTEMPTS or not lost_to_another_session(error):
                    raise
                time.sleep(0.2 * attempt)


def retry_flush_on_deadlock() -> None:
    """Make `manage.py flush` (what TransactionTestCase runs after each test) run again when it lost a deadlock."""
    flush.Command = FlushRetryingDeadlocks
