"""The control proc: the dataset and replay buffer actors of a Monarch GRPO run, on the first of
`placement.replay_buffer.hosts` still there (on this machine when none are named). When it or its host is lost, its
calls fail with ControlLost and the run goes back to the last checkpoint with a new one (`recovery.py`)."""

from __future__ import annotations

import time
from typing import Any

from workers.engine.actors.calls import CallFailed, ProcFailure
from workers.engine.actors.dataset import DatasetActor
from workers.engine.actors.hosts import Hosts
from workers.engine.actors.mesh_stops import MeshStops, stop_quietly
from workers.engine.actors.procs import spawn_procs
from workers.engine.actors.replay_buffer import ReplayBufferActor
from workers.engine.config import RunConfig
from workers.engine.controller.incidents import Noticed
from workers.engine.controller.state import RunState
from workers.engine.controller.waits import Waits
from workers.engine.metrics import Recorder


class ControlLost(Exception):
    """The control proc died or its host was lost."""


class ControlProcs:
    def __init__(self, *, config: RunConfig, hosts: Hosts, waits: Waits, recorder: Recorder, state: RunState):
        self.config, self.hosts, self.waits, self.recorder, self.state = config, hosts, waits, recorder, state
        self.host: str | None = None
        self.procs: Any = None
        self.dataset: Any = None
        self.buffer: Any = None
        self.meshes: list[Any] = []  # every control proc started, stopped at the end
        self.noticed: Noticed | None = None  # a failure seen, not yet recovered from

    def start(self) -> None:
        cfg = self.config
        named = list(cfg.placement.replay_buffer.hosts)
        candidates = self.hosts.alive(named) if named else [None]
        if not candidates:
            raise ProcFailure(f"the dataset and replay buffer have no host left: {', '.join(named)} "
                              f"(placement.replay_buffer.hosts) are lost")
        host = candidates[0]
        threads = cfg.trainer.threads_per_process
        procs = self.hosts.spawn_procs(host=host, count=1, threads=threads) if host else spawn_procs(1, threads=threads)
        self.meshes.append(procs)
        max_age = cfg.grpo.max_policy_age if cfg.grpo.mode == "async" else 0
        capacity = max(cfg.replay_buffer.capacity, cfg.trainer.batch_size * cfg.grpo.group_size)
        self.host, self.procs = host, procs
        self.dataset = procs.spawn("dataset", DatasetActor, cfg)
        self.buffer = procs.spawn("replay_buffer", ReplayBufferActor, capacity, max_age)

    def gone(self) -> str | None:
        if self.host in self.hosts.lost:
            return f"host {self.hosts.describe(self.host)} of the dataset and replay buffer was lost"
        return None

    def call(self, future: Any) -> Any:
        """The dataset's or replay buffer's answer; ControlLost when their proc or host is gone."""
        try:
            return self.waits.wait(future, gone=self.gone)
        except CallFailed as failure:
            self.detect(failure.reason)
            raise ControlLost(failure.reason) from None

    def answers(self) -> bool:
        """Whether dataset and buffer still answer (after a failure report nothing else explains)."""
        try:
            self.buffer.stats.call_one().get(timeout=30)
            self.dataset.state_dict.call_one().get(timeout=30)
            return True
        except Exception:  # noqa: BLE001 - the control proc is the one that failed
            return False

    def detect(self, reason: str) -> None:
        """The failure_detected event, once per failure."""
        if self.noticed is None:
            self.recorder.event("failure_detected", step=self.state.step + 1, role="replay_buffer", replica=None,
                                host=self.host, fault_id=None, reason=reason, hung=False, time_to_detect_s=None)
            self.noticed = Noticed(time.monotonic(), reason)

    def replace(self) -> Noticed:
        """A new control proc, on another host if its host was lost; the failure it recovers from."""
        self.detect(self.gone() or "the control proc failed")
        noticed = self.noticed
        totals, limit = self.state.totals, self.config.failover.max_replacements
        totals.control_recoveries += 1
        if totals.control_recoveries > limit:
            raise ProcFailure(f"the dataset and replay buffer failed {totals.control_recoveries} times "
                              f"(failover.max_replacements {limit})")
        if self.host not in self.hosts.lost:
            stop_quietly(self.procs)
        self.start()
        self.recorder.event("replica_replaced", step=self.state.step, role="replay_buffer", replica=None,
                            host=self.host or "local", pids=[], seconds=round(time.monotonic() - noticed.detected_at, 3))
        self.noticed = None
        return noticed

    def stop_all(self, *, stops: MeshStops) -> None:
        """Start stopping every control proc started (`stops.wait()` waits)."""
        for mesh in self.meshes:
            stops.add(mesh)
