"""Monarch worker processes on this machine: several simulated hosts for one run (`placement.local_hosts`).

`local_workers(count=2)` starts `count` processes serving Monarch's worker loop on 127.0.0.1, each
on a free port, and yields them once each accepts connections; on exit (also when the run failed)
it stops them. The engine finds them like SLURM or Kubernetes workers: `environment_value(workers)`
is the FORGEBOARD_MONARCH_WORKERS value (`host0=tcp://127.0.0.1:PORT,...`).

Each worker leads its own session, and the procs it spawns (each in a process group of its own)
stay in it: `kill_host` SIGKILLs the session, a simulated host lost whole. Each worker also gets SIGKILL when
the process that started it dies (Linux PDEATHSIG), so a killed controller leaves no workers behind.
Django-free; imports no Monarch itself (the workers do).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from workers.engine.actors.hosts import port_open

REPO_DIR = Path(__file__).resolve().parents[3]
# argv: address, the starter's pid. The worker asks for SIGKILL when its parent dies (PR_SET_PDEATHSIG
# is 1), then checks that the parent did not die before it asked.
WORKER_CODE = """
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[2]):
    sys.exit(1)
from monarch.actor import run_worker_loop_forever
run_worker_loop_forever(address=sys.argv[1], ca="trust_all_connections")
"""


@dataclass(frozen=True)
class LocalWorker:
    name: str
    address: str  # tcp://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid


def environment_value(workers: Sequence[LocalWorker]) -> str:
    """The FORGEBOARD_MONARCH_WORKERS value naming these workers."""
    return ",".join(f"{w.name}={w.address}" for w in workers)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _worker_environment(extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_DIR) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR), *paths])
    # a dead proc is noticed within ~1 s, as for the controller's own procs
    env.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
    return env | dict(extra)


def _tail(path: Path, *, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def session_pids(leader: int) -> list[int]:
    """Processes of the session `leader` started: a worker and the procs it spawned (each in its own group)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == leader:  # the fields after the name: state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


def kill_host(worker: LocalWorker) -> None:
    """SIGKILL a worker and every proc it spawned at once: a host lost whole."""
    alive = worker.process.poll() is None  # a reaped worker's pid may belong to another process by now
    for pid in [*([worker.pid] if alive else []), *session_pids(worker.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_workers(workers: Sequence[LocalWorker], *, grace_s: float = 5.0) -> None:
    """SIGTERM each worker, then SIGKILL its session after `grace_s`; reap them all."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.terminate()
    deadline = time.monotonic() + grace_s
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        kill_host(worker)  # the procs it spawned may outlive the worker
        worker.process.wait()


@contextmanager
def local_workers(*, count: int, ready_timeout_s: float = 120.0, log_dir: Path | None = None,
                  environment: Mapping[str, str] | None = None) -> Iterator[list[LocalWorker]]:
    """`count` Monarch workers named host0.. on 127.0.0.1; stopped on exit, whatever happened."""
    if count < 1:
        raise ValueError(f"count must be 1 or more, not {count}")
    folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="monarch-workers-"))
    folder.mkdir(parents=True, exist_ok=True)
    env = _worker_environment(environment or {})
    workers: list[LocalWorker] = []
    try:
        for index in range(count):
            address = f"tcp://127.0.0.1:{free_port()}"
            log_path = folder / f"host{index}.log"
            with open(log_path, "ab") as log:
                process = subprocess.Popen([sys.executable, "-c", WORKER_CODE, address, str(os.getpid())], cwd=REPO_DIR,
                                           env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
            workers.append(LocalWorker(f"host{index}", address, process, log_path))
        deadline = time.monotonic() + ready_timeout_s
        for worker in workers:
            port = int(worker.address.rsplit(":", 1)[1])
            while not port_open("127.0.0.1", port, timeout_s=0.5):
                if worker.process.poll() is not None:
                    raise RuntimeError(f"Monarch worker {worker.name} ({worker.address}) exited with code "
                                       f"{worker.process.returncode}:\n{_tail(worker.log_path)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Monarch worker {worker.name} ({worker.address}) did not accept connections "
                                       f"within {ready_timeout_s:g} s:\n{_tail(worker.log_path)}")
                time.sleep(0.2)
        yield workers
    finally:
        stop_workers(workers)
