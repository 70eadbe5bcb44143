"""Whether a local run's supervisor is still alive on this host: a shared lock it holds on a file in the run's folder.

The supervisor (`local_supervisor.py`) holds it while it may still move its run; a lost run's stop
(`backends.stop_attempt`) confirms an exited engine stopped only once no supervisor holds it, since until then the
supervisor may still end the run as its engine did.

A supervisor that hangs (a database call that never returns, say) would keep that stop from ever being confirmed, and
the run would fail at the stop timeout instead of restarting. So each supervisor marks its progress in a file of its
own beside the lock (`supervisor-<pid>.progress`: its pid, its start time and its engine's pid; the file's mtime is its
last progress), at every poll of its engine and every attempt to move the run. One that still holds the lock once its
engine has exited and has made no progress for `STALL_SECONDS` is our own process, stuck: the stop kills it
(`stalled_supervisors_killed`), and the run restarts from its last checkpoint, which for an engine that had finished is
its final one.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SUPERVISOR_LOCK = "supervisor.lock"  # in the run's folder: held (shared) by each live supervisor of the run on its host
SETTLE_GRACE_SECONDS = 10.0  # how long a stop waits for the supervisor of an engine that has exited to exit too
SETTLE_POLL_SECONDS = 0.1
STALL_SECONDS = 60.0  # a supervisor of an exited engine with no progress for this long is stuck, and is killed
PROGRESS_GLOB = "supervisor-*.progress"


@dataclass(frozen=True)
class Supervising:
    """A live supervisor's marks: `progressed` each time it polls its engine or tries to move its run."""

    progress_file: Path

    def progressed(self, *, engine_pid: int) -> None:
        record = f"{os.getpid()} {_start_time(os.getpid())} {engine_pid}\n"
        temporary = self.progress_file.with_suffix(".tmp")
        temporary.write_text(record)
        os.replace(temporary, self.progress_file)  # a reader never sees half a record; its mtime is now


@contextmanager
def supervising(folder: Path) -> Iterator[Supervising]:
    """Held while this supervisor may still move its run: a shared lock on the run folder's `SUPERVISOR_LOCK`, which
    the kernel lets go of when the process ends, however it ends (the engine does not inherit it)."""
    marks = Supervising(folder / f"supervisor-{os.getpid()}.progress")
    with open(folder / SUPERVISOR_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        try:
            yield marks
        finally:
            marks.progress_file.unlink(missing_ok=True)


def _start_time(pid: int) -> str:
    """When the process started, in clock ticks since boot (/proc/<pid>/stat): with its pid, which process it is."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def stalled_supervisors_killed(*, folder: Path, engine_pid: int, now: float | None = None) -> list[str]:
    """Kill the supervisors of the exited engine `engine_pid` in `folder` that have made no progress for
    `STALL_SECONDS` (SIGKILL: a stuck process may ignore anything else); what was done, one line each. Only a process
    that is still the one that wrote the mark (the same pid and start time) is killed."""
    now = time.time() if now is None else now
    done = []
    for mark in sorted(folder.glob(PROGRESS_GLOB)):
        try:
            pid, started, engine = mark.read_text().split()
            stalled = now - mark.stat().st_mtime
        except (OSError, ValueError):
            continue  # gone meanwhile, or being written
        if int(engine) != engine_pid or stalled < STALL_SECONDS:
            continue
        if _start_time(int(pid)) == started:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
            else:
                done.append(f"its supervisor (pid {pid}) had made no progress for {int(stalled)} s after its engine "
                            f"exited: killed")
        mark.unlink(missing_ok=True)
    return done


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
