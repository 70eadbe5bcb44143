"""The run's hosts: where each process mesh is spawned, and whether a host is still there.

FORGEBOARD_MONARCH_WORKERS (set for `placement.local_hosts` simulated hosts, or by hand) lists the
Monarch workers of a multi-host run,
comma-separated, each `tcp://host:port` or `name=tcp://host:port`. A bare entry is named after
its host part; when bare entries share a host part (several workers on one machine) each of those
is named `host:port`. Names must be unique; they are what `placement.<role>.hosts` refers to.

With workers, the controller attaches to all of them once (one host mesh, one host per worker) and
spawns each proc mesh on its host's slice. A killed worker takes its procs with it, and Monarch
then neither fails the calls pending there nor reports it (they just wait), so `check` probes each
worker's port: a host that stops accepting connections is lost for the rest of the run.
Without workers every host name labels procs on this machine (`this_host()`). A run that a cluster
started through `monarch.job` (FORGEBOARD_MONARCH_JOB, set by the SLURM and Kubernetes backends) gets
its workers and host mesh from the job instead (`monarch_job.py`).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from workers.engine.actors.devices import DeviceLedger, gpus_per_host_from_env
from workers.engine.actors.kubernetes_workers import kubernetes_hosts
from workers.engine.actors.monarch_job import JOB_STATE_FILE, MonarchJobError, slurm_batch_workers
from workers.engine.actors.procs import apply_proc_env, proc_env, spawn_procs
from workers.engine.actors.worker import Worker, choose_transport
from workers.engine.drills import LocalSignals, Signals
from workers.engine.env import WORKERS_ENV, read_env
from workers.engine.config import PlacementConfig, unknown_host_errors
from workers.engine.fields import ConfigError

logger = logging.getLogger(__name__)

LOCAL = "local"  # the one host of a run without workers
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
PROBE_TIMEOUT_S = 1.0
PROBE_EVERY_S = 1.0
SPAWN_TIMEOUT_S = 120.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
_ADDRESS = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")


class WorkerListError(ValueError):
    """FORGEBOARD_MONARCH_WORKERS cannot be used; the message names the entry."""


class HostsUnreachable(RuntimeError):
    """Some workers did not answer when the run started; the message names them."""


def parse_workers(text: str) -> list[Worker]:
    parsed: list[tuple[str, str, str, int]] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, sep, address = entry.partition("=")
        name, address = (name.strip(), address.strip()) if sep else ("", entry)
        match = _ADDRESS.match(address)
        if match is None or not 1 <= int(match["port"]) <= 65535:
            raise WorkerListError(f"{WORKERS_ENV}: {entry!r} is neither tcp://host:port nor name=tcp://host:port")
        if sep and not _NAME.match(name):
            raise WorkerListError(f"{WORKERS_ENV}: {name!r} in {entry!r} is not a host name "
                                  "(letters, digits, and _ . : - after the first)")
        parsed.append((name, address, match["host"].strip("[]"), int(match["port"])))
    bare_hosts = Counter(host for name, _, host, _ in parsed if not name)
    workers = [Worker(name or (host if bare_hosts[host] == 1 else f"{host}:{port}"), address, host, port)
               for name, address, host, port in parsed]
    for what, values in (("host name", [w.name for w in workers]), ("address", [w.address for w in workers])):
        repeated = [value for value, count in Counter(values).items() if count > 1]
        if repeated:
            raise WorkerListError(f"{WORKERS_ENV}: {what} {repeated[0]!r} appears more than once")
    return workers


def workers_from_env(environ: Mapping[str, str] | None = None) -> list[Worker]:
    return parse_workers(read_env(WORKERS_ENV, environ) or "")


def port_open(host: str, port: int, *, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def reachable(worker: Worker, *, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    return port_open(worker.host, worker.port, timeout_s=timeout_s)


def local_address_towards(worker: Worker) -> str:
    """This machine's address on the route to `worker` (plain "tcp" picks the hostname, which may resolve to loopback only)."""
    family = socket.AF_INET6 if ":" in worker.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((worker.host, worker.port))  # UDP: no packet is sent
        address = probe.getsockname()[0]
    return f"[{address}]" if family == socket.AF_INET6 else address


def check_placement(placement: PlacementConfig, *, workers: Sequence[Worker]) -> None:
    """ConfigError for a host named in the placement that is not one of the workers (none: any name labels this machine)."""
    if workers:
        errors = unknown_host_errors(placement, known=[w.name for w in workers])
        if errors:
            raise ConfigError(errors)


