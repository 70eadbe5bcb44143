"""Two requests at once, in a set order: one is inside its transaction when the other starts.

`racing_an_open_transaction(held, racer)` runs `held` in a transaction of its own thread and keeps that transaction
open while `racer` starts in a second thread (with its own database connection) and reads what is committed; once
`racer` has had time to reach the rows `held` wrote (and wait for them), `held` commits. What `racer` returned, or
the exception it raised, is the answer. Use it with `pytest.mark.django_db(transaction=True)`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from django.db import connection, transaction

RACER_HEAD_START_S = 1.0


def racing_an_open_transaction(held: Callable[[], object], racer: Callable[[], object]) -> object:
    inside, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def hold() -> None:
        try:
            with transaction.atomic():
                outcome["held"] = held()
                inside.set()
                release.wait(timeout=30)
        except BaseException as error:  # noqa: BLE001 - the caller reads it
            outcome["held"] = error
        finally:
            inside.set()
            connection.close()

    def race() -> None:
        try:
            outcome["racer"] = racer()
        except BaseException as error:  # noqa: BLE001 - the caller reads it
            outcome["racer"] = error
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(timeout=30), "the held transaction never started"
    contender = threading.Thread(target=race)
    contender.start()
    contender.join(timeout=RACER_HEAD_START_S)
    release.set()
    holder.join(timeout=30)
    contender.join(timeout=30)
    assert not holder.is_alive() and not contender.is_alive(), "a thread is stuck"
    if isinstance(outcome["held"], BaseException):
        raise AssertionError("the held transaction failed") from outcome["held"]
    return outcome["racer"]
