"""`forgeboard serve`'s supervisor: keeps its children (web server, Celery worker with beat) running.

A child that exits is started again after a backoff (a one-shot child, `once`, only when it fails) (1 s, doubling to 30 s; back to 1 s once a child has
stayed up a minute), each restart logged. SIGTERM or Ctrl-C stops them all. Each child runs in its own
process group (so a terminal's Ctrl-C reaches only this supervisor); engines that the worker launched run
in their own sessions and are never stopped from here: they spool their telemetry while the web server is
down and send it when it is back. Django-free.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0
POLL_S = 0.5
STOP_GRACE_S = 10.0


def log(message: str) -> None:
    print(f"forgeboard serve: {message}", file=sys.stderr, flush=True)


@dataclass
class Child:
    """One supervised process: how to start it, and where its restarts stand."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    once: bool = False  # a job that ends: an exit with 0 is final, not restarted
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = FIRST_BACKOFF_S
    next_start_at: float | None = None  # set while it is down, waiting for its backoff
    history: list[int] = field(default_factory=list)  # exit codes, oldest first

    def start(self, now: float) -> None:
        self.process = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, start_new_session=True)
        self.started_at, self.next_start_at = now, None
        log(f"{self.name} started (pid {self.process.pid})")

    def exited(self, now: float) -> bool:
        """Whether it has just exited; if so, schedule its restart after the backoff."""
        if self.process is None or self.process.poll() is None:
            return False
        code, uptime = self.process.returncode, now - self.started_at
        self.history.append(code)
        if self.once and code == 0:
            log(f"{self.name} (pid {self.process.pid}) finished after {uptime:.0f} s")
            self.process = None
            return True
        if uptime >= STABLE_AFTER_S:
            self.backoff_s = FIRST_BACKOFF_S
        self.next_start_at = now + self.backoff_s
        log(f"{self.name} (pid {self.process.pid}) exited with {code} after {uptime:.0f} s; "
            f"restarting in {self.backoff_s:.0f} s")
        self.backoff_s = min(self.backoff_s * 2, MAX_BACKOFF_S)
        self.process = None
        return True

    def due(self, now: float) -> bool:
        return self.process is None and self.next_start_at is not None and now >= self.next_start_at

    def restart(self, now: float) -> None:
        self.restarts += 1
        self.start(now)
        log(f"{self.name} restart {self.restarts}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log(f"{self.name} did not stop in time; killing it")
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


class _Stop(Exception):
    """SIGTERM: leave the loop and stop every child."""


def supervise(children: Sequence[Child], *, clock: Callable[[], float] = time.monotonic) -> int:
    """Start the children and keep them running until SIGTERM or Ctrl-C; then stop them all. Returns 0."""

    def on_sigterm(*_: object) -> None:
        raise _Stop

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for child in children:
            child.start(clock())
        while True:
            now = clock()
            for child in children:
                if not child.exited(now) and child.due(now):
                    child.restart(now)
            time.sleep(POLL_S)
    except (_Stop, KeyboardInterrupt):
        log("stopping")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        for child in children:
            child.stop()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in children:
            child.wait_stopped(deadline)
        signal.signal(signal.SIGTERM, previous)
    return 0