class Hosts:
    """Named hosts of one run: slices of one attached host mesh, or this machine under any name."""

    def __init__(self, *, workers: Sequence[Worker] = (), mesh: Any = None, attach_seconds: float = 0.0,
                 gpus_per_host: int | Callable[[], int | None] | None = None):
        self.workers = {w.name: w for w in workers}
        self._index = {w.name: i for i, w in enumerate(workers)}
        self.mesh = mesh
        self.attach_seconds = attach_seconds
        self.lost: set[str] = set()
        self._probed_at = 0.0
        self.gpus = DeviceLedger(gpus_per_host=gpus_per_host)
        self._submeshes: dict[tuple[str, ...], Any] = {}
        self._signals: dict[str, Signals] = {}

    @classmethod
    def attach(cls, *, workers: Sequence[Worker], timeout_s: float) -> Hosts:
        """Attach to every worker once; HostsUnreachable naming those that do not answer."""
        if not workers:
            return cls(gpus_per_host=_local_gpus)  # counted only if a role asks for GPUs
        started = time.monotonic()
        _raise_unreachable(workers, why="not accepting connections", source=WORKERS_ENV)
        choose_transport(local_address_towards(workers[0]))
        from monarch.actor import attach_to_workers

        mesh = attach_to_workers(ca="trust_all_connections", workers=[w.attach_address for w in workers], name="hosts")
        _wait_attached(mesh, workers, timeout_s=timeout_s, source=WORKERS_ENV)
        return cls(workers=workers, mesh=mesh, attach_seconds=round(time.monotonic() - started, 3),
                   gpus_per_host=gpus_per_host_from_env())

    @classmethod
    def from_job(cls, *, kind: str, timeout_s: float) -> Hosts:
        """The workers of the run's monarch.job (FORGEBOARD_MONARCH_JOB), attached by the job; HostsUnreachable
        naming the cause when the job cannot be attached."""
        started = time.monotonic()
        try:
            workers, mesh = attach_job_workers(kind=kind, timeout_s=timeout_s)
        except MonarchJobError as exc:
            raise HostsUnreachable(str(exc)) from None
        _wait_attached(mesh, workers, timeout_s=timeout_s, source=f"the {kind} job")
        return cls(workers=workers, mesh=mesh, attach_seconds=round(time.monotonic() - started, 3),
                   gpus_per_host=gpus_per_host_from_env())

    @property
    def names(self) -> list[str]:
        return list(self.workers) or [LOCAL]

    def spawn_procs(self, *, host: str, count: int, threads: int, gpus_per_proc: int = 0, owner: str = "") -> Any:
        """`count` procs on `host`; with `gpus_per_proc`, each holds that many of the host's GPUs until
        `release(owner)`."""
        return self.spawn_across(hosts=[host], per_host=count, threads=threads, gpus_per_proc=gpus_per_proc, owner=owner)

    def spawn_across(self, *, hosts: Sequence[str], per_host: int, threads: int, gpus_per_proc: int = 0,
                     owner: str = "") -> Any:
        """One proc mesh of `per_host` procs on each of `hosts` (labels hosts x procs with workers; procs without)."""
        hosts = list(hosts)
        lost = [h for h in hosts if h in self.lost]
        if lost:
            raise HostsUnreachable(f"host {self.describe(lost[0])} is lost")
        try:
            if not gpus_per_proc:
                groups = []
            elif self.workers:
                groups = [self.gpus.take(host=h, owner=owner, procs=per_host, gpus_per_proc=gpus_per_proc) for h in hosts]
            else:  # every name is this machine
                groups = [self.gpus.take(host=LOCAL, owner=owner, procs=per_host * len(hosts), gpus_per_proc=gpus_per_proc)]
            procs = self._spawn(hosts, per_host=per_host, threads=threads)
            if groups:
                from workers.engine.actors.proc_gpus import assign_gpus

                assign_gpus(procs, groups)
        except BaseException:
            self.gpus.release(owner)
            raise
        return procs

    def _spawn(self, hosts: list[str], *, per_host: int, threads: int) -> Any:
        if not self.workers:
            return spawn_procs(per_host * len(hosts), threads=threads)
        procs = self._host_mesh(hosts).spawn_procs(per_host={"procs": per_host},
                                                   bootstrap=partial(apply_proc_env, proc_env(threads=threads)))
        try:
            procs.initialized.get(timeout=SPAWN_TIMEOUT_S)
        except Exception:  # Monarch gives up after ~30 s on a dead host: say so when that is why
            gone = [h for h in hosts if not reachable(self.workers[h])]
            if gone:
                raise HostsUnreachable(f"host {self.describe(gone[0])} stopped accepting connections "
                                       "while a proc was spawned there") from None
            raise
        return procs

    def _host_mesh(self, hosts: list[str]) -> Any:
        """The hosts as one host mesh: a slice of the run's mesh when they are consecutive in it, else one attached
        to those workers alone (once per set of hosts)."""
        indices = [self._index[h] for h in hosts]
        if indices == list(range(indices[0], indices[0] + len(indices))):
            return self.mesh.slice(hosts=slice(indices[0], indices[-1] + 1))
        key = tuple(hosts)
        if key not in self._submeshes:
            from monarch.actor import attach_to_workers

            mesh = attach_to_workers(ca="trust_all_connections", workers=[self.workers[h].attach_address for h in hosts],
                                     name="hosts_" + "_".join(str(i) for i in indices))
            _wait_attached(mesh, [self.workers[h] for h in hosts], timeout_s=SPAWN_TIMEOUT_S, source="the run's hosts")
            self._submeshes[key] = mesh
        return self._submeshes[key]

    def signals(self, host: str) -> Signals:
        """Who sends drill signals to procs on `host`: this process without workers, else an agent proc on that host
        (started at its first drill; HostsUnreachable when the host is lost, its agent with it)."""
        if not self.workers:
            return LocalSignals()
        if host in self.lost:
            raise HostsUnreachable(f"host {self.describe(host)} is lost")
        if host not in self._signals:
            from workers.engine.actors.host_signals import AgentSignals, HostSignals

            procs = self.spawn_procs(host=host, count=1, threads=1)
            self._signals[host] = AgentSignals(procs.spawn("host_signals", HostSignals), host)
        return self._signals[host]

    def kill(self, host: str, pids: list[int]) -> None:
        """SIGKILL `pids` from their host (best effort: a lost host took them already, stopping a mesh ends them too)."""
        if host in self.lost or not pids:
            return
        try:
            self.signals(host).kill(pids)
        except Exception:  # noqa: BLE001 - see above
            logger.warning("could not kill pids %s on %s", pids, host, exc_info=True)

    def gpus_free(self, host: str) -> int | None:
        """Free GPUs of `host` (None: its count is unknown)."""
        return self.gpus.free(host if self.workers else LOCAL)

    def release(self, owner: str) -> None:
        """The GPUs `owner`'s procs held are free again (its procs stopped or were lost)."""
        self.gpus.release(owner)

    @property
    def procs_are_children(self) -> bool:
        """Whether the run's procs are this process's children (no workers: every proc is spawned from here)."""
        return not self.workers

    def pids_visible(self, host: str) -> bool:
        """Whether the pids of procs on `host` are this machine's (then /proc shows a dead one at once)."""
        return not self.workers or self.workers[host].host in LOOPBACK

    def check(self, *, now: bool = False) -> list[str]:
        """Hosts newly found unreachable (each returned once, then lost for good).

        Probes at most every PROBE_EVERY_S, or at once with `now` (before placing a proc)."""
        started = time.monotonic()
        if not self.workers or (not now and started - self._probed_at < PROBE_EVERY_S):
            return []
        self._probed_at = started
        newly = [name for name, worker in self.workers.items() if name not in self.lost and not reachable(worker)]
        self.lost.update(newly)
        return newly

    def alive(self, names: Sequence[str]) -> list[str]:
        return [name for name in names if name not in self.lost]

    def describe(self, name: str) -> str:
        return f"{name} ({self.workers[name].address})" if name in self.workers else name

    def stop(self) -> None:
        """Shut the host mesh down (its workers end); skipped when a host is lost (it would wait for it)."""
        if self.mesh is None or self.lost:
            return
        try:
            self.mesh.shutdown().get(timeout=10)
        except Exception:  # noqa: BLE001 - the run is over either way; the launcher stops what is left
            pass


