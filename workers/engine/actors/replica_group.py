"""Replicas of a role, each in its own proc mesh, and the role's warm spares.

A `ReplicaGroup` owns one role's replicas (generator, reference, reward). Each replica has
its own proc mesh, so one can die, be stopped and be replaced alone (spawning on a damaged
mesh hangs; a fresh mesh takes ~0.5 s). A replica is placed on a named host (`hosts.py`): a
Monarch worker of the run, or, without workers, a label on this machine's procs. Drains, moves
and replacements spawn the replica's new proc on the host they pick.

A replica (first, replacement or spare) whose model is not loaded within `failover.setup_timeout_s`
of its spawn did not start (`ReplicaGroup.started`): at the run's start the run fails; a spare is
dropped (`failover.warm_spares` are started again in the background). What happens when a replica
fails, and how a replacement that did not start is handled, is `failover.py`'s (`Failover`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.engine.actors.calls import CallFailed, ProcFailure, answered, not_started
from workers.engine.actors.hosts import Hosts
from workers.engine.actors.mesh_stops import MeshStops, stop_quietly
from workers.engine.actors.service import Service

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    role: str
    index: int
    host: str
    incarnation: int
    name: str
    procs: Any
    actor: Any
    pids: list[int] = field(default_factory=list)
    pids_visible: bool = True  # its pids are this machine's: /proc shows when they exit
    version: int = 0
    failed: bool = False
    lost_with_host: str | None = None  # why it is gone when its whole host was lost
    outstanding: int = 0  # requests sent to it and not yet awaited
    inbox: Any = None  # a generator's WeightInboxActor, on the same proc (actors/weight_inbox.py)
    spawned_at: float = field(default_factory=time.monotonic)  # its set-up's failover.setup_timeout_s counts from here
    spawned_names: tuple[str, ...] | None = field(default=None, repr=False)  # read at the first failure report

    def owns(self, mesh_name: str) -> bool:
        """Whether a failure report's mesh is this replica's actor or inbox. Monarch names every spawn uniquely (the
        name given and a suffix), so a late report from an earlier run's proc of the same name is not this one's."""
        if self.spawned_names is None:
            self.spawned_names = tuple(spawned_name(mesh) or "" for mesh in (self.actor, self.inbox) if mesh is not None)
        if self.spawned_names and all(self.spawned_names):
            return mesh_name in self.spawned_names
        return mesh_name.rsplit("-", 1)[0] in (self.name, f"{self.name}_inbox")  # a name Monarch did not give


def spawned_name(mesh: Any) -> str | None:
    """Monarch's name of one spawn of an actor mesh (`<name given>-<suffix>`); None when it cannot be read."""
    name = getattr(mesh, "_name", None)
    try:
        return str(name.get(timeout=5)) if name is not None else None
    except Exception:  # noqa: BLE001 - a proc that died while spawning may never name its mesh
        return None


