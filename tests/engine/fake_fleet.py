"""A fake set of Monarch hosts and actors for the controller's parts: the real replica groups, services, failover
and fault injector run over them, with no process spawned. Below them, replica groups whose replicas are plain objects
(FakeGroup and its subclasses), for the tests of actors/replica_group.py and actors/failover.py."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from workers.engine.actors.failover import Failover
from workers.engine.actors.hosts import HostsUnreachable
from workers.engine.actors.replica_group import Replica, ReplicaGroup
from workers.engine.actors.service import Service
from workers.engine.actors.weight_inbox import Fetched
from workers.engine.actors.weight_outbox import WeightPart, WeightPublication
from workers.engine.config import FailoverConfig, RunConfig, load_config
from workers.engine.controller.placement import Placer
from workers.engine.controller.state import RunState
from workers.engine.drills import FaultInjector, LocalSignals
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.weight_parts import PartLayout, Piece

PIDS = itertools.count(50_000)


class Done:
    """A future that has its value already."""

    def __init__(self, value: Any = None, error: Exception | None = None):
        self.value, self.error = value, error

    def get(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class FakeEndpoint:
    def __init__(self, answer: Any):
        self.answer, self.calls = answer, []

    def call_one(self, *args: Any, **kwargs: Any) -> Done:
        self.calls.append(args)
        return Done(self.answer(*args) if callable(self.answer) else self.answer)

    call = call_one


class FakeActor:
    """An actor (or a mesh of them, answering as one): `pid`, `inject_fault`, and the endpoints a test gives it."""

    def __init__(self, pid: int, *, name: str | None = None, **endpoints: Any):
        self.pid = FakeEndpoint(pid)
        if name is not None:  # as Monarch names a spawn: the name given and a suffix
            self._name = Done(f"{name}-0")
        self.inject_fault = FakeEndpoint(None)
        for name, answer in endpoints.items():
            setattr(self, name, FakeEndpoint(answer))

    def slice(self, **_: int) -> FakeActor:
        return self


CONTROL_ENDPOINTS = {"state_dict": {"position": 0}, "load_state_dict": None, "stats": {"batches": 0, "dropped_stale": 0}}


class FakeProcs:
    def __init__(self, host: str):
        self.host, self.stopped = host, False
        self.actors: dict[str, FakeActor] = {}

    def spawn(self, name: str, actor_class: type, *args: Any) -> FakeActor:
        self.actors[name] = FakeActor(next(PIDS), **CONTROL_ENDPOINTS)
        return self.actors[name]

    def stop(self) -> Done:
        self.stopped = True
        return Done()


class FakeHosts:
    """Named hosts; `fail(name)` makes the next check find the host unreachable."""

    def __init__(self, names: Iterable[str], *, workers: bool = True):
        self.names = list(names)
        self.workers = {name: SimpleNamespace(host=f"{name}.cluster") for name in self.names} if workers else {}
        self.lost: set[str] = set()
        self._failing: list[str] = []
        self.killed: list[tuple[str, list[int]]] = []
        self.spawned: list[tuple[str, str]] = []  # (host, owner)
        self.released: list[str] = []  # owners whose GPUs were given back

    def fail(self, name: str) -> None:
        self._failing.append(name)

    def check(self, *, now: bool = False) -> list[str]:
        newly = [name for name in dict.fromkeys(self._failing) if name not in self.lost]
        self.lost.update(newly)
        self._failing = []
        return newly

    def alive(self, names: Iterable[str]) -> list[str]:
        return [name for name in names if name not in self.lost]

    def describe(self, name: str) -> str:
        return name

    def spawn_procs(self, *, host: str, count: int, threads: int, gpus_per_proc: int = 0, owner: str = "") -> FakeProcs:
        if host in self.lost:
            raise HostsUnreachable(f"host {host} is lost")
        self.spawned.append((host, owner))
        return FakeProcs(host)

    def pids_visible(self, host: str) -> bool:
        return False  # the pids are not this machine's: failures show through reports and lost hosts only

    @property
    def procs_are_children(self) -> bool:
        return False  # fake pids: never signalled

    def gpus_free(self, host: str) -> int | None:
        return None

    def kill(self, host: str, pids: list[int]) -> None:
        self.killed.append((host, list(pids)))

    def release(self, owner: str) -> None:
        self.released.append(owner)

    def signals(self, host: str) -> LocalSignals:
        if host in self.lost:
            raise HostsUnreachable(f"host {host} is lost")
        signals = LocalSignals()
        signals.where = host
        return signals


def staged_part(reuse: bool) -> dict[int, WeightPart]:
    """The trainer's one rank staging its weights: a part of one 4-byte tensor (no buffers: a fake inbox reads none)."""
    layout = PartLayout(rank=0, nbytes=4, pieces=(Piece(name="w", index=0, dtype="float32", shape=(1,), offset=0, nbytes=4),))
    return {0: WeightPart(buffers=(), layout=layout)}


