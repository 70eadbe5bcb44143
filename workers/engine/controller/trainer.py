"""The trainer's mesh as the controller sees it: `trainer.ranks` procs, `ranks_per_host` to a host, data parallel
(GRPO's `actors/trainer.py` or SFT's `actors/sft_trainer.py`).
Its calls fail with TrainerLost; the step loop then restores it from the last checkpoint (`recovery.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from monarch.spmd import setup_torch_elastic_env

from workers.engine.actors.calls import CallFailed, answered, call_failed, exited, refusal_ends_run
from workers.engine.actors.hosts import Hosts
from workers.engine.actors.mesh_stops import MeshStops, stop_quietly
from workers.engine.actors.replica_group import Replica, spawned_name
from workers.engine.actors.trainer_rank import TrainerRankActor
from workers.engine.actors.weight_inbox import Fetched, Unread
from workers.engine.actors.weight_outbox import WeightPublication
from workers.engine.config import RunConfig
from workers.engine.controller.incidents import Noticed, RecoveryLog
from workers.engine.controller.placement import Placer
from workers.engine.controller.state import RunState
from workers.engine.controller.waits import Waits
from workers.engine.metrics import Recorder


class TrainerLost(Exception):
    """A trainer call failed (a proc died or hangs, or its host was lost)."""

    def __init__(self, failure: CallFailed):
        super().__init__(str(failure))
        self.failure = failure


class PendingFetches:
    """The inboxes' reads of the publication the ranks hold. Before the ranks stage the next one (in its place) the
    controller waits for these; in the steady state they ended while the step trained."""

    def __init__(self) -> None:
        self.pending: list[tuple[Replica, int, Any]] = []  # (generator replica, publication, its inbox's fetch call)
        self.abandoned: list[tuple[Replica, int]] = []  # reads of a stopped mesh's memory: they never arrive
        self.settled: list[Fetched] = []  # reads that ended since the step's metrics last took them (`figures`)

    def add(self, replica: Replica, publication: int, fetch: Any) -> None:
        self.pending.append((replica, publication, fetch))

    def reading(self, replica: Replica, publication: int) -> Any | None:
        """`replica`'s inbox's fetch call of `publication`, when it was not settled yet."""
        return next((fetch for r, p, fetch in self.pending if r is replica and p == publication), None)

    def was_abandoned(self, replica: Replica, publication: int) -> bool:
        return any(r is replica and p == publication for r, p in self.abandoned)

    def abandon(self, *, waits: Waits) -> None:
        """The ranks these reads read from are stopped or dead: a read that did not end waits for its timeout, and a
        request naming its publication with it. Each inbox is told that the publication will not arrive (one it holds
        already is kept), so such requests fail at once."""
        for replica, publication, _ in self.pending:
            try:
                waits.wait(replica.inbox.abandon.call_one(publication), gone=lambda replica=replica: (
                    f"generator replica {replica.index} failed" if replica.failed else None))
            except CallFailed:
                pass  # its proc is gone: the supervisor replaces it
            self.abandoned.append((replica, publication))
        self.pending.clear()

    def settle(self, *, waits: Waits, ranks_gone: Callable[[], str | None]) -> bool:
        """Wait for every pending read, or until the supervisor has marked its replica failed (replacing it is the
        supervisor's) or `ranks_gone` says why the ranks read from are lost; whether every read ended (a hung one may
        still be reading: the ranks must not write over what it reads; one that gave up, `Unread`, counts as not
        ended). The reads that ended go to the step's metrics (`figures`). Reads of lost ranks stay pending: the
        relaunch abandons them."""
        reads: list[Fetched] = []
        unended, gave_up = [], False
        for replica, publication, fetch in self.pending:
            try:
                read = waits.wait(fetch, gone=lambda replica=replica: ranks_gone() or (
                    f"generator replica {replica.index} failed" if replica.failed else None))
            except CallFailed:
                unended.append((replica, publication, fetch))
                continue
            if isinstance(read, Unread):
                gave_up = True
            else:
                reads.append(read)
        ended = not unended and not gave_up
        self.pending = unended if ranks_gone() is not None else []
        self.settled.extend(reads)
        return ended

    def figures(self) -> dict[str, float]:
        """The reads that ended since the last call, for the step's metrics: `weights/read_s` (the slowest) and
        `weights/read_bytes` (one replica's); none when none ended. Once per step: a step settles reads more than once
        (its own publication's, a replacement's catch-up), and a metric has one value per step."""
        reads, self.settled = self.settled, []
        if not reads:
            return {}
        return {"weights/read_s": max(r.seconds for r in reads), "weights/read_bytes": float(reads[-1].nbytes)}


class TrainerHandle:
    def __init__(self, *, config: RunConfig, actor: type[TrainerRankActor], hosts: Hosts, placer: Placer, waits: Waits,
                 recorder: Recorder, log: RecoveryLog, state: RunState):
        self.config, self.actor, self.hosts, self.placer, self.waits = config, actor, hosts, placer, waits
        self.recorder, self.log, self.state = recorder, log, state
        self.procs: Any = None
        self.actors: Any = None
        self.pids: list[int] = []  # by rank
        self.n_params = 0
        self.master_addr: str | None = None
        self.noticed: Noticed | None = None  # a failure seen, not yet recovered from
        self.reported: str | None = None  # Monarch reported a rank of this mesh failed: why
        self.lost_in_command: CallFailed | None = None  # a call of an operator's command found this mesh lost (`lost`)
        self.running = False  # spawned and not stopped: a failure report can be this mesh's
        self._spawned_name: str | None = None  # Monarch's name of this mesh's spawn (read at the first report)
        self._setup: Any = None  # every rank's pending setup
        self._asked_pids: Any = None  # every rank's pid, asked before the setup (answered before it begins)
        self._setup_by = 0.0  # when that setup counts as hung (monotonic; failover.setup_timeout_s after the launch)
        self.fetches = PendingFetches()

    # --- start ------------------------------------------------------------------------
    def launch(self) -> None:
        """Spawn the procs on the first of the trainer's hosts still there; the model loads while the caller goes on.
        HostsUnreachable when a host died meanwhile; TrainerLost when a new proc fails as torch elastic's environment is
        set (`await_started`). Reads of an earlier mesh's publication are abandoned."""
        placer, cfg = self.placer, self.config
        self._setup_by = time.monotonic() + cfg.failover.setup_timeout_s
        self.fetches.abandon(waits=self.waits)
        placer.trainer_hosts = placer.place_trainer()
        self.hosts.release("trainer")
        procs = self.hosts.spawn_across(hosts=placer.trainer_hosts, per_host=placer.ranks_per_host,
                                        threads=cfg.trainer.threads_per_process,
                                        gpus_per_proc=cfg.placement.trainer.gpus_per_proc, owner="trainer")
        self.procs = procs
        # this mesh's once started (or its setup overdue): a relaunch that fails first kills none of an earlier mesh's
        self.pids = []
        try:
            setup_torch_elastic_env(procs)
        except Exception as error:  # noqa: BLE001 - a supervision error, a proc's: the new mesh failed
            raise TrainerLost(_not_started(call_failed(error))) from None
        self.actors = procs.spawn("trainer", self.actor, cfg)
        self.reported, self.lost_in_command, self._spawned_name, self.running = None, None, None, True
        # Over several hosts, rank 0's host by the address its worker has (a pod IP, a node name).
        master = self.hosts.workers[placer.trainer_hosts[0]].host if len(placer.trainer_hosts) > 1 else None
        self._asked_pids = self.actors.pids.call()  # before the setup: a hung setup's procs are known, to be killed
        self._setup = self.actors.setup.call(master)

    def await_started(self, *, wait_s: float | None = None) -> bool:
        """Wait (up to `wait_s`; None: until it ends) for every rank's setup; whether it has ended. TrainerLost when a
        rank fails as it starts, or its host is lost or Monarch reports it failed, or (hung) when the setup has not
        ended within `failover.setup_timeout_s` of the launch: in a recovery one more failure, at the run's start the
        run's end. Its own bound, not the call timeout: loading a model may take longer than any call."""
        if wait_s is not None and wait_s < self._setup_left_s():
            try:
                if not answered(self._setup, wait_s):
                    return False
            except Exception as error:  # noqa: BLE001 - answered() raises what the setup raised
                self._refused(call_failed(error), what="the trainer did not start")
                raise TrainerLost(_not_started(call_failed(error))) from None
        try:  # what the waits' ticks raise is not the setup's (a spare's refused model folder ends the run as itself)
            setup = self.waits.wait(self._setup, gone=self.gone, timeout_s=self._setup_left_s())
            pids = self.waits.wait(self._asked_pids, gone=self.gone, timeout_s=self._setup_left_s())
        except CallFailed as failure:
            self._refused(failure, what="the trainer did not start")
            raise TrainerLost(self._setup_overdue() if failure.hung else _not_started(failure)) from None
        rank0 = list(setup.values())[0]
        self.n_params, self.master_addr = rank0["n_params"], rank0["master_addr"]
        self.pids = list(pids.values())
        return True

    def _setup_left_s(self) -> float:
        return max(0.0, self._setup_by - time.monotonic())

    def _setup_overdue(self) -> CallFailed:
        """The setup's failure once failover.setup_timeout_s is past. Its ranks' pids are this mesh's (answered unless a
        proc hung before its setup began): the recovery kills those, none of an earlier mesh's."""
        try:
            if answered(self._asked_pids, self.config.failover.poll_seconds):
                self.pids = list(self._asked_pids.get().values())
        except Exception:  # noqa: BLE001 - the pids call failed: no pid known, none killed (the mesh is stopped)
            pass
        return CallFailed(f"the trainer did not start within {self.config.failover.setup_timeout_s:g} s "
                          "(failover.setup_timeout_s)", hung=True)

    def rank(self, rank: int) -> Any:
        """One rank's actor."""
        if self.placer.trainer_host_count > 1:
            per_host = self.placer.ranks_per_host
            return self.actors.slice(hosts=rank // per_host, procs=rank % per_host)
        return self.actors.slice(procs=rank)

    # --- failures ---------------------------------------------------------------------
    def lost_host(self) -> str | None:
        return next((h for h in self.placer.trainer_hosts if h in self.hosts.lost), None)

    def known_lost(self) -> CallFailed | None:
        """What the ranks are known lost with (a lost host, a failure report, an operator's command's call, as that call
        failed: hung or not), or None."""
        if (lost := self.lost_host()) is not None:
            return CallFailed(f"host {self.hosts.describe(lost)} of the trainer was lost", hung=False)
        if self.reported is not None:
            return CallFailed(self.reported, hung=False)
        return self.lost_in_command

    def gone(self) -> str | None:
        """Why the ranks are known lost (`known_lost`), or None: for waits on them (`wait_for`'s `gone`)."""
        return failure.reason if (failure := self.known_lost()) is not None else None

    def owns(self, mesh_name: str) -> bool:
        """Whether a failure report's mesh is this spawn of the trainer (a late report from a mesh stopped before the
        last relaunch is not)."""
        if not self.running:
            return False
        if self._spawned_name is None:
            self._spawned_name = spawned_name(self.actors) or ""
        if self._spawned_name:
            return mesh_name == self._spawned_name
        return mesh_name.rsplit("-", 1)[0] == "trainer"  # a name Monarch did not give

    def report_failed(self, report: str) -> None:
        """Monarch reported that a rank of this mesh failed. On workers whose pids the controller cannot see, nothing
        else shows a dead rank on a host still up: the trainer's calls, and the generators' reads of its weights, fail
        now as the trainer's (not a generator's after failover.call_timeout_s)."""
        if self.reported is None:
            self.reported = CallFailed(f"a trainer process failed: {report}", hung=False).reason
            self.detect(CallFailed(self.reported, hung=False))

    def lost(self, failure: CallFailed) -> None:
        """A trainer call of an operator's command failed (TrainerLost), between steps: noticed now, and the step loop's
        next check (or trainer call) fails with it at once and recovers the trainer, hung ranks killed as in a step."""
        self.detect(failure)
        if self.lost_in_command is None:
            self.lost_in_command = failure

    def exited_pid(self) -> int | None:
        """A rank that exited, when the trainer's pids are this machine's (so /proc shows it)."""
        if not all(self.hosts.pids_visible(h) for h in self.placer.trainer_hosts):
            return None
        return next((pid for pid in self.pids if exited(pid)), None)

    def failure(self) -> CallFailed | None:
        """A lost host, a failure report, an operator's command's failed call or an exited rank, seen without calling
        the trainer."""
        if (failure := self.known_lost()) is not None:
            return failure
        if (pid := self.exited_pid()) is not None:
            return CallFailed(f"trainer process {pid} exited", hung=False)
        return None

    def check(self) -> None:
        """Between train steps: a failure is a TrainerLost now, not after the next call times out."""
        if (failure := self.failure()) is not None:
            raise TrainerLost(failure)

    def train_tick(self) -> None:
        """While a step trains: a rank that exited fails the step now (its peers would wait in the all-reduce)."""
        self.waits.tick()
        if (failure := self.failure()) is not None:
            raise failure

    def detect(self, failure: CallFailed) -> Noticed:
        """The failure_detected event, once per failure."""
        if self.noticed is None:
            noticed = self.noticed = self.log.notice("trainer", failure.reason)
            fault = noticed.fault
            self.recorder.event("failure_detected", step=self.state.step + 1, role="trainer",
                                replica=fault.replica if fault else None,
                                host=self.lost_host() or self.placer.trainer_hosts[0],
                                fault_id=fault.id if fault else None, reason=failure.reason, hung=failure.hung,
                                time_to_detect_s=noticed.time_to_detect_s)
        return self.noticed

    def kill_procs(self) -> None:
        for host in self.placer.trainer_hosts:
            self.hosts.kill(host, [pid for rank, pid in enumerate(self.pids) if self.placer.rank_host(rank) == host])

    def stop(self, *, stops: MeshStops | None = None) -> None:
        """Stop the ranks' procs (with `stops`: start stopping them, `stops.wait()` waits). Their failure reports are
        not the next mesh's failures."""
        self.running = False
        if self.procs is not None and not self.lost_host():  # stopping a mesh on a lost host would wait for it
            if stops is None:
                stop_quietly(self.procs)
            else:
                stops.add(self.procs, pids=self.pids if self.hosts.procs_are_children else [])

    def await_read(self, replica: Replica, publication: int) -> None:
        """Wait for `replica`'s inbox to read `publication` from the ranks, when it still does: a request naming it
        waits for that read anyway, and a rank that dies meanwhile leaves it waiting for weights that never come.
        TrainerLost then, noticed at once, not a generator hung at `failover.call_timeout_s`; and TrainerLost (hung)
        when the inbox answers that the read gave up (`Unread`, after `failover.weight_read_s`, within the call
        timeout): ranks that are stopped, or dead on a host still up, do not serve it. A read that fails or hangs
        otherwise (its replica's proc) is the request's to report."""
        fetch = self.fetches.reading(replica, publication)
        if fetch is None:
            return
        try:
            read = self.waits.wait(fetch, gone=lambda: self._read_lost(replica))
        except CallFailed:
            read = None  # the replica's own failure, unless the trainer's explains it
        if (failure := self.failure()) is not None and not isinstance(read, Fetched):
            raise TrainerLost(failure)
        if isinstance(read, Unread) and not replica.failed:
            raise TrainerLost(CallFailed(f"the trainer ranks did not serve generator replica {replica.index}'s read of "
                                         f"weight publication {publication}: {read.why}", hung=True))

    def _read_lost(self, replica: Replica) -> str | None:
        """Why `replica`'s read of the ranks' weights will not end, or None."""
        if (failure := self.failure()) is not None:
            return failure.reason
        return f"generator replica {replica.index} failed" if replica.failed else None

    # --- calls ------------------------------------------------------------------------
    def result(self, future: Any, *, failing: str = "") -> Any:
        """The ranks' answer; TrainerLost when one fails or hangs (its reason after `failing`, what did not happen), or
        the ConfigError of a file a rank refused (`_refused`)."""
        try:
            return self.waits.wait(future, gone=self.gone)
        except CallFailed as failure:
            self._refused(failure, what=failing or "a trainer call")
            raise TrainerLost(CallFailed(f"{failing}: {failure}", hung=failure.hung) if failing else failure) from None

    def from_rank0(self, endpoint: str, *args: Any) -> Any:
        """Rank 0's answer. Every rank of a sharded (FSDP) trainer takes part: its weights are gathered from all."""
        if self.config.trainer.sharding == "fsdp":
            return list(self.result(getattr(self.actors, endpoint).call(*args)).values())[0]
        return self.result(getattr(self.rank(0), endpoint).call_one(*args))

    def every_rank(self, call: Callable[[], Any], *, what: str, sent: Any = None) -> list[Any]:
        """Every rank's answer to `call` (or to `sent`, the same call made already). A raise drill refuses the call on
        every rank before any collective: it is made again once."""
        try:
            return list(self.waits.wait(sent if sent is not None else call(), tick=self.train_tick).values())
        except CallFailed as failure:
            if failure.hung or "InjectedFault" not in str(failure):
                raise TrainerLost(failure) from None
        noticed = self.log.notice("trainer", f"{what} raised")
        fault = noticed.fault
        self.recorder.event("failure_detected", step=self.state.step + 1, role="trainer",
                            replica=fault.replica if fault else None, fault_id=fault.id if fault else None,
                            reason=f"{what} raised", hung=False, time_to_detect_s=noticed.time_to_detect_s)
        try:
            results = list(self.waits.wait(call()).values())
        except CallFailed as failure:
            raise TrainerLost(failure) from None
        self.log.recovered("trainer", noticed, at_step=self.state.step + 1, action="retried")
        return results

    def send_train_step(self, record: Any, ref_logprobs: Any) -> Any:
        """Every rank's train step on `record`, sent (its answers are `train_step`'s)."""
        return self.actors.train_step.call(record, ref_logprobs, self.state.policy_version)

    def train_step(self, record: Any, ref_logprobs: Any, *, sent: Any = None) -> list[dict[str, Any]]:
        """Every rank's results of a train step on `record` (`sent`: `send_train_step`'s call, made already)."""
        return self.every_rank(lambda: self.send_train_step(record, ref_logprobs), what="a train step", sent=sent)

    def sft_step(self, batch: Any) -> list[dict[str, Any]]:
        return self.every_rank(lambda: self.actors.sft_step.call(batch), what="an SFT step")

    def state_dict(self) -> Any:
        return self.from_rank0("state_dict")

    def publish_weights(self, replicas: list[Replica], publication: int) -> None:
        """Every rank stages its part of the current weights as `publication`, then each generator replica's inbox
        reads the parts straight from the ranks (`actors/weight_outbox.py`); only the staging is waited for."""
        every_read_ended = self.fetches.settle(waits=self.waits, ranks_gone=self.gone)
        staged = self.every_rank(lambda: self.actors.stage_weights.call(every_read_ended), what="a weight staging")
        sent = WeightPublication(number=publication, version=self.state.policy_version,
                                 parts=tuple(part for part in staged if part is not None),
                                 read_timeout_s=self.config.failover.weight_read_s)
        for replica in replicas:
            self.fetches.add(replica, publication, replica.inbox.fetch.call_one(sent))

    def save(self, step: int, progress: dict[str, Any]) -> Path:
        return Path(self.from_rank0("save", step, progress))

    def load(self, path: str) -> dict[str, Any]:
        """Every rank back to a checkpoint; the progress saved with it. TrainerLost when a rank fails or hangs meanwhile
        (within `failover.call_timeout_s`); the ConfigError of a checkpoint the ranks refuse (`_refused`)."""
        return list(self.result(self.actors.load.call(path), failing=f"the trainer did not load checkpoint {path}")
                    .values())[0]

    def _refused(self, failure: CallFailed, *, what: str) -> None:
        """A rank refused a file a field named (a model folder, a checkpoint): the run ends with that field's error, and
        no new mesh is tried (`refusal_ends_run`)."""
        if failure.refused:
            raise refusal_ends_run(failure.refused, recorder=self.recorder, step=self.state.step, what=what) from None

    def leave_group(self) -> None:
        """Every rank leaves its process group (before the mesh is stopped); TrainerLost when one fails or hangs."""
        self.result(self.actors.shutdown.call())

    def shutdown(self) -> None:
        """The run is over: the ranks leave their process group. One that fails or hangs meanwhile is recorded (the
        failure, and a message on the run page), not recovered: the last checkpoint is saved and the mesh is stopped."""
        try:
            self.leave_group()
        except TrainerLost as lost:
            self.lost_after_last_step(lost.failure, how="failed as it shut down")

    def lost_after_last_step(self, failure: CallFailed, *, how: str = "failed", unneeded: str = "") -> None:
        """The trainer failed once the run was over (its last checkpoint saved): recorded, with a message on the run
        page, not recovered. `unneeded`: what else of the run is given up with it."""
        self.detect(failure)
        self.recorder.event("message", step=self.state.step, text=(
            f"the trainer {how} after the run's last step ({self.state.step}): {failure.reason}; not recovered: the run "
            f"is over{unneeded}"))


def _not_started(failure: CallFailed) -> CallFailed:
    return CallFailed(f"the trainer did not start: {failure}", hung=failure.hung)