class ReplicaGroup:
    """One role's replicas behind a routed Service, and its warm spares.

    A spare is a started replica (proc spawned, model loaded) outside routing; a failed replica
    is replaced by one without waiting for a process to start. Spares are started again in the
    background: `warm` spawns them, `poll_spares` (called while the controller waits) notices
    when their model has loaded.
    """

    def __init__(self, role: str, *, spawn_actor: Callable[[Any, str], Any], threads: int, routing: str,
                 setup_timeout_s: float, hosts: Hosts | None = None, spares: int = 0, gpus_per_proc: int = 0,
                 per_host: int | None = None, spawn_inbox: Callable[[Any, str], Any] | None = None):
        self.role = role
        self.setup_timeout_s = setup_timeout_s  # failover.setup_timeout_s: a new replica's model load that never ends
        self.gpus_per_proc = gpus_per_proc
        self.per_host = per_host  # placement.<role>.procs_per_host: the most replicas and spares on one host
        self.spawn_actor = spawn_actor  # (procs, actor name) -> actor mesh of one actor
        self.spawn_inbox = spawn_inbox  # (procs, actor name) -> the weight inbox beside it, for roles that take weights
        self.hosts = hosts or Hosts()  # none given: every host name is this machine
        self.threads = threads
        self.routing = routing
        self.spares = spares
        self.service: Service[Replica] | None = None
        self.incarnations = 0
        self.retiring: list[Replica] = []  # out of routing; stopped once their requests are done
        self.ready_spares: list[Replica] = []
        self.warming: list[tuple[Replica, Any]] = []  # (spare, future of its pid once its model is loaded)
        self.starting: list[tuple[Replica, Any]] = []  # the same for launched replicas not yet awaited
        self.unstarted_spares: list[CallFailed] = []  # spares whose actor did not spawn (`warm`), told at the next poll
        self.replacing: list[Replica] = []  # replacements spawned, their model loading (`Failover.repair` polls them)

    def start(self, hosts: list[str]) -> None:
        self.launch(hosts)
        while not self.await_started(wait_s=math.inf):
            pass

    def launch(self, hosts: list[str]) -> None:
        """Spawn the first replicas' procs and actors, one per host given; their models load meanwhile. A replica whose
        actor does not spawn on its procs did not start, as in `await_started`; the procs spawned before it are
        stopped (the group has no service yet for `stop_all` to find them in)."""
        replicas: list[Replica] = []
        try:
            for index, host in enumerate(hosts):
                replicas.append(self._spawn(index, host))
        except BaseException as error:
            for replica in replicas:
                self.stop(replica)
            if isinstance(error, CallFailed):
                raise self._start_failure(len(replicas), error) from None
            raise
        self.service = Service(replicas, routing=self.routing)
        self.starting = [(replica, replica.actor.pid.call_one()) for replica in self.replicas]

    def await_started(self, *, wait_s: float) -> bool:
        """Wait up to `wait_s` for the launched replicas' models to load; whether every one has. ProcFailure (the run's
        start has nothing to fall back on) when one failed as it started or did not start in time (`started`); the
        ConfigError of a model folder one refused (its actor's `pid` raises it), as a single-process run's."""
        while self.starting:
            replica, pid = self.starting[0]
            try:
                if not self.started(replica, pid, wait_s=wait_s):
                    return False
            except CallFailed as failure:
                raise self._start_failure(replica.index, failure) from None
            self.starting.pop(0)
        return True

    def _start_failure(self, index: int, failure: CallFailed) -> Exception:
        """What ends the run when replica `index` did not start at the run's start: the ConfigError of the model folder
        it refused (model.path's error), else a ProcFailure naming the role."""
        return failure.refused or ProcFailure(f"{self.role} replica {index} {failure}")

    def started(self, replica: Replica, pid: Any, *, wait_s: float) -> bool:
        """Whether a new replica (launched, a replacement or a spare) has started, waiting up to `wait_s`: `pid`, its
        actor's pid call, answers once its model has loaded (then its pids are set). CallFailed when it failed as it
        started, or (hung) when failover.setup_timeout_s has passed since its spawn (a stuck shared filesystem)."""
        deadline = replica.spawned_at + self.setup_timeout_s
        try:
            if answered(pid, max(0.001, min(wait_s, deadline - time.monotonic()))):
                replica.pids = [pid.get()]
                return True
        except Exception as error:  # noqa: BLE001 - a supervision error, an actor's (its model load raised)
            raise not_started(error) from None
        if time.monotonic() < deadline:
            return False
        raise CallFailed(f"did not start within {self.setup_timeout_s:g} s (failover.setup_timeout_s)", hung=True)

    def _start(self, index: int, host: str, name: str) -> Replica:
        """A new proc mesh with the role's actor on `host`; its model may still be loading. CallFailed when the actor
        or its inbox does not spawn on the new procs (as when its model load fails: `started`): they are stopped and
        their GPUs released."""
        procs = self.hosts.spawn_procs(host=host, count=1, threads=self.threads, gpus_per_proc=self.gpus_per_proc,
                                       owner=name)
        replica = Replica(self.role, index, host, self.incarnations, name, procs, None,
                          pids_visible=self.hosts.pids_visible(host))
        try:
            replica.actor = self.spawn_actor(procs, name)
            if self.spawn_inbox is not None:
                replica.inbox = self.spawn_inbox(procs, f"{name}_inbox")
        except Exception as error:  # noqa: BLE001 - a supervision error, a proc's: the new procs failed
            self.stop(replica)
            raise not_started(error) from None
        return replica

    def _spawn(self, index: int, host: str) -> Replica:
        self.incarnations += 1
        return self._start(index, host, f"{self.role}_{index}_{self.incarnations}")

    def _begin(self, index: int, host: str, *, replacement: bool) -> tuple[Replica, Any]:
        """A new replica `index` spawned on `host`, and its pid call: its model loads meanwhile (`started` says when it
        has). A `replacement` is among `replacing` from its spawn: stopped with the group while it loads."""
        replica = self._spawn(index, host)
        if replacement:
            self.replacing.append(replica)
        return replica, self._pid_call(replica)

    def _pid_call(self, replica: Replica) -> Any:
        """A new replica's pid call. CallFailed when it cannot be sent: the new procs are stopped, as when the actor
        does not spawn (`_start`)."""
        try:
            return replica.actor.pid.call_one()
        except Exception as error:  # noqa: BLE001 - Monarch's, sending to the new actor: the new procs failed
            self.stop(replica)
            raise not_started(error) from None

    def spawn(self, index: int, host: str) -> Replica:
        """A new replica `index` on `host`, started (an operator's add or move; no replacement). CallFailed when it did
        not start (`_start`, `started`): its procs are stopped, none of another replica's."""
        replica, pid = self._begin(index, host, replacement=False)
        try:
            while not self.started(replica, pid, wait_s=math.inf):
                pass
        except CallFailed:
            self.stop(replica)
            raise
        return replica

    def begin_replacement(self, index: int, host: str) -> tuple[Replica, Any]:
        """A replacement for replica `index` spawned on `host`, and its pid call (`_begin`)."""
        return self._begin(index, host, replacement=True)

    def replace(self, index: int, new: Replica) -> None:
        """A started replacement serves as replica `index`."""
        self.replacing = [r for r in self.replacing if r is not new]
        self.service.replace(index, new)

    def room(self, host: str, *, replacing: Replica | None = None) -> float:
        """How many more of this role's procs `host` can take (inf: no limit): procs_per_host, and free GPUs with
        gpus_per_proc. `replacing`: a replica about to stop, whose place counts as free."""
        others = [r for r in [*(self.live() if self.service else []), *self.spare_replicas(), *self.replacing]
                  if r is not replacing]
        slots = math.inf if self.per_host is None else self.per_host - sum(r.host == host for r in others)
        free = self.hosts.gpus_free(host)
        if free is not None and self.gpus_per_proc:
            if replacing is not None and replacing.host == host:
                free += self.gpus_per_proc
            slots = min(slots, free // self.gpus_per_proc)
        return max(slots, 0)

    def has_room(self, host: str, *, replacing: Replica | None = None) -> bool:
        return self.room(host, replacing=replacing) >= 1

    @property
    def replicas(self) -> list[Replica]:
        return self.service.replicas

    def live(self) -> list[Replica]:
        """Replicas in routing (not failed, drained or removed)."""
        return [r for i, r in enumerate(self.replicas) if self.service.available[i]]

    def find(self, mesh_name: str) -> Replica | None:
        for replica in [*self.replicas, *self.retiring, *self.spare_replicas(), *self.replacing]:
            if replica.owns(mesh_name):
                return replica
        return None

    # --- warm spares ------------------------------------------------------------------
    def spare_replicas(self) -> list[Replica]:
        return [*self.ready_spares, *(replica for replica, _ in self.warming)]

    def warm(self, host: str) -> int:
        """Start spares on `host` until `spares` are ready or loading; how many were started. One whose actor does not
        spawn on its procs (`_start`) is told at the next `poll_spares`, and no more are started now: the next `warm`
        starts another. Spares on lost hosts are dropped first (their procs are gone); HostsUnreachable when `host` dies
        as a spare is spawned there (those started before it are on that host too)."""
        self.drop_lost_spares()
        started = 0
        while len(self.ready_spares) + len(self.warming) < self.spares and self.has_room(host):
            self.incarnations += 1
            try:
                spare = self._start(-1, host, f"{self.role}_spare_{self.incarnations}")
                self.warming.append((spare, self._pid_call(spare)))
            except CallFailed as failure:  # its procs are stopped already
                self.unstarted_spares.append(failure)
                break
            started += 1
        return started

    def poll_spares(self, *, wait_s: float = 0.001) -> tuple[list[Replica], list[str]]:
        """Spares whose model finished loading since the last poll (they are ready now), and why each spare that failed
        to start (`started`, or `warm` as it spawned it) did: those are stopped and dropped; `warm` starts others. The
        ConfigError of a model folder one refused (as `await_started`): each spare started again would refuse it too."""
        ready, loading = [], []
        failures, self.unstarted_spares = self.unstarted_spares, []
        for spare, pid in self.warming:
            try:
                if self.started(spare, pid, wait_s=wait_s):
                    ready.append(spare)
                else:
                    loading.append((spare, pid))
            except CallFailed as failure:
                failures.append(failure)
                self.stop(spare)
        for failure in failures:
            logger.warning("a %s spare %s", self.role, failure)
        failed = [str(failure) for failure in failures]
        refused = next((failure.refused for failure in failures if failure.refused), None)
        self.warming = loading
        self.ready_spares.extend(ready)
        if refused is not None:
            raise refused
        return ready, failed

    def take_spare(self, index: int, host: str) -> Replica | None:
        """A ready spare to serve as replica `index` (one on `host` if there is one), or None."""
        self.drop_lost_spares()
        if not self.ready_spares:
            return None
        spare = next((s for s in self.ready_spares if s.host == host), self.ready_spares[0])
        self.ready_spares.remove(spare)
        spare.index = index
        return spare

    def drop_lost_spares(self) -> None:
        for lost in [s for s in self.spare_replicas() if s.host in self.hosts.lost]:
            self.drop_spare(lost)

    def drop_spares_on(self, host: str) -> int:
        """Stop the spares on a host that is being drained, and the replacements loading there (each starts again
        elsewhere at the next repair); how many spares."""
        doomed = [spare for spare in self.spare_replicas() if spare.host == host]
        for spare in doomed:
            self.drop_spare(spare)
        for replacement in [r for r in self.replacing if r.host == host]:
            self.stop(replacement)
        return len(doomed)

    def drop_spare(self, spare: Replica) -> None:
        """A spare that died: forget it (the next `warm` starts another)."""
        self.ready_spares = [s for s in self.ready_spares if s is not spare]
        self.warming = [(s, pid) for s, pid in self.warming if s is not spare]
        self.stop(spare)

    def retire(self, replica: Replica) -> None:
        self.retiring.append(replica)
        self.reap()

    def reap(self) -> None:
        """Stop retired replicas that no request is waiting on any more."""
        keep = []
        for replica in self.retiring:
            if replica.outstanding > 0:
                keep.append(replica)
            else:
                self.stop(replica)
        self.retiring = keep

    def kill(self, replica: Replica) -> None:
        """SIGKILL the replica's procs, from its host (best effort: a lost host took them already)."""
        self.hosts.kill(replica.host, replica.pids)

    def stop(self, replica: Replica, *, stops: MeshStops | None = None) -> None:
        """Stop a replica's procs (with `stops`: start stopping them, `stops.wait()` waits)."""
        self.replacing = [r for r in self.replacing if r is not replica]
        if replica.host not in self.hosts.lost:  # a lost host's procs are gone, and stopping them would wait
            if stops is None:
                stop_quietly(replica.procs)
            else:
                stops.add(replica.procs, pids=replica.pids if self.hosts.procs_are_children else [])
        self.hosts.release(replica.name)

    def stop_all(self, *, stops: MeshStops | None = None) -> None:
        stops_here = stops or MeshStops()
        for replica in [*(self.service.replicas if self.service else []), *self.retiring, *self.spare_replicas(),
                        *self.replacing]:
            self.stop(replica, stops=stops_here)
        if stops is None:
            stops_here.wait()
