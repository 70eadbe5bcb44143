"""GRPO on Monarch process meshes: the controller loop.

The same algorithm as `recipes/grpo.py`, with each role in its own processes:
  trainer    `trainer.ranks` procs on one host, data parallel (gloo on CPU, NCCL on GPUs)
  generator  `generator.replicas` procs, one mesh each, behind a routed Service (torch or vLLM),
             spread over `placement.generator.hosts`
  reward     one proc; reference (when enabled) one proc
  dataset, replay buffer   actors sharing one small "control" proc, on this machine unless
             `placement.replay_buffer.hosts` names a host

Hosts (`actors/hosts.py`) are the Monarch workers of the run's monarch.job (FORGEBOARD_MONARCH_JOB: a
SLURM or Kubernetes run), else those in FORGEBOARD_MONARCH_WORKERS (or `workers=`), attached once; a role's hosts are `placement.<role>.hosts`, or every host when none are named,
and a role placed on one host takes the first one still there. Without workers every host name
is a label on this machine's procs.

Each step, top to bottom:
  1. generate  launch generations until max_policy_age + 1 batches are buffered or in
               flight; each launch first syncs the newest weights to the generators
               (versioned, timed). Launched generations keep running on the generator
               procs while the trainer trains: that is the async overlap.
  2. reward    the oldest generation is awaited, scored by the reward actor, buffered.
  3. buffer    the trainer's batch comes out of the replay buffer within the age bound.
  4. reference (optional) reference log-probs for the KL penalty.
  5. drills    fault drills due now are injected (`drills.py`).
  6. train     every trainer rank takes its rows; gradients are summed across ranks.
  7. control   operator commands: pause, checkpoint, cancel, fault_drill, placement_change,
               load_redirect (`run_control.py`, `operations.py`).

Failures (`actors/fleet.py`): every wait polls each `failover.poll_seconds` and gives up after
`failover.call_timeout_s`. A generator, reward or reference replica that dies or hangs is
detected, its request is retried on a healthy replica, and it is replaced by a fresh proc
holding the current policy weights. A trainer proc that dies or hangs takes the trainer mesh
with it: the mesh is respawned and every stateful actor goes back to the last checkpoint, up
to `trainer.recover_failures` times. Each failure emits failure_detected, then recovered.
A host that stops accepting connections is lost with every proc on it: each replica there is
detected and replaced on the remaining hosts, a trainer there restores from the last checkpoint
on another of its hosts, and a lost control proc or host (dataset and replay buffer) is started
again on the next of `placement.replay_buffer.hosts` and every stateful actor goes back to the
last checkpoint (before the first checkpoint, the run fails: there is nothing to restore).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import workers.engine.actors  # noqa: F401 - sets monarch's supervision poll before monarch is imported
import monarch.actor  # noqa: I001
from monarch.spmd import setup_torch_elastic_env

from workers.engine.actors.dataset import DatasetActor
from workers.engine.actors.fleet import (CallFailed, Failover, Incident, ProcFailure, Replica, ReplicaGroup, exited,
                                         request_deadline, stop_quietly, wait_all, wait_for)
from workers.engine.actors.generator import GeneratorActor
from workers.engine.actors.hosts import Hosts, HostsUnreachable, Worker, check_placement, workers_from_env
from workers.engine.actors.monarch_job import job_kind
from workers.engine.actors.procs import spawn_procs
from workers.engine.actors.reference import ReferenceActor
from workers.engine.actors.replay_buffer import ReplayBufferActor
from workers.engine.actors.reward import RewardActor
from workers.engine.actors.trainer import TrainerActor
from workers.engine.config import RunConfig
from workers.engine.drills import SIGNAL_KINDS, DrillPlan, FaultInjector, FaultTarget
from workers.engine.metrics import Recorder
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.operations import (FaultDrillRequest, LoadRedirectRequest, Operation, PlacementChangeRequest,
                                       DrillSchedule)
from workers.engine.recipes.monarch_placement import Placer
from workers.engine.recipes.grpo import GrpoResult, check_prompt_lengths, rollout_metrics, update_metrics
from workers.engine.replay_buffer import concat_records
from workers.engine.run_control import RunControl
from workers.engine.sampler import SamplingParams
from workers.engine.startup import StartupPhases
from workers.engine.tasks import Problem
from workers.engine.training import EvalResult, PhaseTimer, mfu, train_tokens_per_second

__all__ = ["FaultDrill", "ProcFailure", "train_grpo_monarch"]
ARM_TIMEOUT_S = 10.0  # arming a fault waits for the target's current call to end
ATTACH_TIMEOUT_S = 60.0
HOST_SETTLE_S = 2.0  # a killed worker's port can accept connections a moment longer than its procs live


@dataclass(frozen=True)
class FaultDrill:
    """Kill one trainer proc right before the given step trains (shorthand for a FaultDrillRequest)."""

    step: int
    rank: int = 0

    def request(self) -> FaultDrillRequest:
        return FaultDrillRequest(kind="kill", role="trainer", replica=self.rank, schedule=DrillSchedule(at_step=self.step))


class ControlLost(Exception):
    """The control proc (dataset and replay buffer) died or its host was lost: the loop goes back to the last
    checkpoint with a new control proc."""


class TrainerLost(Exception):
    """A trainer call other than the train step failed: the loop restores the trainer as after a failed step."""

    def __init__(self, failure: CallFailed):
        super().__init__(str(failure))
        self.failure = failure


@dataclass
class Request:
    """One call routed to a replica of a group; retried elsewhere when it fails."""

    group: ReplicaGroup
    call: Callable[[Any], Any]  # actor -> future
    key: str | None
    replica: Replica
    index: int
    future: Any
    sent_at: float
    attempts: int = 0
    incident: Incident | None = None


@dataclass
class PendingGeneration:
    problems: list[Problem]
    prompts: list[list[int]]
    calls: list[Request]  # in prompt order
    data_state: dict[str, Any]  # the dataset's position before these problems were taken
    generation: int  # index of this generation (its sampling seeds derive from it)
    spans: list[tuple[int, int]]  # the problems [first, last) each call generates


def train_grpo_monarch(config: RunConfig, recorder: Recorder, *, control: RunControl | None = None,
                       drills: Sequence[FaultDrill | FaultDrillRequest] = (),
                       workers: Sequence[Worker] | None = None) -> GrpoResult:
    """`workers`: the Monarch workers to place procs on; None: those of the run's monarch.job (FORGEBOARD_MONARCH_JOB),
    else those in FORGEBOARD_MONARCH_WORKERS."""
    startup = StartupPhases(recorder)
    startup.enter("placing", "placing roles on hosts")
    from_job = job_kind() if workers is None else None
    workers = [] if from_job else workers_from_env() if workers is None else list(workers)
    check_placement(config.placement, workers=workers)  # a job's workers are known once attached
    cfg, trainer_cfg, grpo, failover_cfg = config, config.trainer, config.grpo, config.failover
    threads = trainer_cfg.threads_per_process
    # A proc that dies must not kill this controller (monarch's default exits the client):
    # remember the report; `scan_supervision` decides what it means.
    supervision_reports: list[Any] = []
    monarch.actor.unhandled_fault_hook = supervision_reports.append

    device = trainer_cfg.device if trainer_cfg.device != "auto" else "cpu"
    hosts = Hosts()
    injector = FaultInjector(recorder, measure=lambda role, replica: measure_replica(groups, role, replica))
    plan = DrillPlan([*cfg.drills, *(d.request() if isinstance(d, FaultDrill) else d for d in drills)])
    groups: dict[str, ReplicaGroup] = {}
    meshes: list[Any] = []
    trainer_procs: Any = None
    try:
        # --- setup: hosts, process meshes and actors -----------------------------------
        setup_start = time.perf_counter()
        if from_job:
            hosts = Hosts.from_job(kind=from_job, timeout_s=ATTACH_TIMEOUT_S)
            check_placement(cfg.placement, workers=list(hosts.workers.values()))
        else:
            hosts = Hosts.attach(workers=workers, timeout_s=ATTACH_TIMEOUT_S)
        if hosts.workers:
            of_job = f"of the {from_job} job " if from_job else ""
            recorder.event("message", step=0, text=f"attached to {len(hosts.workers)} Monarch workers {of_job}"
                           f"({', '.join(hosts.describe(n) for n in hosts.names)}) in {hosts.attach_seconds} s")

        # the trainer's ranks: procs_per_host to a host (with workers), over as many hosts as that takes
        ranks_per_host = (cfg.placement.trainer.procs_per_host or trainer_cfg.ranks) if hosts.workers else trainer_cfg.ranks
        placer = Placer(placement=cfg.placement, hosts=hosts, device=device, trainer_ranks=trainer_cfg.ranks,
                        ranks_per_host=ranks_per_host, groups=groups)
        generator_hosts = placer.role_hosts("generator")
        trainer_pids: list[int] = []
        trainer_host_count = placer.trainer_host_count

        def trainer_rank(actors: Any, rank: int) -> Any:
            if trainer_host_count > 1:
                return actors.slice(hosts=rank // ranks_per_host, procs=rank % ranks_per_host)
            return actors.slice(procs=rank)

        def trainer_pids_visible() -> bool:
            """Whether the trainer's pids are this machine's, so that /proc shows when they exit."""
            return all(hosts.pids_visible(h) for h in placer.trainer_hosts)

        def trainer_lost_host() -> str | None:
            return next((h for h in placer.trainer_hosts if h in hosts.lost), None)

        def start_trainer() -> tuple[Any, Any, dict[str, Any]]:
            """(procs, actors, what rank 0's setup said: its n_params and the group's MASTER_ADDR)."""
            return trainer_started(*launch_trainer())

        def launch_trainer() -> tuple[Any, Any, Any]:
            """(procs, actors, every rank's pending setup): the trainer's procs spawned, its model loading."""
            procs = None
            while procs is None:
                placer.trainer_hosts = placer.place_trainer()
                hosts.release("trainer")
                try:
                    procs = hosts.spawn_across(hosts=placer.trainer_hosts, per_host=ranks_per_host, threads=threads,
                                               gpus_per_proc=cfg.placement.trainer.gpus_per_proc, owner="trainer")
                except HostsUnreachable:
                    if not groups:
                        raise  # while the run starts: it fails, naming the host
                    check_hosts(now=True)  # it died meanwhile: the probe finds it lost now
            setup_torch_elastic_env(procs)
            actors = procs.spawn("trainer", TrainerActor, cfg)
            # Over several hosts, rank 0's host by the address its worker has (a pod IP, a node name).
            master = hosts.workers[placer.trainer_hosts[0]].host if len(placer.trainer_hosts) > 1 else None
            return procs, actors, actors.setup.call(master)

        def trainer_started(procs: Any, actors: Any, setup: Any) -> tuple[Any, Any, dict[str, Any]]:
            info = list(setup.get().values())
            trainer_pids[:] = list(actors.pids.call().get().values())
            return procs, actors, info[0]

        if cfg.generator.backend == "vllm":
            from workers.engine.actors.vllm_generator import VllmGeneratorActor, vllm_proc_env

            vllm_proc_env()
            max_len = cfg.data.max_prompt_tokens + cfg.generator.max_new_tokens

            def spawn_generator(procs: Any, name: str) -> Any:
                return procs.spawn(name, VllmGeneratorActor, cfg.model.path, cfg.model.dtype, max_len, trainer_cfg.seed)
        else:
            def spawn_generator(procs: Any, name: str) -> Any:
                return procs.spawn(name, GeneratorActor, cfg.model.path, cfg.model.dtype, placer.role_device("generator"))

        spares = failover_cfg.warm_spares
        # Every proc is spawned before any is waited for: their imports and model loads overlap.
        placer.trainer_hosts = placer.place_trainer()
        first_generators = placer.layout("generator", cfg.generator.replicas)
        scorers = ("reward", "reference") if cfg.reference.enabled else ("reward",)
        used = {*placer.trainer_hosts, *first_generators, *cfg.placement.replay_buffer.hosts[:1],
                *(h for role in scorers if getattr(cfg.placement, role).colocate_with is None for h in placer.layout(role, 1))}
        procs_count = trainer_cfg.ranks + cfg.generator.replicas + len(scorers) + 1 + spares * (1 + len(scorers))
        where = ("1 host" if len(used) == 1 else f"{len(used)} hosts") if hosts.workers else "this machine"
        startup.enter("spawning_procs", f"spawning {procs_count} procs on {where}")  # the control proc and spares too
        trainer_launch = launch_trainer()
        trainer_procs = trainer_launch[0]

        def placed(role: str) -> dict[str, Any]:
            rule = getattr(cfg.placement, role)
            return {"gpus_per_proc": rule.gpus_per_proc, "per_host": rule.procs_per_host}

        generators = groups["generator"] = ReplicaGroup("generator", spawn_actor=spawn_generator, hosts=hosts,
                                                        threads=threads, routing=cfg.generator.routing, spares=spares,
                                                        **placed("generator"))
        generators.launch(first_generators)
        groups["reward"] = ReplicaGroup("reward", hosts=hosts, threads=threads, routing="round_robin", spares=spares,
                                        spawn_actor=lambda procs, name: procs.spawn(
                                            name, RewardActor, cfg.model.path, list(cfg.reward.functions), cfg.reward.weights),
                                        **placed("reward"))
        groups["reward"].launch(placer.layout("reward", 1))
        if cfg.reference.enabled:
            groups["reference"] = ReplicaGroup("reference", hosts=hosts, threads=threads, routing="round_robin",
                                               spares=spares, spawn_actor=lambda procs, name: procs.spawn(
                                                   name, ReferenceActor, cfg.model.path, cfg.model.dtype,
                                                   placer.role_device("reference")), **placed("reference"))
            groups["reference"].launch(placer.layout("reference", 1))

        max_age = grpo.max_policy_age if grpo.mode == "async" else 0

        def start_control() -> tuple[str | None, Any, Any, Any]:
            """The control proc and its dataset and replay buffer actors: on the first of placement.replay_buffer.hosts
            still there, or on this machine when none are named. (host, procs, dataset, buffer)"""
            named = list(cfg.placement.replay_buffer.hosts)
            candidates = hosts.alive(named) if named else [None]
            if not candidates:
                raise ProcFailure(f"the dataset and replay buffer have no host left: {', '.join(named)} "
                                  f"(placement.replay_buffer.hosts) are lost")
            host = candidates[0]
            procs = hosts.spawn_procs(host=host, count=1, threads=threads) if host else spawn_procs(1, threads=threads)
            meshes.append(procs)
            return (host, procs, procs.spawn("dataset", DatasetActor, cfg),
                    procs.spawn("replay_buffer", ReplayBufferActor,
                                max(cfg.replay_buffer.capacity, trainer_cfg.batch_size * grpo.group_size), max_age))

        def spare_host(role: str) -> str | None:
            """Where a role's spares start: its first host that is up, not drained and has room for them."""
            alive = [h for h in hosts.alive(placer.role_hosts(role)) if groups[role].has_room(h)]
            return next((h for h in alive if h not in drained), alive[0] if alive else None)

        def warm_spares() -> None:
            for group in groups.values():
                host = spare_host(group.role)
                if host is not None and (started := group.warm(host)):
                    recorder.event("spares_started", step=step, role=group.role, host=host, count=started)

        def poll_spares(wait_s: float = 0.001) -> None:
            for group in groups.values():
                for spare in group.poll_spares(wait_s=wait_s):
                    recorder.event("spare_ready", step=step, role=group.role, host=spare.host, pids=spare.pids)

        step = 0
        drained: set[str] = set()
        control_host, control_procs, dataset, buffer = start_control()
        warm_spares()
        startup.enter("loading_model", "loading the model" + (" (vLLM compiles on its first generation)"
                                                              if cfg.generator.backend == "vllm" else ""))
        trainer_procs, trainer, trainer_setup = trainer_started(*trainer_launch)
        n_params = trainer_setup["n_params"]
        trainer0 = trainer_rank(trainer, 0)
        for group in groups.values():
            group.await_started()
        held_out = dataset.held_out.call_one().get()
        recorder.event("dataset", step=0, **dataset.summary.call_one().get())
        tokenizer = ChatTokenizer(cfg.model.path)
        while any(group.warming for group in groups.values()):  # the run starts with its spares ready
            poll_spares(wait_s=1.0)
        recorder.event("meshes_ready", step=0, seconds=round(time.perf_counter() - setup_start, 2),
                       trainer_ranks=trainer_cfg.ranks, generator_replicas=cfg.generator.replicas, trainer_host=placer.trainer_hosts[0],
                       trainer_hosts=list(placer.trainer_hosts), trainer_pids=list(trainer_pids),
                       trainer_master_addr=trainer_setup["master_addr"], warm_spares=spares,
                       gpus=hosts.gpus.holdings())

        recorder.event("placement_applied", step=0, role="generator", hosts=generator_hosts,
                       plan={str(r.index): r.host for r in generators.live()},
                       pids={str(r.index): r.pids for r in generators.live()})

        sampling = SamplingParams(max_new_tokens=cfg.generator.max_new_tokens, temperature=cfg.generator.temperature,
                                  top_p=cfg.generator.top_p)
        step, policy_version, generations = 0, 0, 0
        generator_version = 0
        staleness: Counter[int] = Counter()
        pending: deque[PendingGeneration] = deque()
        initial_progress = {"step": 0, "policy_version": 0, "generations": 0, "staleness": {},
                            "data": dataset.state_dict.call_one().get(), "buffer": buffer.state_dict.call_one().get()}
        last_checkpoint: str | None = None
        failover = Failover(recorder=recorder, injector=injector, config=failover_cfg, step=lambda: step,
                            policy_version=lambda: policy_version)
        totals = {"steps_lost": 0, "samples_dropped": 0, "migrations": 0, "trainer_recoveries": 0, "control_recoveries": 0}

        # --- waiting, failures and drills ------------------------------------------------
        def wait(future: Any, *, gone: Callable[[], str | None] = lambda: None) -> Any:
            return wait_for(future, timeout_s=failover_cfg.call_timeout_s, poll_s=failover_cfg.poll_seconds, tick=tick,
                            gone=gone)

        def control_gone() -> str | None:
            return f"host {hosts.describe(control_host)} of the dataset and replay buffer was lost" \
                if control_host in hosts.lost else None

        control_failure: dict[str, Any] = {}  # noticed, not yet recovered: (detected at, reason)

        def detect_control(reason: str) -> None:
            """Emit the control proc's failure_detected once per failure."""
            if not control_failure:
                recorder.event("failure_detected", step=step + 1, role="replay_buffer", replica=None, host=control_host,
                               fault_id=None, reason=reason, hung=False, time_to_detect_s=None)
                control_failure["noticed"] = (time.monotonic(), reason)

        def on_control(future: Any) -> Any:
            """The dataset's or replay buffer's answer; ControlLost when their proc or host is gone."""
            try:
                return wait(future, gone=control_gone)
            except CallFailed as failure:
                detect_control(failure.reason)
                raise ControlLost(failure.reason) from None

        def trainer_gone() -> str | None:
            lost = trainer_lost_host()
            return f"host {hosts.describe(lost)} of the trainer was lost" if lost else None

        def trainer_result(future: Any) -> Any:
            try:
                return wait(future, gone=trainer_gone)
            except CallFailed as failure:
                raise TrainerLost(failure) from None

        def from_trainer(endpoint: str, *args: Any) -> Any:
            """Rank 0's answer. Every rank of a sharded (FSDP) trainer takes part: its weights are gathered from all."""
            if trainer_cfg.sharding == "fsdp":
                return list(trainer_result(getattr(trainer, endpoint).call(*args)).values())[0]
            return trainer_result(getattr(trainer0, endpoint).call_one(*args))

        def tick() -> None:
            """While waiting: notice dead replicas and loaded spares, inject drills that are due, end faults that wore off."""
            scan_supervision()
            poll_spares()
            inject_due(timed_only=True)
            injector.tick(step=step)

        unexplained: list[str] = []

        def claim_fault(role: str) -> tuple[float, Any, float | None]:
            """(now, the drill fault that explains this failure of `role` or None, its time to detect)."""
            detected = time.monotonic()
            fault = injector.claim(role)
            return detected, fault, round(detected - fault.injected_at, 3) if fault else None

        def record_recovery(role: str, *, detected: float, fault: Any, ttd: float | None, at_step: int, action: str,
                            **fields: Any) -> None:
            """The `recovered` event of a trainer or control failure (replica failures: `Failover`)."""
            if fault is not None:
                injector.finish(fault)
            ttr = round(time.monotonic() - detected, 3)
            failover.recover_seconds.append(ttr)
            recorder.event("recovered", step=at_step, role=role, replica=fault.replica if fault else None,
                           fault_id=fault.id if fault else None, caused_failure=True, action=action, **fields,
                           time_to_detect_s=ttd, time_to_recover_s=ttr, policy_version=policy_version)

        trainer_failure: dict[str, Any] = {}  # noticed, not yet recovered: (detected at, fault, time to detect)

        def detect_trainer(failure: CallFailed) -> tuple[float, Any, float | None]:
            """Emit the trainer's failure_detected once per failure (its host may be found lost before its recovery starts)."""
            if not trainer_failure:
                detected, fault, ttd = claim_fault("trainer")
                recorder.event("failure_detected", step=step + 1, role="trainer", replica=fault.replica if fault else None,
                               host=trainer_lost_host() or placer.trainer_hosts[0], fault_id=fault.id if fault else None, reason=failure.reason,
                               hung=failure.hung, time_to_detect_s=ttd)
                trainer_failure["noticed"] = (detected, fault, ttd)
            return trainer_failure["noticed"]

        def host_lost(name: str) -> None:
            """Every proc on the host is gone: detect its replicas (their replacements go elsewhere)."""
            reason = f"host {hosts.describe(name)} is unreachable"
            recorder.event("message", step=step, text=f"{reason}: its procs are lost")
            if name == control_host:  # noticed now; restored from the last checkpoint on the next dataset or buffer call
                detect_control(f"{reason}: the dataset and replay buffer ran there")
            if name in placer.trainer_hosts:  # noticed now; restored once the controller next needs the trainer
                detect_trainer(CallFailed(f"host {hosts.describe(name)} of the trainer was lost", hung=False))
            for group in groups.values():
                live = group.live()
                for replica in [*group.replicas, *group.retiring]:
                    if replica.host != name:
                        continue
                    replica.lost_with_host = reason
                    if replica in live and not replica.failed:
                        failover.detect(group, replica, reason, hung=False, request_failed=replica.outstanding > 0)

        def check_hosts(*, now: bool = False) -> None:
            for name in hosts.check(now=now):
                host_lost(name)

        def settle(host: str) -> None:
            """A proc on `host` died: if the whole host did, its port is closed a moment later; look then."""
            check_hosts(now=True)
            if host in hosts.workers and host not in hosts.lost:
                time.sleep(HOST_SETTLE_S)
                check_hosts(now=True)

        def scan_supervision() -> None:
            check_hosts()
            while supervision_reports:
                report = supervision_reports.pop(0)
                name = str(getattr(report, "mesh_name", ""))
                for group in groups.values():
                    replica = group.find(name)
                    if replica is not None and replica in group.spare_replicas():
                        group.drop_spare(replica)
                        recorder.event("message", step=step, text=f"a {group.role} spare failed; another is started: {str(report)[:200]}")
                        break
                    if replica is not None:
                        current = group.replicas[replica.index] is replica and replica not in group.retiring
                        if current and not replica.failed:
                            failover.detect(group, replica, str(report), hung=False, request_failed=replica.outstanding > 0)
                        break
                else:
                    if not name.startswith(("logger", "trainer")):  # trainer failures surface in its train step
                        unexplained.append(str(report)[:500])
            for group in groups.values():  # local procs: a killed one shows in /proc before Monarch reports it
                for spare in group.ready_spares:
                    if any(exited(pid) for pid in spare.pids):
                        group.drop_spare(spare)
                for replica in group.live():
                    gone = [pid for pid in replica.pids if replica.pids_visible and exited(pid)]
                    if gone and not replica.failed:
                        failover.detect(group, replica, f"process {gone[0]} exited", hung=False,
                                        request_failed=replica.outstanding > 0)

        def check_trainer() -> None:
            """A trainer proc that exited between train steps: restore now, not after the next call times out."""
            if trainer_gone():
                raise TrainerLost(CallFailed(trainer_gone(), hung=False))
            gone = [pid for pid in trainer_pids if trainer_pids_visible() and exited(pid)]
            if gone:
                raise TrainerLost(CallFailed(f"trainer process {gone[0]} exited", hung=False))

        def check_control_procs() -> None:
            """A failure report no replica explains: the run goes on only if dataset and buffer still answer."""
            if not unexplained:
                return
            try:
                buffer.stats.call_one().get(timeout=30)
                dataset.state_dict.call_one().get(timeout=30)
            except Exception:  # noqa: BLE001 - the control proc is the one that failed
                reason = f"a process of the run failed: {unexplained[0]}"
                unexplained.clear()
                detect_control(reason)
                raise ControlLost(reason) from None
            unexplained.clear()

        def pick_host(replica: Replica) -> str:
            """Where a replacement goes: the replica's host if still there and not drained, else the least used one."""
            if replica.failed:
                settle(replica.host)
            check_hosts(now=True)  # a proc spawned on a lost host would wait for it
            alive = hosts.alive(placer.role_hosts(replica.role))
            if not alive:
                raise ProcFailure(f"{replica.role} replica {replica.index} has no host left: "
                                  f"{', '.join(placer.role_hosts(replica.role))} (placement.{replica.role}.hosts) are lost")
            group = groups[replica.role]
            roomy = [h for h in alive if group.has_room(h, replacing=replica)]
            if not roomy:
                raise ProcFailure(f"{replica.role} replica {replica.index} has no host with room left on "
                                  f"{', '.join(alive)} (placement.{replica.role}.procs_per_host / gpus_per_proc)")
            candidates = [h for h in roomy if h not in drained] or roomy
            if replica.host in candidates:
                return replica.host
            live = group.live()
            return min(candidates, key=lambda h: sum(r.host == h for r in live))

        def prepare_generator(replica: Replica) -> int:
            """Give a new generator replica the trainer's current weights; the version it reports."""
            state = from_trainer("state_dict")
            wait(replica.actor.load_weights.call_one(state, policy_version))
            return int(wait(replica.actor.policy_version.call_one()))

        # what a new replica needs before it serves, per role (a generator: the current weights)
        prepare_new: dict[str, Callable[[Replica], int]] = {"generator": prepare_generator}

        def repair() -> None:
            if not failover.pending_repairs():
                return
            poll_spares()
            failover.repair(prepare_new, host=pick_host)
            warm_spares()  # spares used up start again; their models load while training goes on

        def send(group: ReplicaGroup, call: Callable[[Any], Any], *, key: str | None = None, attempts: int = 0,
                 incident: Incident | None = None) -> Request:
            if not group.service.routable():
                repair()  # every replica of the role is down: nothing can serve until one is replaced
            index, future = group.service.submit(lambda replica: call(replica.actor), key=key)
            replica = group.replicas[index]
            replica.outstanding += 1
            return Request(group, call, key, replica, index, future, time.monotonic(), attempts, incident)

        def finish(request: Request, seconds: float | None) -> None:
            same = request.group.replicas[request.index] is request.replica
            request.group.service.done(request.index, seconds if same else None)
            request.replica.outstanding -= 1
            request.group.reap()

        def receive(request: Request) -> Any:
            """The request's result; a failed or hung replica is reported and the request retried elsewhere."""
            while True:
                deadline = request_deadline(typical_s=request.group.service.typical_seconds(), config=failover_cfg)
                try:
                    result = wait_for(request.future, timeout_s=max(0.01, deadline - (time.monotonic() - request.sent_at)),
                                      poll_s=failover_cfg.poll_seconds, tick=tick,
                                      gone=lambda replica=request.replica: replica.lost_with_host)
                except CallFailed as failure:
                    finish(request, None)
                    check_hosts(now=True)  # asking a replica on a lost host whether it answers would wait
                    alive = not failure.hung and request.replica.lost_with_host is None and answers(request.replica)
                    incident = failover.detect(request.group, request.replica, failure.reason, hung=failure.hung, alive=alive)
                    attempts = request.attempts + 1
                    failover.backoff(attempts, what=f"a {request.group.role} request")
                    request = send(request.group, request.call, key=request.key, attempts=attempts, incident=incident)
                    if failover.pending_repairs():
                        repair()  # while the retry runs on a healthy replica
                    continue
                finish(request, time.monotonic() - request.sent_at)
                failover.served(request.incident)
                return result

        def answers(replica: Replica) -> bool:
            try:
                replica.actor.pid.call_one().get(timeout=10)
                return True
            except Exception:  # noqa: BLE001 - dead or hung
                return False

        def drill_target(request: FaultDrillRequest) -> FaultTarget:
            """What a drill acts on; ValueError (the command's reason) for a role or replica this run lacks."""
            target = signal_target(request)
            if request.kind in SIGNAL_KINDS:
                host = placer.rank_host(request.replica) if request.role == "trainer" else groups[request.role].replicas[request.replica].host
                try:
                    target.signals = hosts.signals(host)  # an agent on the target's host, with workers
                except HostsUnreachable as error:
                    raise ValueError(f"{request.role} replica {request.replica}'s host cannot be signalled: {error}") from None
                if request.kind == "slow_host":  # the whole host: every process of the run there
                    target.pids = list(dict.fromkeys([*target.pids, *run_pids_on(host)]))
            return target

        def run_pids_on(host: str) -> list[int]:
            """The run's trainer ranks and replicas (spares and retiring ones too) on `host`."""
            pids = [pid for rank, pid in enumerate(trainer_pids) if placer.rank_host(rank) == host]
            for group in groups.values():
                for replica in [*group.replicas, *group.retiring, *group.spare_replicas()]:
                    if replica.host == host:
                        pids.extend(replica.pids)
            return pids

        def signal_target(request: FaultDrillRequest) -> FaultTarget:
            if request.role == "trainer":
                if request.replica >= trainer_cfg.ranks:
                    raise ValueError(f"trainer has ranks 0..{trainer_cfg.ranks - 1}, not {request.replica}")
                pids = list(trainer_result(trainer.pids.call()).values())
                rank = trainer_rank(trainer, request.replica)

                def arm_trainer(kind: str, **fields: Any) -> None:
                    # a raise on one rank would leave the others blocked in the gradient all-reduce: raise on all
                    (trainer if kind == "raise" else rank).inject_fault.call(kind, **fields).get(timeout=ARM_TIMEOUT_S)

                return FaultTarget("trainer", request.replica, [pids[request.replica]], arm_trainer)
            replica = serving(request.role, request.replica)
            return FaultTarget(request.role, replica.index, replica.pids,
                               lambda kind, **fields: replica.actor.inject_fault.call_one(kind, **fields).get(timeout=ARM_TIMEOUT_S))

        def run_drill(request: FaultDrillRequest) -> dict[str, Any]:
            fault = injector.inject(request, drill_target(request), step=step + 1)
            return {"fault_id": fault.id, "pids": fault.pids}

        def inject_due(*, timed_only: bool = False) -> None:
            """Inject the drills due now; `timed_only` (while waiting): every_s and random ones, not trainer drills."""
            roles = ("generator", "reward", "reference") if timed_only else None
            for request in plan.due(step=step + 1, now=time.monotonic(), roles=roles, timed_only=timed_only):
                try:
                    run_drill(request)
                except (ValueError, TimeoutError) as error:
                    recorder.event("message", step=step, text=f"fault drill not run: {error}")

        # --- placement and redirects (operator commands) ---------------------------------------
        MOVABLE = ("generator", "reward", "reference")  # in this order: a role may follow the generators' hosts

        def role_plan(role: str) -> dict[str, str]:
            return {str(r.index): r.host for r in groups[role].live()}

        def group_of(role: str) -> ReplicaGroup:
            if role not in groups:
                raise ValueError(f"this run has no {role} (reference.enabled is false)")
            return groups[role]

        def check_host(role: str, host: str) -> None:
            rule = getattr(cfg.placement, role)
            if rule.colocate_with is not None:
                raise ValueError(f"the {role} follows the {rule.colocate_with}'s hosts (placement.{role}.colocate_with)")
            known = list(rule.hosts) or hosts.names
            if host not in known:
                raise ValueError(f"unknown host {host!r}; hosts: {', '.join(known)}")
            if host in hosts.lost:
                raise ValueError(f"host {host!r} is lost")
            if host in drained:
                raise ValueError(f"host {host!r} is drained; undrain it first")
            if not groups[role].has_room(host):
                raise ValueError(f"host {host!r} has no room for another {role} replica "
                                 f"(placement.{role}.procs_per_host / gpus_per_proc)")

        def serving(role: str, index: int) -> Replica:
            live = [r.index for r in group_of(role).live()]
            if index not in live:
                raise ValueError(f"{role} replica {index} is not serving; serving replicas: {live}")
            return groups[role].replicas[index]

        def start_replica(group: ReplicaGroup, index: int, host: str) -> Replica:
            """A new replica of the group's role on `host`, ready to serve (a generator at the current weights)."""
            new = group.spawn(index, host)
            new.version = prepare_new[group.role](new) if group.role in prepare_new else 0
            return new

        def move(group: ReplicaGroup, replica: Replica, host: str) -> None:
            """Start the replica again on `host`; the old one stops once its requests are done."""
            group.service.replace(replica.index, start_replica(group, replica.index, host))
            group.retire(replica)
            totals["migrations"] += 1

        def change_placement(change: PlacementChangeRequest) -> dict[str, Any]:
            started = time.monotonic()
            group = group_of(change.role)
            if change.action == "add":
                check_host(change.role, change.host)
                replica_index = group.service.add(start_replica(group, len(group.replicas), change.host))
            elif change.action == "remove":
                replica = serving(change.role, change.replica)
                if len(group.live()) == 1:
                    raise ValueError(f"cannot remove the last serving {change.role} replica")
                group.service.set_available(replica.index, False)
                group.retire(replica)
                replica_index = replica.index
            else:
                replica = serving(change.role, change.replica)
                check_host(change.role, change.host)
                if replica.host == change.host:
                    raise ValueError(f"{change.role} replica {replica.index} is already on host {change.host!r}")
                move(group, replica, change.host)
                replica_index = replica.index
            result = {"action": change.action, "role": change.role, "replica": replica_index, "host": change.host,
                      "plan": role_plan(change.role)}
            recorder.event("placement_changed", step=step, seconds=round(time.monotonic() - started, 3),
                           pids=group.replicas[replica_index].pids, **result)
            return result

        def drain_destinations(group: ReplicaGroup, host: str) -> list[str]:
            """Where the group's replicas on `host` go: its other undrained hosts, round, each while it has room;
            ValueError when they do not all fit."""
            moving = [r for r in group.live() if r.host == host]
            targets = [h for h in hosts.alive(placer.role_hosts(group.role)) if h != host and h not in drained]
            room = {t: group.room(t) for t in targets}
            destinations = []
            for i in range(len(moving)):
                open_targets = [t for t in targets if room[t] >= 1]
                if not open_targets:
                    raise ValueError(f"no other undrained host has room for {host!r}'s {len(moving)} {group.role} "
                                     f"replica(s) (hosts {', '.join(targets) or 'none'}; "
                                     f"placement.{group.role}.procs_per_host / gpus_per_proc)")
                destinations.append(open_targets[i % len(open_targets)])
                room[destinations[-1]] -= 1
            return destinations

        def redirect(command: LoadRedirectRequest) -> dict[str, Any]:
            host = command.host
            known = hosts.names if hosts.workers else generator_hosts  # without workers only generators have hosts
            if host not in known:
                raise ValueError(f"unknown host {host!r}; hosts: {', '.join(known)}")
            if command.action == "undrain":
                drained.discard(host)
                recorder.event("redirect_finished", step=step, action="undrain", host=host, moved={},
                               plan=role_plan("generator"))
                return {"host": host, "plan": role_plan("generator")}
            # roles that follow the trainer stay with it; a role that follows the generators goes where they went
            roles = [role for role in MOVABLE if role in groups
                     and getattr(cfg.placement, role).colocate_with in (None, "generator")]
            first = {role: drain_destinations(groups[role], host) for role in roles
                     if getattr(cfg.placement, role).colocate_with is None}  # checked before anything moves
            started = time.monotonic()
            moving = {role: [r for r in groups[role].live() if r.host == host] for role in roles}
            drained.add(host)
            recorder.event("redirect_started", step=step, action="drain", host=host,
                           replicas=[r.index for r in moving.get("generator", [])],
                           **{f"{role}_replicas": [r.index for r in moving[role]] for role in roles if role != "generator"})
            for role in roles:  # stop routing to the host at once; replacements come up one by one
                for replica in moving[role]:
                    groups[role].service.set_available(replica.index, False)
            spares_dropped = sum(group.drop_spares_on(host) for group in groups.values())
            moved: dict[str, dict[str, str]] = {}
            for role in roles:
                destinations = first[role] if role in first else drain_destinations(groups[role], host)
                for replica, target in zip(moving[role], destinations):
                    move(groups[role], replica, target)
                    moved.setdefault(role, {})[str(replica.index)] = target
            if spares_dropped:
                warm_spares()  # after the moves: a spare must not take a moving replica's room
            others = {role: plan for role, plan in moved.items() if role != "generator"}
            recorder.event("redirect_finished", step=step, action="drain", host=host, moved=moved.get("generator", {}),
                           plan=role_plan("generator"), seconds=round(time.monotonic() - started, 3),
                           **({"moved_roles": others} if others else {}))
            return {"host": host, "moved": moved.get("generator", {}), "plan": role_plan("generator"),
                    **({"moved_roles": others} if others else {})}

        def operate(kind: str, operation: Operation) -> dict[str, Any]:
            if isinstance(operation, FaultDrillRequest):
                if operation.schedule is None:
                    return run_drill(operation)
                drill_target(operation)  # refuse a drill on a role or replica that does not exist now
                plan.add(operation, now=time.monotonic())
                return {"scheduled": operation.schedule.model_dump(exclude_none=True)}
            if isinstance(operation, PlacementChangeRequest):
                return change_placement(operation)
            return redirect(operation)

        if control is not None:
            control.operator = operate

        # --- checkpoints and trainer recovery ---------------------------------------------
        def replace_control() -> float:
            """A new control proc, on another host if its host was lost; when its failure was noticed."""
            nonlocal control_host, control_procs, dataset, buffer
            detect_control(control_gone() or "the control proc failed")
            detected, _ = control_failure["noticed"]
            totals["control_recoveries"] += 1
            if totals["control_recoveries"] > failover_cfg.max_replacements:
                raise ProcFailure(f"the dataset and replay buffer failed {totals['control_recoveries']} times "
                                  f"(failover.max_replacements {failover_cfg.max_replacements})")
            if control_host not in hosts.lost:
                stop_quietly(control_procs)
            control_host, control_procs, dataset, buffer = start_control()
            recorder.event("replica_replaced", step=step, role="replay_buffer", replica=None, host=control_host or "local",
                           pids=[], seconds=round(time.monotonic() - detected, 3))
            control_failure.clear()
            return detected

        def restore(path: str | None) -> None:
            """Put every stateful actor back to a checkpoint (or to the run's start); a lost control proc is replaced first."""
            nonlocal step, policy_version, generations, generator_version
            lost_from = step
            control_replaced = replace_control() if control_failure else None
            progress = list(trainer.load.call(path).get().values())[0] if path else initial_progress
            step, policy_version, generations = progress["step"], progress["policy_version"], progress["generations"]
            on_control(dataset.load_state_dict.call_one(progress["data"]))
            on_control(buffer.load_state_dict.call_one(progress["buffer"]))
            staleness.clear()
            staleness.update({int(k): v for k, v in progress["staleness"].items()})
            while pending:  # launched from later states: finish them and throw them away
                generation = pending.popleft()
                for request in generation.calls:
                    receive(request)
                totals["samples_dropped"] += len(generation.prompts)
            generator_version = -1  # the generators hold newer weights: sync before generating
            if control_replaced is not None:
                record_recovery("replay_buffer", detected=control_replaced, fault=None, ttd=None, at_step=step,
                                action="restored_checkpoint", path=path, steps_lost=lost_from - step)

        if cfg.checkpoint.resume_from:
            restore(cfg.checkpoint.resume_from)
            last_checkpoint = cfg.checkpoint.resume_from
            recorder.event("resumed", step=step, path=cfg.checkpoint.resume_from, policy_version=policy_version)

        def kill_trainer_procs() -> None:
            for host in placer.trainer_hosts:
                hosts.kill(host, [pid for rank, pid in enumerate(trainer_pids) if placer.rank_host(rank) == host])

        def recover_trainer(failure: CallFailed) -> None:
            """The trainer mesh lost a proc (or hangs): respawn it and go back to the last checkpoint."""
            nonlocal trainer_procs, trainer, trainer0
            detected, fault, ttd = detect_trainer(failure)
            totals["trainer_recoveries"] += 1
            if totals["trainer_recoveries"] > trainer_cfg.recover_failures:
                raise ProcFailure(f"trainer failed at step {step + 1} ({trainer_cfg.recover_failures} recoveries allowed, "
                                  f"trainer.recover_failures): {failure.reason}")
            if failure.hung:  # a stopped rank, and the ranks waiting for it in a collective
                kill_trainer_procs()
            settle(placer.trainer_hosts[0])
            if not trainer_lost_host():  # stopping a mesh on a lost host would wait for it
                stop_quietly(trainer_procs)
            lost_from = step
            trainer_procs, trainer, _ = start_trainer()
            trainer_failure.clear()  # settle() may find the old host lost: that is this failure; the next one is new
            trainer0 = trainer_rank(trainer, 0)
            restore(last_checkpoint)
            totals["steps_lost"] += lost_from - step
            recorder.event("replica_replaced", step=step, role="trainer", replica=None, ranks=trainer_cfg.ranks,
                           host=placer.trainer_hosts[0], hosts=list(placer.trainer_hosts), pids=list(trainer_pids), path=last_checkpoint,
                           policy_version=policy_version,
                           seconds=round(time.monotonic() - detected, 3))
            if ttd is not None:
                failover.detect_seconds.append(ttd)
            record_recovery("trainer", detected=detected, fault=fault, ttd=ttd, at_step=step, action="restored_checkpoint",
                            path=last_checkpoint, steps_lost=lost_from - step)

        def train_tick() -> None:
            """While a step trains: a rank that exited fails the step now (its peers would wait in the all-reduce)."""
            tick()
            if trainer_gone():
                raise CallFailed(trainer_gone(), hung=False)
            gone = [pid for pid in trainer_pids if trainer_pids_visible() and exited(pid)]
            if gone:
                raise CallFailed(f"trainer process {gone[0]} exited", hung=False)

        def train(record: Any, ref_logprobs: Any) -> list[dict[str, Any]] | None:
            """Every rank trains on its rows; None when the trainer failed and was restored (the step did not happen)."""
            return on_trainer(lambda: trainer.train_step.call(record, ref_logprobs), what="a train step")

        def on_trainer(call: Callable[[], Any], *, what: str, sent: Any = None) -> list[Any] | None:
            """Every rank's answer to `call` (or to `sent`, the same call made already); None when the trainer failed
            and was restored. A raise drill refuses the call on every rank before any collective: it is made again."""
            try:
                return list(wait_for(sent if sent is not None else call(), timeout_s=failover_cfg.call_timeout_s,
                                     poll_s=failover_cfg.poll_seconds, tick=train_tick).values())
            except CallFailed as failure:
                raised = not failure.hung and "InjectedFault" in str(failure)
                if not raised:
                    recover_trainer(failure)
                    return None
            detected, fault, ttd = claim_fault("trainer")
            recorder.event("failure_detected", step=step + 1, role="trainer", replica=fault.replica if fault else None,
                           fault_id=fault.id if fault else None, reason=f"{what} raised", hung=False, time_to_detect_s=ttd)
            try:
                results = list(wait(call()).values())
            except CallFailed as failure:
                recover_trainer(failure)
                return None
            record_recovery("trainer", detected=detected, fault=fault, ttd=ttd, at_step=step + 1, action="retried")
            return results

        def reference_logprobs(record: Any) -> Any:
            return receive(send(groups["reference"], lambda actor: actor.logprobs.call_one(
                record, trainer_cfg.micro_batch_size, cfg.generator.temperature)))

        def train_pipelined(generation: PendingGeneration, timer: PhaseTimer) -> tuple[Any, list[dict[str, Any]], int, float] | None:
            """Pipelined mode: each chunk of the step is scored, gets its reference log-probs and goes to the trainer
            as soon as its generation returns, while the generators work on later chunks; the trainer steps once every
            chunk is in. (record, every rank's results, tokens generated, slowest request's seconds); None when the
            trainer failed and was restored (the step did not happen; its rollouts are dropped)."""
            inject_due()  # before the trainer sees any chunk of this step
            chunks: list[Any] = []
            sent: list[tuple[Any, Any, Any]] = []  # (chunk, reference log-probs, the trainer's pending accumulate)
            tokens, seconds_per_replica = 0, Counter[int]()  # a replica works through its chunks one after another
            for request, (first, last) in zip(generation.calls, generation.spans):
                with timer.phase("generate_wait"):
                    completions, seconds = receive(request)
                tokens += sum(len(c.token_ids) for c in completions)
                seconds_per_replica[request.index] += seconds
                problems = generation.problems[first:last]
                prompts = generation.prompts[first * grpo.group_size:last * grpo.group_size]
                with timer.phase("reward"):
                    chunk = receive(send(groups["reward"], lambda actor, problems=problems, prompts=prompts, completions=completions:
                                         actor.score.call_one(problems, prompts, completions, grpo.group_size)))
                ref = None
                if "reference" in groups:
                    with timer.phase("reference"):
                        ref = reference_logprobs(chunk)
                chunks.append(chunk)
                sent.append((chunk, ref, trainer.accumulate.call(chunk, ref)))
            with timer.phase("train"):
                for chunk, ref, pending_call in sent:
                    if on_trainer(lambda chunk=chunk, ref=ref: trainer.accumulate.call(chunk, ref), what="a pipelined chunk",
                                  sent=pending_call) is None:
                        totals["samples_dropped"] += len(generation.prompts)
                        return None
                results = on_trainer(lambda: trainer.finish_step.call(), what="a pipelined step")
            if results is None:
                totals["samples_dropped"] += len(generation.prompts)
                return None
            return concat_records(chunks), results, tokens, max(seconds_per_replica.values())

        # --- generation -----------------------------------------------------------------
        def sync_weights(timer: PhaseTimer) -> None:
            nonlocal generator_version
            with timer.phase("weight_sync"):
                state = from_trainer("state_dict")
                replicas = generators.live()
                loads = wait_all([r.actor.load_weights.call_one(state, policy_version) for r in replicas],
                                 config=failover_cfg, tick=tick,
                                 gone=[lambda replica=replica: replica.lost_with_host for replica in replicas])
                for replica, outcome in zip(replicas, loads):
                    if isinstance(outcome, CallFailed):  # its replacement gets the current weights
                        failover.detect(generators, replica, outcome.reason, hung=outcome.hung, request_failed=False)
                    else:
                        replica.version = policy_version
                repair()
            generator_version = policy_version

        def launch_generation(timer: PhaseTimer, *, chunks: int = 0) -> PendingGeneration:
            """Send one step's problems to the generators: `chunks` requests (whole groups each), or one per serving replica."""
            nonlocal generations
            repair()
            if generator_version != policy_version:
                sync_weights(timer)
            data_state = on_control(dataset.state_dict.call_one())
            problems = on_control(dataset.take.call_one(trainer_cfg.batch_size))
            prompts = [tokenizer.encode_prompt(p.messages) for p in problems for _ in range(grpo.group_size)]
            check_prompt_lengths(prompts, cfg.data.max_prompt_tokens)
            groups_per_call = math.ceil(len(problems) / (chunks or len(generators.service.routable())))
            calls, spans = [], []
            for c, first in enumerate(range(0, len(problems), groups_per_call)):
                spans.append((first, min(len(problems), first + groups_per_call)))
                chunk = prompts[first * grpo.group_size:(first + groups_per_call) * grpo.group_size]
                seed = trainer_cfg.seed * 1_000_003 + generations * 1_000 + c
                calls.append(send(generators, lambda actor, chunk=chunk, seed=seed: actor.generate.call_one(chunk, sampling, seed),
                                  key=problems[first].messages[-1]["content"]))
            generations += 1
            return PendingGeneration(problems, prompts, calls, data_state, generations - 1, spans)

        def finish_generation(pending: PendingGeneration, timer: PhaseTimer) -> tuple[int, float]:
            """Await a launched generation, score and buffer it; return (tokens, slowest replica's seconds)."""
            with timer.phase("generate_wait"):
                completions, busiest = [], 0.0
                for request in pending.calls:
                    part, seconds = receive(request)
                    completions.extend(part)
                    busiest = max(busiest, seconds)
            with timer.phase("reward"):
                score = send(groups["reward"], lambda actor: actor.score.call_one(pending.problems, pending.prompts, completions,
                                                                                  grpo.group_size))
                record = receive(score)
                on_control(buffer.put.call_one(record))
            return sum(len(c.token_ids) for c in completions), busiest

        def run_eval(step: int) -> EvalResult:
            result = from_trainer("evaluate", held_out, cfg.eval.rollout_samples)
            recorder.log_many({"eval/accuracy": result.accuracy, "eval/reward_mean": result.reward_mean}, step)
            for prompt, completion, score in result.samples:
                recorder.rollout(step=step, prompt=prompt, completion=completion, reward=score, split="held_out")
            return result

        def checkpoint(step: int) -> Path:
            nonlocal last_checkpoint
            # generations in flight are not saved: the position before the oldest one is, so a
            # restore generates those problems again with the same seeds
            progress = {"step": step, "policy_version": policy_version,
                        "generations": pending[0].generation if pending else generations,
                        "data": pending[0].data_state if pending else on_control(dataset.state_dict.call_one()),
                        "buffer": on_control(buffer.state_dict.call_one()), "staleness": dict(staleness)}
            path = Path(from_trainer("save", step, progress))
            last_checkpoint = str(path)
            recorder.event("checkpoint_saved", step=step, path=str(path), policy_version=policy_version)
            return path

        startup.ready()
        first_eval = last_eval = run_eval(step) if cfg.eval.every_steps and step == 0 else None
        loop_start = time.perf_counter()
        losses: list[float] = []
        step_metrics: list[dict[str, float]] = []
        trained_samples: dict[int, list[str]] = {}
        saved: Path | None = None
        while step < trainer_cfg.steps:
            try:
                scan_supervision()
                check_trainer()
                check_control_procs()
                injector.tick(step=step)
                timer = PhaseTimer()
                timer.seconds["weight_sync"] = 0.0
                step_start = time.perf_counter()

                generated_tokens, generate_seconds = 0, 0.0
                if grpo.mode == "pipelined":  # 1-6 chunk by chunk: generation overlaps training within the step
                    outcome = train_pipelined(launch_generation(timer, chunks=grpo.pipeline_chunks), timer)
                    if outcome is None:  # the trainer was restored from a checkpoint: this step did not happen
                        continue
                    record, results, generated_tokens, generate_seconds = outcome
                else:
                    # 1-3. generate (launch ahead), reward, buffer
                    record = None
                    while record is None:
                        buffered = on_control(buffer.stats.call_one())["batches"]
                        while buffered + len(pending) < max_age + 1:
                            pending.append(launch_generation(timer))
                            buffered = on_control(buffer.stats.call_one())["batches"]
                        if buffered == 0:
                            tokens, seconds = finish_generation(pending.popleft(), timer)
                            generated_tokens, generate_seconds = generated_tokens + tokens, generate_seconds + seconds
                        record = on_control(buffer.take.call_one(policy_version))

                    # 4. reference log-probs
                    ref_logprobs = None
                    if "reference" in groups:
                        with timer.phase("reference"):
                            ref_logprobs = reference_logprobs(record)

                    # 5-6. drills due now, then train on every rank
                    inject_due()
                    with timer.phase("train"):
                        results = train(record, ref_logprobs)
                    if results is None:  # the trainer was restored from a checkpoint: this step did not happen
                        continue
                age = policy_version - record.policy_version
                staleness[age] += 1
                policy_version += 1
                step += 1
                trained_samples[step] = list(record.sample_ids)

                step_seconds = time.perf_counter() - step_start
                parts = [p for r in results for p in r["parts"]]
                train_tokens = sum(r["train_tokens"] for r in results)
                stats = on_control(buffer.stats.call_one())
                metrics = {
                    "loss": sum(r["loss"] for r in results),
                    **rollout_metrics(record),
                    **update_metrics(parts),
                    "grad_norm": results[0]["grad_norm"],
                    "lr": results[0]["lr"],
                    "policy_version": policy_version,
                    "staleness/policy_age": age,
                    "buffer/batches": stats["batches"],
                    "buffer/dropped_stale": stats["dropped_stale"],
                    "generations_in_flight": len(pending),
                    "time/step_s": step_seconds,
                    **timer.metrics(),
                    "throughput/train_tokens_per_s": train_tokens_per_second(tokens=train_tokens, step_seconds=step_seconds),
                    "data/train_tokens": train_tokens,
                    "mfu": mfu(n_params=n_params, tokens=train_tokens, seconds=step_seconds,
                               peak_flops_per_second=trainer_cfg.peak_flops_per_second * trainer_cfg.ranks),
                    **fault_metrics(failover, injector, totals),
                    **({"faults/spares_ready": sum(len(g.ready_spares) for g in groups.values())} if spares else {}),
                }
                if generated_tokens:
                    metrics["time/generate_s"] = generate_seconds
                    metrics["throughput/gen_tokens_per_s"] = generated_tokens / max(generate_seconds, 1e-9)
                for i, served in enumerate(generators.service.served):
                    metrics[f"generator/replica_{i}_requests"] = served
                recorder.log_many(metrics, step)
                for i in range(min(cfg.eval.rollout_samples, len(record))):
                    recorder.rollout(step=step, prompt=record.prompt_texts[i], completion=record.response_texts[i],
                                     reward=record.rewards[i], policy_version=record.policy_version, split="train")
                losses.append(metrics["loss"])
                step_metrics.append(metrics)

                if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == trainer_cfg.steps):
                    last_eval = run_eval(step)
                if (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or step == trainer_cfg.steps:
                    saved = checkpoint(step)
                if control is not None and not control.between_steps(step=step, checkpoint=lambda: checkpoint(step)):
                    break
            except TrainerLost as lost:  # a trainer proc died between train steps
                recover_trainer(lost.failure)
            except ControlLost as lost:  # the dataset and replay buffer are gone: back to the last checkpoint
                if trainer_gone():  # the same host had the trainer: its recovery restores both
                    recover_trainer(CallFailed(trainer_gone(), hung=False))
                    continue
                if last_checkpoint is None:
                    raise ProcFailure(f"{lost}; no checkpoint to restore them from yet (checkpoint.every_steps)") from None
                lost_from = step
                restore(last_checkpoint)
                totals["steps_lost"] += lost_from - step

        for generation in pending:  # launched ahead, not needed any more
            for request in generation.calls:
                receive(request)
        recorder.event("staleness_histogram", step=step, counts={str(k): v for k, v in sorted(staleness.items())})
        injector.close(step=step)
        scan_supervision()
        check_control_procs()
        trainer.shutdown.call().get()
        return GrpoResult(step=step, losses=losses, first_eval=first_eval, eval=last_eval, checkpoint=saved,
                          metrics=step_metrics, seconds=time.perf_counter() - loop_start, trained_samples=trained_samples)
    finally:
        for fault in injector.faults:
            fault.end_signals()  # no stopped process is left behind
        for group in groups.values():
            group.stop_all()
        if trainer_procs is not None and not trainer_lost_host():
            stop_quietly(trainer_procs)
        for mesh in meshes:
            stop_quietly(mesh)
        hosts.stop()


def measure_replica(groups: dict[str, ReplicaGroup], role: str, replica: int) -> dict[str, float]:
    """A replica's recent seconds per request and requests served: how a latency or slowdown fault shows."""
    group = groups.get(role)
    if group is None or group.service is None or replica >= len(group.replicas):
        return {}
    seconds = group.service.seconds_per_request[replica]
    return {"requests_served": group.service.served[replica],
            **({"seconds_per_request": round(seconds, 4)} if seconds is not None else {})}


def fault_metrics(failover: Failover, injector: FaultInjector, totals: dict[str, int]) -> dict[str, float]:
    """Running totals of the run's faults, logged with every step."""
    metrics = {
        "faults/injected": len(injector.faults),
        "faults/failures": len(failover.incidents) + totals["trainer_recoveries"] + totals["control_recoveries"],
        "faults/replacements": sum(failover.replacements.values()),
        "faults/migrations": totals["migrations"],
        "faults/steps_lost": totals["steps_lost"],
        "faults/samples_dropped": totals["samples_dropped"],
    }
    if failover.detect_seconds:
        metrics["faults/time_to_detect_s"] = failover.detect_seconds[-1]
    if failover.recover_seconds:
        metrics["faults/time_to_recover_s"] = failover.recover_seconds[-1]
    return metrics
