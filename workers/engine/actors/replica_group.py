"""Replicas of a role, each in its own proc mesh, and what happens when one fails.

A `ReplicaGroup` owns one role's replicas (generator, reference, reward). Each replica has
its own proc mesh, so one can die, be stopped and be replaced alone (spawning on a damaged
mesh hangs; a fresh mesh takes ~0.5 s). A replica is placed on a named host (`hosts.py`): a
Monarch worker of the run, or, without workers, a label on this machine's procs. Drains, moves
and replacements spawn the replica's new proc on the host they pick.

`Failover` turns failures into events and replacements:
  detect   a call failed (Monarch supervision: the proc died; or no answer within
           `failover.call_timeout_s`: hung) or the supervision hook named a replica's mesh:
           emit `failure_detected`, take the replica out of routing, queue its replacement
           (a hung proc is killed first). Once per replica incarnation.
  repair   at a safe point of the controller loop: take a warm spare (`failover.warm_spares`)
           or else spawn the replacement on its host; once its model has loaded, bring it to the
           current policy version (`prepare`), put it back in routing, emit `replica_replaced`.
           While it loads the role's healthy replicas serve and the run goes on: it is looked at
           again at each repair, and waited for only when no replica of its role serves. Spares
           used up are started again in the background. A replica
           (first, replacement or spare) whose model is not loaded within `failover.setup_timeout_s`
           of its spawn did not start: at the run's start the run fails; a replacement that did not
           start (or failed as it started, or as it took the weights) is one more failure of its replica;
           a spare is dropped.
           One that refuses the model folder (its actor's ConfigError: the folder changed since the
           start) ends the run with that field's error, as at the start: every other would read it too.
  recovered  emitted once the failed request has been served again (retried on a healthy
           replica) and the replacement, if one was needed, serves: `time_to_detect_s` (from
           the injected fault, when a drill caused it), `time_to_recover_s` (from detection).
Past `failover.max_replacements` replacements for a role, or `failover.max_retries` retries
of one request, the run fails with the reason.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monarch.actor import ActorError

from workers.engine.actors.hosts import Hosts, HostsUnreachable
from workers.engine.actors.service import Service
from workers.engine.config import FailoverConfig
from workers.engine.drills import ActiveFault, FaultInjector
from workers.engine.fields import ConfigError
from workers.engine.metrics import Recorder

logger = logging.getLogger(__name__)


class ProcFailure(RuntimeError):
    """The run cannot go on: the reason says which role failed and which limit was reached."""


class CallFailed(Exception):
    def __init__(self, message: str, *, hung: bool, raised: BaseException | None = None):
        super().__init__(message)
        self.hung = hung
        self.raised = raised  # what the call ended with: for an actor's exception, the one its endpoint raised

    @property
    def reason(self) -> str:
        """One line for an event: what failed, and the error it ended with."""
        lines = [line.strip() for line in str(self).splitlines() if line.strip()]
        text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
        return text[:300]

    @property
    def refused(self) -> ConfigError | None:
        """The field's error when the call ended on a file a field named that the actor refused (a model folder, a
        checkpoint): the run ends with it, as a single-process run does; a new proc would read the same file."""
        return self.raised if isinstance(self.raised, ConfigError) else None


def call_failed(error: Exception) -> CallFailed:
    """A call that ended with an error (a supervision error, an actor's exception)."""
    return CallFailed(f"{type(error).__name__}: {str(error)[:20_000]}", hung=False,
                      raised=error.exception if isinstance(error, ActorError) else error)


def refusal_ends_run(refused: ConfigError, *, recorder: Recorder, step: int, what: str) -> ConfigError:
    """A file a field named that a new proc refused (the model folder, a checkpoint: `CallFailed.refused`) ends the run
    with that field's error, as a single-process run does; no other proc is tried, it would read the same file. Said on
    the run page as "`what`: the error; not recovered: the run ends" (`what`: which proc did not do what), since mid-run
    the failure it was to recover from is told there. The error, for the caller to raise."""
    recorder.event("message", step=step, text=f"{what}: {refused}; not recovered: the run ends")
    return refused


def not_started(error: Exception) -> CallFailed:
    """A new replica whose actor failed as it spawned or as its model loaded (a supervision error, an actor's)."""
    failed = call_failed(error)
    return CallFailed(f"did not start: {failed}", hung=False, raised=failed.raised)


def wait_for(future: Any, *, timeout_s: float, poll_s: float, tick: Callable[[], None],
             gone: Callable[[], str | None] = lambda: None) -> Any:
    """A future's result, polling every poll_s (running `tick`); CallFailed when it fails or hangs.

    `gone`: the reason the callee is known dead (say its host was lost: Monarch then never fails
    the call), or None; the wait stops with that reason.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return future.get(timeout=max(0.01, min(poll_s, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise CallFailed(f"no answer within {timeout_s:g} s", hung=True) from None
            tick()
            reason = gone()
            if reason is not None:
                raise CallFailed(reason, hung=False) from None
        except Exception as error:  # noqa: BLE001 - a supervision error, an actor error: the call failed
            raise call_failed(error) from None


def answered(future: Any, wait_s: float) -> bool:
    """Whether `future` has its answer after waiting up to `wait_s` (it raises what the call raised)."""
    try:
        future.get(timeout=wait_s)
    except TimeoutError:
        return False
    return True


def request_deadline(*, typical_s: float | None, config: FailoverConfig) -> float:
    """Seconds a replica may take to answer one request before it counts as hung.

    `failover.call_timeout_s`, or with `failover.straggler_factor` that many times the role's
    typical seconds per request (never under `straggler_min_s`): a stopped replica is then
    noticed in a few seconds instead of at the call timeout.
    """
    if not config.straggler_factor or typical_s is None:
        return config.call_timeout_s
    return min(config.call_timeout_s, max(config.straggler_min_s, config.straggler_factor * typical_s))


def wait_all(futures: list[Any], *, config: FailoverConfig, tick: Callable[[], None],
             gone: list[Callable[[], str | None]] | None = None) -> list[Any]:
    """Each future's result, or the CallFailed it ended with, awaited together.

    With `failover.straggler_factor`, one that answers far later than the others (factor x the
    median time of those that answered) counts as hung; else each has `call_timeout_s`. `gone[i]`:
    the reason future i's callee is known dead (as in `wait_for`), or None.
    """
    started = last_tick = time.monotonic()
    results: dict[int, Any] = {}
    took: list[float] = []
    while len(results) < len(futures):
        for i, future in enumerate(futures):
            if i in results:
                continue
            try:
                results[i] = future.get(timeout=0.005)
                took.append(time.monotonic() - started)
            except TimeoutError:
                pass
            except Exception as error:  # noqa: BLE001 - a supervision error, an actor error: the call failed
                results[i] = call_failed(error)
        deadline = request_deadline(typical_s=sorted(took)[len(took) // 2] if took else None, config=config)
        now = time.monotonic()
        if now - started >= deadline:
            for i in range(len(futures)):
                results.setdefault(i, CallFailed(f"no answer within {deadline:g} s", hung=True))
        elif now - last_tick >= config.poll_seconds:
            tick()
            last_tick = now
            for i, reason in enumerate(g() for g in gone or []):
                if reason is not None:
                    results.setdefault(i, CallFailed(reason, hung=False))
    return [results[i] for i in range(len(futures))]


def exited(pid: int) -> bool:
    """A local process that is gone, or killed and not yet reaped (a zombie).

    Monarch's supervision can take ~10 s to report a dead proc, and a call sent to it meanwhile
    just waits; on this machine /proc says so at once. Elsewhere (no /proc) this says nothing.
    """
    if not Path("/proc/self/stat").exists():
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


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
        return replica, replica.actor.pid.call_one()

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
            except CallFailed as failure:  # its procs are stopped already
                self.unstarted_spares.append(failure)
                break
            self.warming.append((spare, spare.actor.pid.call_one()))
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


@dataclass
class Repair:
    """A failed replica waiting for its replacement: queued at its detection, done once a replacement serves."""

    group: ReplicaGroup
    replica: Replica  # the failed one
    incidents: list[Incident]  # its failure, then each replacement's that did not start
    began: float | None = None  # when the failed one was stopped for its first replacement (time.monotonic()):
    # set before any replacement is taken or spawned
    new: Replica | None = None  # the replacement loading now, if any
    pid: Any = None  # the new replica's pid call: it answers once the model has loaded
    loaded: Replica | None = None  # one that loaded but could not take the weights, for a reason not its own (the
    # trainer failed): it takes them at the next repair instead of loading another


@dataclass
class Incident:
    """One detected failure of one replica incarnation, until it is recovered."""

    role: str
    replica: int
    fault: ActiveFault | None
    detected_at: float
    time_to_detect_s: float | None
    needs_replacement: bool
    replaced: bool = False
    served_again: bool = False
    recovered: bool = False


class Failover:
    def __init__(self, *, recorder: Recorder, injector: FaultInjector, config: FailoverConfig,
                 step: Callable[[], int], policy_version: Callable[[], int]):
        self.recorder = recorder
        self.injector = injector
        self.config = config
        self.step = step
        self.policy_version = policy_version
        self.replacements: dict[str, int] = {}
        self.incidents: list[Incident] = []
        self._by_replica: dict[int, Incident] = {}  # id(replica) -> its incident
        self._queue: list[Repair] = []
        self.detect_seconds: list[float] = []
        self.recover_seconds: list[float] = []

    # --- detection ------------------------------------------------------------------
    def detect(self, group: ReplicaGroup, replica: Replica, reason: str, *, hung: bool, alive: bool = False,
               request_failed: bool = True) -> Incident:
        """Record a failure of `replica` (once per incarnation); queue its replacement unless it is alive.

        `request_failed`: a request saw the failure and will be retried (else nothing waits to be served again).
        """
        incident = self._by_replica.get(id(replica))
        if incident is not None and (incident.needs_replacement or alive):
            return incident  # the same failure, seen by another request
        now = time.monotonic()
        fault = self.injector.claim(group.role, replica.index)
        ttd = round(now - fault.injected_at, 3) if fault else None
        incident = Incident(group.role, replica.index, fault, now, ttd, needs_replacement=not alive,
                            served_again=not request_failed)
        self.incidents.append(incident)
        self._by_replica[id(replica)] = incident
        if ttd is not None:
            self.detect_seconds.append(ttd)
        self.recorder.event("failure_detected", step=self.step(), role=group.role, replica=replica.index, host=replica.host,
                            fault_id=fault.id if fault else None, reason=reason[:300], hung=hung, time_to_detect_s=ttd)
        if alive:
            return incident
        replica.failed = True
        if group.replicas[replica.index] is replica:
            group.service.set_available(replica.index, False)
            if hung:
                group.kill(replica)  # a hung proc may wake up later: make sure it does not
            self._queue.append(Repair(group, replica, [incident]))
        return incident

    def incident_of(self, replica: Replica) -> Incident | None:
        return self._by_replica.get(id(replica))

    # --- replacement ----------------------------------------------------------------
    def repair(self, prepare: dict[str, Callable[[Replica], int]], *, host: Callable[[Replica], str]) -> None:
        """Replace queued failed replicas: a ready spare at once; else a replacement spawned on `host(old)` that serves
        from the first repair after its model has loaded. Either is brought to the current version (`prepare`) and
        routed to again. While one loads, its role's healthy replicas serve; a repair waits for it only when none does.
        A replacement that does not start (it fails, or its set-up outlasts failover.setup_timeout_s) or whose own call
        fails as it takes the weights is one more failure of the replica, within the same failover.max_replacements:
        another is started. One that cannot take them for a reason not its own (the trainer failed: the error goes up)
        is kept, loaded, and takes them at the next repair. One that refuses the model folder ends the run with that
        field's ConfigError (as `await_started`): another would read the same folder."""
        for repair in list(self._queue):  # each starts loading (or serves, when it has loaded)
            self._advance(repair, prepare, host, wait=False)
        for repair in list(self._queue):  # then a role none of whose replicas serves waits for its replacements
            if repair in self._queue and not repair.group.service.routable():
                self._advance(repair, prepare, host, wait=True)

    def _advance(self, repair: Repair, prepare: dict[str, Callable[[Replica], int]], host: Callable[[Replica], str], *,
                 wait: bool) -> None:
        group, replica = repair.group, repair.replica
        while True:
            if repair.loaded is not None:
                loaded, repair.loaded = repair.loaded, None
                if self._still_there(group, loaded):
                    if self._replaced(repair, loaded, prepare, from_spare=False):
                        return
                    continue
                group.stop(loaded)
            if repair.new is not None and not self._still_there(group, repair.new):
                group.stop(repair.new)
                repair.new = None
            if repair.new is None:
                loading = sum(r.new is not None or r.loaded is not None for r in self._queue if r.group is group)
                if self.replacements.get(group.role, 0) + loading + 1 > self.config.max_replacements:
                    raise ProcFailure(f"{group.role} replica {replica.index} failed and the run has used its "
                                      f"{self.config.max_replacements} replacements for {group.role} "
                                      f"(failover.max_replacements)")
                target = host(replica)  # first: it finds out whether the old replica's host is lost (then not stopped)
                if repair.began is None:
                    group.stop(replica)
                    repair.began = time.monotonic()
                spare = group.take_spare(replica.index, target)
                if spare is not None:
                    if self._replaced(repair, spare, prepare, from_spare=True):
                        return
                    continue
            try:
                if repair.new is None:
                    repair.new, repair.pid = group.begin_replacement(replica.index, target)
                waits = wait and not group.service.routable()  # no replica of the role serves: nothing goes on
                while not group.started(repair.new, repair.pid, wait_s=math.inf if waits else 0.0):
                    if not waits:
                        return  # still loading: the healthy replicas serve meanwhile
            except HostsUnreachable:  # the host died meanwhile: `host` finds it lost next time and picks another
                continue
            except CallFailed as failure:  # it failed as it spawned or loaded, or its load outlasted the setup timeout
                where = repair.new.host if repair.new is not None else target
                if repair.new is not None:
                    group.stop(repair.new)
                    repair.new = None
                if failure.refused:
                    raise refusal_ends_run(failure.refused, recorder=self.recorder, step=self.step(), what=(
                        f"the replacement of {group.role} replica {replica.index} did not start on {where}")) from None
                self.replacements[group.role] = self.replacements.get(group.role, 0) + 1
                repair.incidents.append(self._start_failed(group, replica, host=where, failure=failure))
                continue
            new, repair.new = repair.new, None
            if self._replaced(repair, new, prepare, from_spare=False):
                return

    @staticmethod
    def _still_there(group: ReplicaGroup, replacement: Replica) -> bool:
        """Whether a replacement spawned for a repair still stands: a drain stops one (it leaves `replacing`), a lost
        host takes it. One that does not is started again on another host, uncounted."""
        return replacement in group.replacing and replacement.host not in group.hosts.lost

    def _replaced(self, repair: Repair, new: Replica, prepare: dict[str, Callable[[Replica], int]], *,
                  from_spare: bool) -> bool:
        """A started replacement (a spare, or one spawned for the replica) takes the current weights and serves; whether
        it does. One whose own call fails meanwhile (`prepare` raises CallFailed: its proc died, or it hangs and is
        killed) is stopped and is one more failure of the replica, as one that did not start: another is tried."""
        group, replica = repair.group, repair.replica
        try:
            new.version = prepare[group.role](new) if group.role in prepare else 0
        except CallFailed as failure:
            if failure.hung:
                group.kill(new)  # it may wake up later: make sure it does not
            group.stop(new)
            self.replacements[group.role] = self.replacements.get(group.role, 0) + 1
            repair.incidents.append(self._start_failed(group, replica, host=new.host, failure=CallFailed(
                f"did not take the current weights: {failure.reason}", hung=failure.hung)))
            return False
        except BaseException:  # e.g. the trainer holding the weights died: try again at the next repair, with it
            if from_spare:  # back among the ready ones
                new.index = -1
                group.ready_spares.append(new)
            else:  # kept loaded (its load takes minutes on GPUs); still among `replacing`, so stopped with the group
                repair.loaded = new
            raise
        self._queue.remove(repair)
        self.replacements[group.role] = self.replacements.get(group.role, 0) + 1
        group.replace(replica.index, new)
        self.recorder.event("replica_replaced", step=self.step(), role=group.role, replica=replica.index,
                            host=new.host, incarnation=new.incarnation, pids=new.pids, policy_version=new.version,
                            from_spare=from_spare,
                            seconds=round(time.monotonic() - repair.began, 3))
        for incident in repair.incidents:
            incident.replaced = True
            self._maybe_recovered(incident)
        return True

    def _start_failed(self, group: ReplicaGroup, replica: Replica, *, host: str, failure: CallFailed) -> Incident:
        """A replacement of `replica` that did not start on `host`: its failure_detected; recovered once a replacement
        serves (no request waits for this one)."""
        incident = Incident(group.role, replica.index, None, time.monotonic(), None, needs_replacement=True,
                            served_again=True)
        self.incidents.append(incident)
        self.recorder.event("failure_detected", step=self.step(), role=group.role, replica=replica.index, host=host,
                            fault_id=None, reason=f"the replacement {failure}"[:300], hung=failure.hung,
                            time_to_detect_s=None)
        return incident

    def pending_repairs(self) -> bool:
        return bool(self._queue)

    def served(self, incident: Incident | None) -> None:
        """A request that failed with this incident has now been served."""
        if incident is not None and not incident.served_again:
            incident.served_again = True
            self._maybe_recovered(incident)

    def _maybe_recovered(self, incident: Incident) -> None:
        if incident.recovered or not incident.served_again or (incident.needs_replacement and not incident.replaced):
            return
        incident.recovered = True
        if not incident.needs_replacement:  # the replica itself lives on: a later failure is a new incident
            self._by_replica = {k: v for k, v in self._by_replica.items() if v is not incident}
        ttr = round(time.monotonic() - incident.detected_at, 3)
        self.recover_seconds.append(ttr)
        if incident.fault is not None:
            self.injector.finish(incident.fault)
        self.recorder.event("recovered", step=self.step(), role=incident.role, replica=incident.replica,
                            fault_id=incident.fault.id if incident.fault else None, caused_failure=True,
                            action="replaced" if incident.needs_replacement else "retried",
                            time_to_detect_s=incident.time_to_detect_s, time_to_recover_s=ttr,
                            policy_version=self.policy_version())

    # --- requests -------------------------------------------------------------------
    def backoff(self, attempt: int, *, what: str) -> None:
        if attempt > self.config.max_retries:
            raise ProcFailure(f"{what} failed {attempt} times (failover.max_retries is {self.config.max_retries})")
        time.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
