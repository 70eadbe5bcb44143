"""GRPO on Monarch process meshes: the controller's step loop, over the parts in `workers/engine/controller/`.

The same algorithm as `recipes/grpo.py`, with each role in its own processes:
  trainer    `trainer.ranks` procs, `placement.trainer.procs_per_host` to a host, data parallel (gloo on CPU,
             NCCL on GPUs): `controller/trainer.py`
  generator  `generator.replicas` procs, one mesh each, behind a routed Service (torch or vLLM),
             spread over `placement.generator.hosts`; or, with `generator.in_trainer` (sync mode), the trainer's
             own procs, each rank generating from a copy of its weights (`controller/generators.py`)
  reward     one proc; reference (when enabled) one proc
  dataset, replay buffer   actors sharing one small "control" proc, on this machine unless
             `placement.replay_buffer.hosts` names a host: `controller/control_procs.py`

Hosts (`actors/hosts.py`) are the Monarch workers of the run's monarch.job (FORGEBOARD_MONARCH_JOB: a SLURM or
Kubernetes run), else those in FORGEBOARD_MONARCH_WORKERS (or `workers=`), attached once. Where each role goes is
`controller/placement.py`; without workers every host name is a label on this machine's procs.

Each step, top to bottom (`MonarchGrpoRun.step`):
  1. generate  launch generations until max_policy_age + 1 batches are buffered or in flight, each after a
               weight sync when the policy moved (`controller/generation.py`)
  2. reward    the oldest generation is awaited, scored by the reward actor, buffered
  3. buffer    the trainer's batch comes out of the replay buffer within the age bound
  4. reference (optional) reference log-probs for the KL penalty
  5. drills    fault drills due now are injected (`controller/drill_targets.py`)
  6. train     every trainer rank takes its rows; gradients are summed across ranks. Meanwhile the controller
               awaits and scores the oldest generation in flight (async), so the next step only buffers it
  7. record    metrics and where the step's time went (`timeline.py`), then the step's end (`step_end.py`, in this
               order): a skipped update said (NaN or infinite gradients; trainer.max_skipped_updates in a row end the
               run as diverged), rollouts, eval, checkpoint, operator commands (drills, placement changes and
               redirects: `controller/operator.py`), and the end of the run on an error a command met that it cannot
               go on from (a model folder refused, a role out of its replacements)
In pipelined mode 1-6 run chunk by chunk, so generation overlaps training within the step.

Failures: every wait polls each `failover.poll_seconds` and gives up after `failover.call_timeout_s`
(`controller/waits.py`). A generator, reward or reference replica that dies or hangs is detected, its request is
retried on a healthy replica (`controller/requests.py`), and it is replaced by a fresh proc (loading while the
healthy replicas serve) or a warm spare, holding the current policy weights (`controller/supervision.py`,
`actors/failover.py`). A trainer proc that dies or hangs, or a
lost control proc, sends the run back to the last checkpoint (`controller/recovery.py`). A host that stops
accepting connections is lost with every proc on it, and each of them is handled as above on the remaining hosts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.engine.actors.calls import ProcFailure, answered
from workers.engine.actors.failover import Failover
from workers.engine.actors.mesh_stops import MeshStops
from workers.engine.actors.replica_group import ReplicaGroup
from workers.engine.actors.generator import GeneratorActor
from workers.engine.actors.weight_inbox import WeightInboxActor
from workers.engine.actors.hosts import Hosts
from workers.engine.actors.reference import ReferenceActor
from workers.engine.actors.reward import RewardActor
from workers.engine.actors.trainer import TrainerActor
from workers.engine.actors.worker import Worker
from workers.engine.checkpoint_folders import with_resume_point
from workers.engine.config import RunConfig
from workers.engine.controller.attach import host_source, train_on_hosts
from workers.engine.controller.control_procs import ControlLost, ControlProcs
from workers.engine.controller.drill_targets import DrillTargets, measure_replica
from workers.engine.controller.generation import Batch, GenerationPipeline
from workers.engine.controller.generators import ReplicaGenerators, TrainerGenerators
from workers.engine.controller.incidents import RecoveryLog, fault_metrics
from workers.engine.controller.operator import Operator
from workers.engine.controller.placement import Placer
from workers.engine.controller.recovery import Recovery
from workers.engine.controller.requests import Router
from workers.engine.controller.state import RunState
from workers.engine.controller.supervision import Supervisor
from workers.engine.controller.trainer import TrainerHandle, TrainerLost
from workers.engine.controller.waits import Waits
from workers.engine.drills import DrillPlan, FaultInjector
from workers.engine.metrics import Recorder
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.operations import DrillSchedule, FaultDrillRequest
from workers.engine.grpo_metrics import rollout_metrics, update_metrics
from workers.engine.recipes.results import GrpoResult
from workers.engine.run_control import RunControl
from workers.engine.startup import StartupPhases
from workers.engine.step_end import StepEnd
from workers.engine.training import UPDATE_SKIPPED, EvalResult, PhaseTimer, mfu, record_eval, train_tokens_per_second

__all__ = ["FaultDrill", "ProcFailure", "train_grpo_monarch"]


@dataclass(frozen=True)
class FaultDrill:
    """Kill one trainer proc right before the given step trains (shorthand for a FaultDrillRequest)."""

    step: int
    rank: int = 0

    def request(self) -> FaultDrillRequest:
        return FaultDrillRequest(kind="kill", role="trainer", replica=self.rank, schedule=DrillSchedule(at_step=self.step))


def train_grpo_monarch(config: RunConfig, recorder: Recorder, *, control: RunControl | None = None,
                       drills: Sequence[FaultDrill | FaultDrillRequest] = (),
                       workers: Sequence[Worker] | None = None) -> GrpoResult:
    """`workers`: the Monarch workers to place procs on; None: those of the run's monarch.job (FORGEBOARD_MONARCH_JOB),
    else those in FORGEBOARD_MONARCH_WORKERS."""
    config = with_resume_point(config)
    startup = StartupPhases(recorder)
    startup.enter("placing", "placing roles on hosts")
    source = host_source(config, workers)
    plan = DrillPlan([*config.drills, *(d.request() if isinstance(d, FaultDrill) else d for d in drills)])
    return train_on_hosts(MonarchGrpoRun, config, recorder, source=source, plan=plan, control=control, startup=startup)


class MonarchGrpoRun:
    """One run's parts, wired together; `start` spawns its procs, `train` runs the step loop."""

    def __init__(self, config: RunConfig, recorder: Recorder, *, hosts: Hosts, plan: DrillPlan,
                 control: RunControl | None, fault_reports: list[Any]):
        self.config, self.recorder, self.hosts, self.control = config, recorder, hosts, control
        self.state = state = RunState()
        self.groups: dict[str, ReplicaGroup] = {}  # filled in as each role starts
        self.injector = FaultInjector(recorder, measure=lambda role, replica: measure_replica(self.groups, role, replica))
        self.failover = Failover(recorder=recorder, injector=self.injector, config=config.failover,
                                 step=lambda: state.step, policy_version=lambda: state.policy_version)
        self.waits = Waits(config=config.failover)
        trainer_cfg = config.trainer
        device = trainer_cfg.device  # each proc resolves auto itself (training.resolve_device)
        ranks_per_host = (config.placement.trainer.procs_per_host or trainer_cfg.ranks) if hosts.workers else trainer_cfg.ranks
        self.placer = Placer(placement=config.placement, hosts=hosts, device=device, trainer_ranks=trainer_cfg.ranks,
                             ranks_per_host=ranks_per_host, groups=self.groups)
        self.log = RecoveryLog(recorder=recorder, injector=self.injector, failover=self.failover, state=state)
        self.trainer = TrainerHandle(config=config, actor=TrainerActor, hosts=hosts, placer=self.placer, waits=self.waits,
                                     recorder=recorder, log=self.log, state=state)
        self.control_procs = ControlProcs(config=config, hosts=hosts, waits=self.waits, recorder=recorder, state=state)
        self.supervisor = Supervisor(recorder=recorder, hosts=hosts, groups=self.groups, failover=self.failover,
                                     placer=self.placer, trainer=self.trainer, control=self.control_procs,
                                     waits=self.waits, state=state, reports=fault_reports)
        self.router = Router(failover=self.failover, waits=self.waits, supervisor=self.supervisor)
        self.drills = DrillTargets(plan=plan, injector=self.injector, recorder=recorder, hosts=hosts,
                                   groups=self.groups, placer=self.placer, trainer=self.trainer, state=state)
        self.operator = Operator(config=config, placer=self.placer, hosts=hosts, groups=self.groups,
                                 supervisor=self.supervisor, drills=self.drills, recorder=recorder, state=state,
                                 moves_trainer=False)
        self.waits.ticks = [self.supervisor.tick, lambda: self.drills.inject_due(timed_only=True),
                            lambda: self.injector.tick(step=state.step)]
        if control is not None:
            control.operator = self.operator.operate

    # --- start ------------------------------------------------------------------------
    def start(self, startup: StartupPhases) -> None:
        """Spawn every proc before waiting for any (their imports and model loads overlap), then wait for all."""
        cfg, placer, recorder, trainer = self.config, self.placer, self.recorder, self.trainer
        setup_start = time.perf_counter()
        generator_hosts = placer.role_hosts("generator")
        placer.trainer_hosts = placer.place_trainer()
        replicas = cfg.role_processes()["generator"]  # 0: the trainer's ranks generate (generator.in_trainer)
        first_generators = placer.layout("generator", replicas) if replicas else []
        scorers = ("reward", "reference") if cfg.reference.enabled else ("reward",)
        used = {*placer.trainer_hosts, *first_generators, *cfg.placement.replay_buffer.hosts[:1],
                *(h for role in scorers if getattr(cfg.placement, role).colocate_with is None for h in placer.layout(role, 1))}
        spares = cfg.failover.warm_spares
        replicated_roles = len(scorers) + (1 if replicas else 0)
        procs_count = cfg.trainer.ranks + replicas + len(scorers) + 1 + spares * replicated_roles
        where = ("1 host" if len(used) == 1 else f"{len(used)} hosts") if self.hosts.workers else "this machine"
        startup.enter("spawning_procs", f"spawning {procs_count} procs on {where}")  # the control proc and spares too
        trainer.launch()
        if replicas:
            self._launch_group("generator", first_generators)
        for role in scorers:
            self._launch_group(role, placer.layout(role, 1))
        self.control_procs.start()
        self.supervisor.warm_spares()
        startup.enter("loading_model", "loading the model" + (" (vLLM compiles on its first generation)"
                                                              if cfg.generator.backend == "vllm" else ""))
        dataset = self.control_procs.dataset
        held_out, summary = dataset.held_out.call_one(), dataset.summary.call_one()
        self.tokenizer = ChatTokenizer(cfg.model.path)  # while the procs load
        parts = {"trainer": lambda wait_s: trainer.await_started(wait_s=wait_s),
                 **{role: (lambda wait_s, group=group: group.await_started(wait_s=wait_s))
                    for role, group in self.groups.items()},
                 "data": lambda wait_s: answered(held_out, wait_s)}
        if spares:  # the run starts with its spares ready
            parts["spares"] = self._spares_ready
        startup.await_parts(parts)
        self.held_out = held_out.get()
        recorder.event("dataset", step=0, **summary.get())
        recorder.event("meshes_ready", step=0, seconds=round(time.perf_counter() - setup_start, 2),
                       trainer_ranks=cfg.trainer.ranks, generator_replicas=replicas,
                       trainer_host=placer.trainer_hosts[0], trainer_hosts=list(placer.trainer_hosts),
                       trainer_pids=list(trainer.pids), trainer_master_addr=trainer.master_addr, warm_spares=spares,
                       gpus=self.hosts.gpus.holdings())
        if replicas:
            group = self.groups["generator"]
            recorder.event("placement_applied", step=0, role="generator", hosts=generator_hosts,
                           plan={str(r.index): r.host for r in group.live()},
                           pids={str(r.index): r.pids for r in group.live()})
        generators = ReplicaGenerators(group=self.groups["generator"], router=self.router, trainer=trainer,
                                       supervisor=self.supervisor, state=self.state) if replicas else \
            TrainerGenerators(trainer=trainer, state=self.state, ranks=cfg.trainer.ranks)
        self.pipeline = GenerationPipeline(config=cfg, tokenizer=self.tokenizer, groups=self.groups,
                                           generators=generators, trainer=trainer, control=self.control_procs,
                                           router=self.router, drills=self.drills, state=self.state)
        self.recovery = Recovery(config=cfg, trainer=trainer, control=self.control_procs, supervisor=self.supervisor,
                                 pipeline=self.pipeline, failover=self.failover, log=self.log, recorder=recorder,
                                 state=self.state)
        if cfg.checkpoint.resume_from:
            self.recovery.resume(cfg.checkpoint.resume_from)
        self.step_end = StepEnd(config=cfg, recorder=recorder, evaluate=self.evaluate,
                                checkpoint=self.recovery.checkpoint, control=self.control,
                                run_ending=self.operator.raise_run_ending)
        startup.ready()

    def _spares_ready(self, wait_s: float) -> bool:
        self.supervisor.poll_spares(wait_s=wait_s)
        return not any(group.warming for group in self.groups.values())

    def _launch_group(self, role: str, hosts: list[str]) -> None:
        cfg, rule = self.config, getattr(self.config.placement, role)
        group = self.groups[role] = ReplicaGroup(
            role, spawn_actor=self._actor_spawner(role), hosts=self.hosts, threads=cfg.trainer.threads_per_process,
            routing=cfg.generator.routing if role == "generator" else "round_robin", spares=cfg.failover.warm_spares,
            setup_timeout_s=cfg.failover.setup_timeout_s,
            gpus_per_proc=rule.gpus_per_proc, per_host=rule.procs_per_host,
            spawn_inbox=(lambda procs, name: procs.spawn(name, WeightInboxActor, cfg.failover.weight_wait_s))
            if role == "generator" else None)
        group.launch(hosts)

    def _actor_spawner(self, role: str) -> Any:
        """(procs, actor name) -> the role's actor on those procs."""
        cfg, model = self.config, self.config.model
        if role == "generator" and cfg.generator.backend == "vllm":
            from workers.engine.actors.vllm_generator import VllmGeneratorActor, vllm_proc_env

            vllm_proc_env()
            max_len = cfg.data.max_prompt_tokens + cfg.generator.max_new_tokens
            return lambda procs, name: procs.spawn(name, VllmGeneratorActor, model.path, cfg.rollout_dtype, max_len,
                                                   cfg.trainer.seed)
        if role == "generator":
            return lambda procs, name: procs.spawn(name, GeneratorActor, model.path, cfg.rollout_dtype,
                                                   self.placer.role_device("generator"))
        if role == "reward":
            return lambda procs, name: procs.spawn(name, RewardActor, model.path, list(cfg.reward.functions),
                                                   cfg.reward.weights, cfg.grpo.std_normalised_advantages,
                                                   cfg.grpo.overlong, cfg.generator.max_new_tokens)
        return lambda procs, name: procs.spawn(name, ReferenceActor, model.path, cfg.rollout_dtype,
                                               self.placer.role_device("reference"))

    # --- the step loop ----------------------------------------------------------------
    def train(self) -> GrpoResult:
        state, steps = self.state, self.config.trainer.steps
        self.step_end.before_first(state.step)
        loop_start = time.perf_counter()
        losses: list[float] = []
        step_metrics: list[dict[str, float]] = []
        trained_samples: dict[int, list[str]] = {}
        while state.step < steps:
            try:
                self.supervisor.scan()
                self.trainer.check()
                self.supervisor.check_control_procs()
                self.injector.tick(step=state.step)
                timer = PhaseTimer()
                timer.seconds["weight_sync"] = 0.0
                step_start = time.perf_counter()
                batch, results = self.step(timer)
                age = state.trained(record_version=batch.record.policy_version)
                trained_samples[state.step] = list(batch.record.sample_ids)
                metrics = self.metrics(batch, results, timer, age=age, step_seconds=time.perf_counter() - step_start)
                timer.add_ranks(results)  # where the step's time went
                metrics.update(timer.record_timeline(self.recorder, step=state.step))
                self.recorder.log_many(metrics, state.step)
                self.injector.trained(step=state.step, skipped=int(metrics[UPDATE_SKIPPED]))  # nan_gradients drills
                losses.append(metrics["loss"])
                step_metrics.append(metrics)
                if not self.step_end.after(state.step, metrics=metrics, rollouts=batch.record):  # 7. its end
                    break
            except TrainerLost as lost:  # the step did not happen
                self.recovery.recover_trainer(lost.failure)
            except ControlLost as lost:
                self.recovery.recover_control(lost)
        trainer_lost = False
        try:
            self.pipeline.drain(dropped=False)  # launched ahead, not needed any more
        except TrainerLost as lost:  # the run is over: nothing to recover for
            trainer_lost = True
            self.trainer.lost_after_last_step(lost.failure, unneeded=" and nothing needs the generations launched ahead")
        self.recorder.event("staleness_histogram", step=state.step,
                            counts={str(k): v for k, v in sorted(state.staleness.items())})
        self.injector.close(step=state.step)
        self.supervisor.scan()
        self.supervisor.check_control_procs()
        if not trainer_lost:  # a lost mesh's procs are stopped (`stop`), not asked
            self.trainer.shutdown()
        return GrpoResult(step=state.step, losses=losses, first_eval=self.step_end.first_eval,
                          eval=self.step_end.last_eval, checkpoint=self.step_end.saved, metrics=step_metrics,
                          seconds=time.perf_counter() - loop_start, trained_samples=trained_samples)

    def step(self, timer: PhaseTimer) -> tuple[Batch, list[dict[str, Any]]]:
        """Steps 1-6: the trainer's batch and every rank's results. TrainerLost: the step did not happen."""
        if self.config.grpo.mode == "pipelined":  # 1-6 chunk by chunk: generation overlaps training within the step
            generation = self.pipeline.launch(timer, chunks=self.config.grpo.pipeline_chunks)
            return self.pipeline.train_pipelined(generation, timer)
        batch = self.pipeline.next_batch(timer)  # 1-3. generate (launching ahead), reward, buffer
        ref_logprobs = self.pipeline.reference_logprobs(batch.record, timer)  # 4. (None without a reference)
        self.drills.inject_due()  # 5. drills due now
        sent = self.trainer.send_train_step(batch.record, ref_logprobs)  # 6. every rank trains on its rows,
        timer.train_sent = time.time()
        self.pipeline.score_ahead(timer)  # while the next batch's generation is awaited and scored (async)
        with timer.phase("train"):
            return batch, self.trainer.train_step(batch.record, ref_logprobs, sent=sent)

    def metrics(self, batch: Batch, results: list[dict[str, Any]], timer: PhaseTimer, *, age: int,
                step_seconds: float) -> dict[str, float]:
        cfg, record, state = self.config, batch.record, self.state
        parts = [p for r in results for p in r["parts"]]
        train_tokens = sum(r["train_tokens"] for r in results)
        stats = batch.buffer_stats or self.control_procs.call(self.control_procs.buffer.stats.call_one())
        metrics = {
            "loss": sum(r["loss"] for r in results),
            **rollout_metrics(record),
            **update_metrics(parts),
            **results[0]["shaping"],
            "train/updates": results[0]["updates"],
            "grad_norm": results[0]["grad_norm"],
            UPDATE_SKIPPED: results[0]["update_skipped"],
            "lr": results[0]["lr"],
            "policy_version": state.policy_version,
            "staleness/policy_age": age,
            "buffer/batches": stats["batches"],
            "buffer/dropped_stale": stats["dropped_stale"],
            "generations_in_flight": len(state.pending),
            "time/step_s": step_seconds,
            **timer.metrics(),
            "throughput/train_tokens_per_s": train_tokens_per_second(tokens=train_tokens, step_seconds=step_seconds),
            "data/train_tokens": train_tokens,
            "mfu": mfu(n_params=self.trainer.n_params, tokens=train_tokens, seconds=step_seconds,
                       peak_flops_per_second=cfg.trainer.peak_flops_per_second * cfg.trainer.ranks),
            **fault_metrics(self.failover, self.injector, state.totals),
            **self.trainer.fetches.figures(),  # the generators' reads of the weights that ended this step
            **({"faults/spares_ready": sum(len(g.ready_spares) for g in self.groups.values())}
               if cfg.failover.warm_spares else {}),
        }
        if batch.generated_tokens:
            metrics["time/generate_s"] = batch.generate_seconds
            metrics["throughput/gen_tokens_per_s"] = batch.generated_tokens / max(batch.generate_seconds, 1e-9)
        for i, served in enumerate(self.pipeline.generators.served()):
            metrics[f"generator/replica_{i}_requests"] = served
        return metrics

    def evaluate(self, step: int) -> EvalResult:
        result = self.trainer.from_rank0("evaluate", self.held_out, self.config.eval.rollout_samples)
        record_eval(self.recorder, result, step)
        return result

    def stop(self) -> None:
        for fault in self.injector.faults:
            fault.end_signals()  # no stopped process is left behind
        stops = MeshStops()  # every proc's stop started before any is waited for
        for group in self.groups.values():
            group.stop_all(stops=stops)
        self.trainer.stop(stops=stops)
        self.control_procs.stop_all(stops=stops)
        stops.wait()