def read_publication(publication: WeightPublication) -> Fetched:
    """A generator's inbox reading a publication."""
    return Fetched(publication=publication.number, nbytes=publication.nbytes, seconds=0.001)


def fetched(inbox: Any) -> list[tuple[int, int]]:
    """(publication, policy version) of every publication a fake inbox was told to read."""
    return [(publication.number, publication.version) for (publication,) in inbox.fetch.calls]


def fake_group(role: str, hosts: FakeHosts, placement: list[str], *, per_host: int | None = None,
               spares: int = 0, setup_timeout_s: float = FailoverConfig().setup_timeout_s,
               **endpoints: Any) -> ReplicaGroup:
    """A started replica group of `role` with one replica on each host of `placement`."""
    inbox = (lambda procs, name: FakeActor(next(PIDS), name=name, fetch=read_publication)) \
        if role == "generator" else None
    group = ReplicaGroup(role, spawn_actor=lambda procs, name: FakeActor(next(PIDS), name=name, **endpoints), threads=1,
                         routing="round_robin", setup_timeout_s=setup_timeout_s, hosts=hosts, spares=spares,
                         per_host=per_host, spawn_inbox=inbox)
    group.start(placement)
    return group


def fails_to_start(group: ReplicaGroup, error: Exception, *, on: str | None = None) -> list[FakeProcs]:
    """From now on the group's new replicas and spares on host `on` (None: on any) fail as they start: their actor's
    pid call raises `error`, as one whose model load raised. The procs each was spawned on."""
    spawn_actor, spawned = group.spawn_actor, []

    def failing(procs: FakeProcs, name: str) -> FakeActor:
        actor = spawn_actor(procs, name)
        if on is None or procs.host == on:
            actor.pid.call_one = lambda: Done(error=error)
            spawned.append(procs)
        return actor

    group.spawn_actor = failing
    return spawned


def fails_to_spawn(group: ReplicaGroup, error: Exception, *, part: str = "actor", on: str | None = None,
                   times: int | None = None) -> list[FakeProcs]:
    """From now on the group's new replicas and spares on host `on` (None: on any) get their procs, and then spawning
    their actor (`part` "actor") or weight inbox ("inbox") on them raises `error`, as on procs that died as they
    started; the first `times` of them (None: every one). The procs each was spawned on."""
    attribute = "spawn_actor" if part == "actor" else "spawn_inbox"
    spawn, spawned = getattr(group, attribute), []

    def failing(procs: FakeProcs, name: str) -> FakeActor:
        if (on is None or procs.host == on) and (times is None or len(spawned) < times):
            spawned.append(procs)
            raise error
        return spawn(procs, name)

    setattr(group, attribute, failing)
    return spawned


def grpo_config(placement: str = "", **sections: str) -> RunConfig:
    extra = "".join(f"{name}: {body}\n" for name, body in sections.items())
    return load_config(f"recipe: grpo\nmodel: {{path: /m}}\nplacement: {{backend: monarch, {placement}}}\n{extra}")


class Fleet:
    """The parts every controller test needs: hosts, groups, placer, state, failover, injector and the events."""

    def __init__(self, config: RunConfig, hosts: FakeHosts, groups: dict[str, ReplicaGroup], *, trainer_hosts=("a",)):
        self.config, self.hosts, self.groups = config, hosts, groups
        self.sink = MemorySink()
        self.recorder = Recorder([self.sink])
        self.state = RunState()
        self.injector = FaultInjector(self.recorder)
        self.failover = Failover(recorder=self.recorder, injector=self.injector,
                                 config=FailoverConfig(retry_backoff_s=0.0), step=lambda: self.state.step,
                                 policy_version=lambda: self.state.policy_version)
        ranks = config.trainer.ranks
        self.placer = Placer(placement=config.placement, hosts=hosts, device="cpu", trainer_ranks=ranks,
                             ranks_per_host=config.placement.trainer.procs_per_host or ranks, groups=groups,
                             trainer_hosts=list(trainer_hosts))

    def events(self, name: str) -> list[dict[str, Any]]:
        return self.sink.events(name)


