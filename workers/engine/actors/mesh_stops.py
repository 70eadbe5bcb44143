"""Stopping proc meshes: all of a run's at its end (`MeshStops`), or one alone (`stop_quietly`)."""

from __future__ import annotations

import os
import signal
from typing import Any


class MeshStops:
    """The meshes stopped at the end of a run: `add` starts a mesh's stop, `wait` waits for every one.

    Monarch stops one mesh at a time and waits about a second for each proc to wind down; a proc whose pid is given
    (one this process spawned: `Hosts.procs_are_children`) is sent SIGTERM first, so its stop is immediate (the run
    is over: nothing is left to save). Procs a worker spawned stop the slow way, so their worker reaps them.
    """

    def __init__(self) -> None:
        self.stopping: list[Any] = []

    def add(self, mesh: Any, *, pids: list[int] | None = None) -> None:
        for pid in pids or []:
            try:
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.stopping.append(mesh.stop())
        except Exception:  # noqa: BLE001 - a damaged mesh may refuse to stop; its procs are gone or get reaped
            pass

    def wait(self, *, timeout_s: float = 15.0) -> None:
        """Up to `timeout_s` for each mesh (Monarch stops them one after another)."""
        for stopping in self.stopping:
            try:
                stopping.get(timeout=timeout_s)
            except Exception:  # noqa: BLE001 - as in add
                pass
        self.stopping = []


def stop_quietly(mesh: Any) -> None:
    stops = MeshStops()
    stops.add(mesh)
    stops.wait()
