"""SFT on Monarch process meshes: `trainer.ranks` trainer procs (`trainer.sharding` replicate or fsdp), placed by the
same rules as GRPO's trainer (`placement.trainer`: hosts, procs_per_host, gpus_per_proc), on this machine's procs,
named workers, or a SLURM / Kubernetes job's workers (`controller/attach.py`). The controller holds the example
stream; there is no generator, reward, reference or control proc.

Each step, top to bottom (`MonarchSftRun.step`):
  1. data    the controller takes trainer.batch_size examples and packs them into rows (`sft_math.sft_batch`)
  2. drills  trainer fault drills due now are injected (`controller/drill_targets.py`)
  3. train   every rank takes its contiguous rows of the batch, the loss normalised over the whole batch's
             response tokens, gradients summed across ranks (`actors/sft_trainer.py`, `sft_math.sft_update`)
  4. record  metrics and where the step's time went (`timeline.py`), then the step's end (`step_end.py`): a skipped
             update said (too many in a row end the run as diverged), the held-out eval, a checkpoint, operator
             commands (and the run's end on an error one met that it cannot go on from), a drained trainer's move

Failures: a trainer rank that dies or hangs (or whose host is lost) sends the run back to the last checkpoint on a
respawned trainer mesh, up to `trainer.recover_failures` times (`controller/recovery.py`: SftRecovery). Drains of
a trainer host move the trainer at the next checkpoint, or in a recovery that respawns it elsewhere first
(`controller/operator.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from workers.engine.actors.failover import Failover
from workers.engine.actors.hosts import Hosts
from workers.engine.actors.mesh_stops import MeshStops
from workers.engine.actors.replica_group import ReplicaGroup
from workers.engine.actors.sft_trainer import SftTrainerActor
from workers.engine.actors.worker import Worker
from workers.engine.batching import SftBatch
from workers.engine.checkpoint_folders import with_resume_point
from workers.engine.config import RunConfig
from workers.engine.controller.attach import host_source, train_on_hosts
from workers.engine.controller.drill_targets import DrillTargets, measure_replica
from workers.engine.controller.incidents import RecoveryLog, fault_metrics
from workers.engine.controller.operator import Operator
from workers.engine.controller.placement import Placer
from workers.engine.controller.recovery import SftRecovery
from workers.engine.controller.state import RunState
from workers.engine.controller.supervision import Supervisor
from workers.engine.controller.trainer import TrainerHandle, TrainerLost
from workers.engine.controller.waits import Waits
from workers.engine.drills import DrillPlan, FaultInjector
from workers.engine.metrics import Recorder
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.operations import FaultDrillRequest
from workers.engine.recipes.results import SftResult
from workers.engine.run_control import RunControl
from workers.engine.sft_math import held_out_dropped, sft_batch, sft_step_metrics
from workers.engine.startup import StartupPhases
from workers.engine.step_end import StepEnd
from workers.engine.tasks import build_task
from workers.engine.tasks.stream import ProblemStream
from workers.engine.training import UPDATE_SKIPPED, EvalResult, PhaseTimer, record_eval


def train_sft_monarch(config: RunConfig, recorder: Recorder, *, control: RunControl | None = None,
                      drills: Sequence[FaultDrillRequest] = (), workers: Sequence[Worker] | None = None) -> SftResult:
    """`workers`: the Monarch workers to place the trainer on (`controller/attach.py`: host_source)."""
    config = with_resume_point(config)
    startup = StartupPhases(recorder)
    startup.enter("placing", "placing the trainer on hosts")
    source = host_source(config, workers)
    plan = DrillPlan([*config.drills, *drills])
    return train_on_hosts(MonarchSftRun, config, recorder, source=source, plan=plan, control=control, startup=startup)


class MonarchSftRun:
    """One SFT run's parts, wired together; `start` spawns the trainer, `train` runs the step loop."""

    def __init__(self, config: RunConfig, recorder: Recorder, *, hosts: Hosts, plan: DrillPlan,
                 control: RunControl | None, fault_reports: list[Any]):
        self.config, self.recorder, self.hosts, self.control = config, recorder, hosts, control
        self.state = state = RunState()
        self.groups: dict[str, ReplicaGroup] = {}  # no replicas: every placement rule and drill is the trainer's
        self.injector = FaultInjector(recorder, measure=lambda role, replica: measure_replica(self.groups, role, replica))
        self.failover = Failover(recorder=recorder, injector=self.injector, config=config.failover,
                                 step=lambda: state.step, policy_version=lambda: state.policy_version)
        self.waits = Waits(config=config.failover)
        ranks = config.trainer.ranks
        ranks_per_host = (config.placement.trainer.procs_per_host or ranks) if hosts.workers else ranks
        self.placer = Placer(placement=config.placement, hosts=hosts, device=config.trainer.device, trainer_ranks=ranks,
                             ranks_per_host=ranks_per_host, groups=self.groups)
        self.log = RecoveryLog(recorder=recorder, injector=self.injector, failover=self.failover, state=state)
        self.trainer = TrainerHandle(config=config, actor=SftTrainerActor, hosts=hosts, placer=self.placer,
                                     waits=self.waits, recorder=recorder, log=self.log, state=state)
        self.supervisor = Supervisor(recorder=recorder, hosts=hosts, groups=self.groups, failover=self.failover,
                                     placer=self.placer, trainer=self.trainer, control=None, waits=self.waits,
                                     state=state, reports=fault_reports)
        self.drills = DrillTargets(plan=plan, injector=self.injector, recorder=recorder, hosts=hosts,
                                   groups=self.groups, placer=self.placer, trainer=self.trainer, state=state)
        self.operator = Operator(config=config, placer=self.placer, hosts=hosts, groups=self.groups,
                                 supervisor=self.supervisor, drills=self.drills, recorder=recorder, state=state,
                                 moves_trainer=True)
        self.waits.ticks = [self.supervisor.scan, lambda: self.injector.tick(step=state.step)]
        if control is not None:
            control.operator = self.operator.operate

    # --- start ------------------------------------------------------------------------
    def start(self, startup: StartupPhases) -> None:
        """The task is read before any proc starts (a row it cannot use stops the run first); the tokenizer loads
        here while the ranks load the model."""
        cfg, recorder, trainer = self.config, self.recorder, self.trainer
        self.task = build_task(cfg)
        recorder.event("dataset", step=0, **self.task.summary())
        setup_start = time.perf_counter()
        where = "this machine" if not self.hosts.workers else \
            f"{self.placer.trainer_host_count} host{'s' if self.placer.trainer_host_count > 1 else ''}"
        startup.enter("spawning_procs", f"spawning {cfg.trainer.ranks} trainer procs on {where}")
        trainer.launch()
        self.tokenizer = ChatTokenizer(cfg.model.path)
        self.held_out_dropped = held_out_dropped(self.task.held_out, tokenizer=self.tokenizer, seq_len=cfg.data.seq_len)
        self.stream = ProblemStream(self.task.train, seed=cfg.trainer.seed)
        startup.enter("loading_model", "loading the model")
        trainer.await_started()
        recorder.event("meshes_ready", step=0, seconds=round(time.perf_counter() - setup_start, 2),
                       trainer_ranks=cfg.trainer.ranks, trainer_host=self.placer.trainer_hosts[0],
                       trainer_hosts=list(self.placer.trainer_hosts), trainer_pids=list(trainer.pids),
                       trainer_master_addr=trainer.master_addr, gpus=self.hosts.gpus.holdings())
        self.recovery = SftRecovery(config=cfg, trainer=trainer, stream=self.stream, supervisor=self.supervisor,
                                    failover=self.failover, log=self.log, recorder=recorder, state=self.state)
        if cfg.checkpoint.resume_from:
            self.recovery.resume(cfg.checkpoint.resume_from)
        self.step_end = StepEnd(config=cfg, recorder=recorder, evaluate=self.evaluate,
                                checkpoint=self.recovery.checkpoint, control=self.control,
                                after_checkpoint=self.recovery.move_drained_trainer,
                                run_ending=self.operator.raise_run_ending)
        startup.ready()

    def stop(self) -> None:
        stops = MeshStops()
        self.trainer.stop(stops=stops)
        stops.wait()

    # --- the step loop ----------------------------------------------------------------
    def train(self) -> SftResult:
        state, steps = self.state, self.config.trainer.steps
        self.step_end.before_first(state.step)
        loop_start = time.perf_counter()
        losses: list[float] = []
        while state.step < steps:
            try:
                self.supervisor.scan()
                self.trainer.check()
                self.injector.tick(step=state.step)
                timer = PhaseTimer()
                step_start = time.perf_counter()
                batch, results = self.step(timer)
                state.step += 1
                state.policy_version += 1
                metrics = self.metrics(batch, results, timer, step_seconds=time.perf_counter() - step_start)
                timer.add_ranks(results)  # where the step's time went
                metrics.update(timer.record_timeline(self.recorder, step=state.step))
                self.recorder.log_many(metrics, state.step)
                self.injector.trained(step=state.step, skipped=int(metrics[UPDATE_SKIPPED]))  # nan_gradients drills
                losses.append(metrics["loss"])
                if not self.step_end.after(state.step, metrics=metrics):  # 4. its end
                    break
            except TrainerLost as lost:  # the step did not happen
                self.recovery.recover_trainer(lost.failure)
        self.injector.close(step=state.step)
        self.trainer.shutdown()
        return SftResult(step=state.step, losses=losses, eval=self.step_end.last_eval, checkpoint=self.step_end.saved,
                         first_eval=self.step_end.first_eval, seconds=time.perf_counter() - loop_start)

    def step(self, timer: PhaseTimer) -> tuple[SftBatch, list[dict[str, Any]]]:
        """Steps 1-3: the packed batch and every rank's results. TrainerLost: the step did not happen."""
        with timer.phase("data"):  # 1.
            batch = sft_batch(self.stream.take(self.config.trainer.batch_size), tokenizer=self.tokenizer,
                              data=self.config.data)
        self.drills.inject_due()  # 2.
        with timer.phase("train"):  # 3.
            return batch, self.trainer.sft_step(batch)

    def metrics(self, batch: SftBatch, results: list[dict[str, Any]], timer: PhaseTimer, *,
                step_seconds: float) -> dict[str, float]:
        cfg = self.config.trainer
        return {
            **sft_step_metrics(update_loss=sum(r["loss"] for r in results), grad_norm=results[0]["grad_norm"],
                               update_skipped=results[0]["update_skipped"], lr=results[0]["lr"], batch=batch,
                               step_seconds=step_seconds, timer=timer,
                               n_params=self.trainer.n_params, peak_flops_per_second=cfg.peak_flops_per_second * cfg.ranks,
                               epoch=self.stream.epoch),
            **fault_metrics(self.failover, self.injector, self.state.totals),
        }

    def evaluate(self, step: int) -> EvalResult | None:
        """Held-out NLL of the reference replies (and how many it leaves out, cut off whole by data.seq_len); greedy
        accuracy and reward when the problems carry answers."""
        held_out = self.task.held_out
        self.recorder.log_many({"eval/nll": self.trainer.from_rank0("held_out_nll", held_out),
                                "eval/nll_dropped": self.held_out_dropped}, step)
        if not self.task.verifiable:
            return None
        result = self.trainer.from_rank0("evaluate", held_out, self.config.eval.rollout_samples)
        record_eval(self.recorder, result, step)
        return result