def attach_job_workers(*, kind: str, timeout_s: float) -> tuple[list[Worker], Any]:
    """(workers, host mesh) of the run's job, the mesh attached by monarch.job."""
    if kind == "slurm":
        return slurm_batch_workers(state_file=JOB_STATE_FILE)
    return kubernetes_hosts(environ=os.environ, timeout_s=timeout_s)


def _local_gpus() -> int | None:
    """GPUs this machine's procs can take: GPUS_PER_HOST_ENV, else what CUDA shows the controller."""
    configured = gpus_per_host_from_env()
    if configured is not None:
        return configured
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def _wait_attached(mesh: Any, workers: Sequence[Worker], *, timeout_s: float, source: str) -> None:
    try:
        mesh.initialized.get(timeout=timeout_s)
    except Exception as error:  # noqa: BLE001 - a timeout or a refused attach: say which workers
        _raise_unreachable(workers, why=f"not attached within {timeout_s:g} s", source=source)
        raise HostsUnreachable(f"could not attach to Monarch workers "
                               f"{', '.join(w.name + ' (' + w.address + ')' for w in workers)}: {error}") from None


def _raise_unreachable(workers: Sequence[Worker], *, why: str, source: str) -> None:
    unreachable = [w for w in workers if not reachable(w, timeout_s=3.0)]
    if unreachable:
        raise HostsUnreachable(f"Monarch workers {why}: "
                               f"{', '.join(f'{w.name} ({w.address})' for w in unreachable)} (from {source})")
