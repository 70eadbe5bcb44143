"""Whether a local run's supervisor is still alive on this host: a shared lock it holds on a file in the run's folder.

The supervisor (`local_supervisor.py`) holds it while it may still move its run; a lost run's stop
(`backends.stop_attempt`) confirms an exited engine stopped only once no supervisor holds it, since until then the
supervisor may still end the run as its engine did.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SUPERVISOR_LOCK = "supervisor.lock"  # in the run's folder: held (shared) by each live supervisor of the run on its host
SETTLE_GRACE_SECONDS = 10.0  # how long a stop waits for the supervisor of an engine that has exited to exit too
SETTLE_POLL_SECONDS = 0.1


@contextmanager
def supervising(folder: Path) -> Iterator[None]:
    """Held while this supervisor may still move its run: a shared lock on the run folder's `SUPERVISOR_LOCK`, which
    the kernel lets go of when the process ends, however it ends (the engine does not inherit it)."""
    with open(folder / SUPERVISOR_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        yield


def supervisor_gone_within(*, folder: Path, seconds: float) -> bool:
    """Whether no supervisor of the run in `folder` is left on this host, waiting up to `seconds` for one to exit.

    A lost run's engine that has exited is confirmed stopped only then: until its supervisor exits, it may still end
    the run as the engine did (an engine that exited 0 finished the run), which a restart must not undo. A supervisor
    settles its run within a poll of its engine's exit, then exits."""
    try:
        lock = os.open(folder / SUPERVISOR_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return True  # no supervisor ever ran there
    deadline = time.monotonic() + seconds
    try:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(SETTLE_POLL_SECONDS)
    finally:
        os.close(lock)  # and the lock with it