def controller_parts(config: RunConfig, hosts: FakeHosts, groups: dict[str, ReplicaGroup], *,
                     trainer_hosts: Iterable[str] = ("a",), trainer_pids: Iterable[int] = (7,),
                     control_host: str | None = None) -> Fleet:
    """A Fleet with the controller's trainer handle (over a fake trainer actor), control procs (on `control_host`)
    and supervisor."""
    from workers.engine.controller.control_procs import ControlProcs
    from workers.engine.controller.incidents import RecoveryLog
    from workers.engine.controller.supervision import Supervisor
    from workers.engine.actors.trainer import TrainerActor
    from workers.engine.controller.trainer import TrainerHandle
    from workers.engine.controller.waits import Waits

    fleet = Fleet(config, hosts, groups, trainer_hosts=tuple(trainer_hosts))
    fleet.waits = Waits(config=config.failover)
    fleet.log = RecoveryLog(recorder=fleet.recorder, injector=fleet.injector, failover=fleet.failover, state=fleet.state)
    trainer = fleet.trainer = TrainerHandle(config=config, actor=TrainerActor, hosts=hosts, placer=fleet.placer,
                                            waits=fleet.waits, recorder=fleet.recorder, log=fleet.log,
                                            state=fleet.state)
    trainer.pids = list(trainer_pids)
    trainer.actors = FakeActor(0, name="trainer", state_dict={"w": 1}, pids=dict(enumerate(trainer.pids)),
                               stage_weights=staged_part)
    trainer.running = True  # as launched: Monarch named its spawn `trainer-0`
    control = fleet.control = ControlProcs(config=config, hosts=hosts, waits=fleet.waits, recorder=fleet.recorder,
                                           state=fleet.state)
    control.host = control_host
    control.dataset, control.buffer = FakeActor(8, **CONTROL_ENDPOINTS), FakeActor(8, **CONTROL_ENDPOINTS)
    fleet.supervisor = Supervisor(recorder=fleet.recorder, hosts=hosts, groups=groups, failover=fleet.failover,
                                  placer=fleet.placer, trainer=trainer, control=control, waits=fleet.waits,
                                  state=fleet.state, reports=[])
    return fleet


class FakeMesh:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> Any:
        self.stopped = True
        return self

    def get(self, timeout: float | None = None) -> None:
        return None


class FakeGroup(ReplicaGroup):
    """A replica group whose spawns are plain objects."""

    def __init__(self, role: str, count: int, *, setup_timeout_s: float = FailoverConfig().setup_timeout_s):
        super().__init__(role, spawn_actor=lambda procs, name: None, threads=1, routing="round_robin",
                         setup_timeout_s=setup_timeout_s)
        self.service = Service([self._fake(i, "a") for i in range(count)], routing="round_robin")

    def _fake(self, index: int, host: str) -> Replica:
        self.incarnations += 1
        return Replica(self.role, index, host, self.incarnations, f"{self.role}_{index}_{self.incarnations}", FakeMesh(), None,
                       pids=[])

    def spawn(self, index: int, host: str) -> Replica:
        return self._fake(index, host)

    def begin_replacement(self, index: int, host: str) -> tuple[Replica, Any]:
        """A replacement whose model has loaded by the time it is looked at."""
        replica = self._fake(index, host)
        self.replacing.append(replica)
        return replica, Loaded()


class Loaded:
    """A pid future that has answered."""

    def get(self, timeout: float | None = None) -> int:
        return 4241


class Loading:
    """A spare's pid future: not ready until `loaded`, or failing when `error` is set."""

    def __init__(self) -> None:
        self.loaded = False
        self.error: Exception | None = None

    def get(self, timeout: float | None = None) -> int:
        if self.error is not None:
            raise self.error
        if not self.loaded:
            time.sleep(min(timeout or 0, 0.01))
            raise TimeoutError
        return 4242


class SpareGroup(FakeGroup):
    """A fake group whose new replicas (spares included) load until the test says they are loaded."""

    def __init__(self, role: str, count: int, *, spares: int = 0, setup_timeout_s: float = FailoverConfig().setup_timeout_s):
        super().__init__(role, count, setup_timeout_s=setup_timeout_s)
        self.spares = spares
        self.loads: list[Loading] = []

    def _start(self, index: int, host: str, name: str) -> Replica:
        loading = Loading()
        self.loads.append(loading)
        actor = type("Actor", (), {"pid": type("Endpoint", (), {"call_one": staticmethod(lambda: loading)})()})()
        return Replica(self.role, index, host, self.incarnations, name, FakeMesh(), actor)


class StartingGroup(SpareGroup):
    """A fake group whose replacements start as real ones do (`ReplicaGroup.spawn`), each loading until the test
    says (`loads`); `fates` makes the next starts fail ("dies") or never end ("hangs")."""

    spawn = ReplicaGroup.spawn
    begin_replacement = ReplicaGroup.begin_replacement

    def __init__(self, role: str, count: int, *, setup_timeout_s: float, fates: list[str]):
        super().__init__(role, count, setup_timeout_s=setup_timeout_s)
        self.fates = fates
        self.spawned: list[Replica] = []

    def _start(self, index: int, host: str, name: str) -> Replica:
        replica = super()._start(index, host, name)
        fate = self.fates.pop(0) if self.fates else "loads"
        self.loads[-1].loaded = fate == "loads"
        self.loads[-1].error = RuntimeError("CUDA error: out of memory") if fate == "dies" else None
        if fate == "unsendable":  # the pid call itself raises: Monarch could not send it to the new actor
            def unsendable() -> None:
                raise RuntimeError("the actor's mailbox is closed")
            replica.actor = type("Actor", (), {"pid": type("Endpoint", (), {"call_one": staticmethod(unsendable)})()})()
        self.spawned.append(replica)
        return replica


NOT_STARTED = {"hangs": ("did not start within 0.3 s (failover.setup_timeout_s)", True),
               "dies": ("did not start: RuntimeError: CUDA error: out of memory", False)}
