"""Checkpoints of a Monarch GRPO run and going back to them: a trainer proc that dies or hangs takes the trainer mesh
with it (the mesh is respawned, on another of its hosts when its host was lost, up to `trainer.recover_failures`
times); a lost control proc is started again elsewhere. Either way every stateful actor goes back to the last
checkpoint (or to the run's start)."""

from __future__ import annotations

import time
from pathlib import Path

from workers.engine.actors.fleet import CallFailed, Failover, ProcFailure
from workers.engine.actors.hosts import HostsUnreachable
from workers.engine.config import RunConfig
from workers.engine.controller.control_procs import ControlLost, ControlProcs
from workers.engine.controller.generation import GenerationPipeline
from workers.engine.controller.incidents import RecoveryLog
from workers.engine.controller.state import RunState
from workers.engine.controller.supervision import Supervisor
from workers.engine.controller.trainer import TrainerHandle
from workers.engine.metrics import Recorder


class Recovery:
    def __init__(self, *, config: RunConfig, trainer: TrainerHandle, control: ControlProcs, supervisor: Supervisor,
                 pipeline: GenerationPipeline, failover: Failover, log: RecoveryLog, recorder: Recorder,
                 state: RunState):
        self.config, self.trainer, self.control, self.supervisor = config, trainer, control, supervisor
        self.pipeline, self.failover, self.log, self.recorder, self.state = pipeline, failover, log, recorder, state
        self.initial_progress = {"step": 0, "policy_version": 0, "generations": 0, "staleness": {},
                                 "data": control.dataset.state_dict.call_one().get(),
                                 "buffer": control.buffer.state_dict.call_one().get()}

    def checkpoint(self, step: int) -> Path:
        state, control = self.state, self.control
        progress = state.progress(data_now=lambda: control.call(control.dataset.state_dict.call_one()),
                                  buffer=lambda: control.call(control.buffer.state_dict.call_one()))
        path = self.trainer.save(step, progress)
        state.last_checkpoint = str(path)
        self.recorder.event("checkpoint_saved", step=step, path=str(path), policy_version=state.policy_version)
        return path

    def resume(self, path: str) -> None:
        """Start from `checkpoint.resume_from`."""
        self.restore(path)
        self.state.last_checkpoint = path
        self.recorder.event("resumed", step=self.state.step, path=path, policy_version=self.state.policy_version)

    def restore(self, path: str | None) -> None:
        """Put every stateful actor back to a checkpoint (or to the run's start); a lost control proc is replaced first."""
        state, control = self.state, self.control
        lost_from = state.step
        control_failure = control.replace() if control.noticed is not None else None
        progress = self.trainer.load(path) if path else self.initial_progress
        state.resume(progress)
        control.call(control.dataset.load_state_dict.call_one(progress["data"]))
        control.call(control.buffer.load_state_dict.call_one(progress["buffer"]))
        self.pipeline.drain(dropped=True)  # launched from later states
        state.generator_version = -1  # the generators hold newer weights: sync before generating
        if control_failure is not None:
            self.log.recovered("replay_buffer", control_failure, at_step=state.step, action="restored_checkpoint",
                               path=path, steps_lost=lost_from - state.step)

    def recover_trainer(self, failure: CallFailed) -> None:
        """The trainer mesh lost a proc (or hangs): respawn it and go back to the last checkpoint."""
        state, trainer, placer = self.state, self.trainer, self.trainer.placer
        noticed = trainer.detect(failure)
        state.totals.trainer_recoveries += 1
        allowed = self.config.trainer.recover_failures
        if state.totals.trainer_recoveries > allowed:
            raise ProcFailure(f"trainer failed at step {state.step + 1} ({allowed} recoveries allowed, "
                              f"trainer.recover_failures): {failure.reason}")
        if failure.hung:  # a stopped rank, and the ranks waiting for it in a collective
            trainer.kill_procs()
        self.supervisor.settle(placer.trainer_hosts[0])
        trainer.stop()
        lost_from = state.step
        while True:
            try:
                trainer.launch()
                break
            except HostsUnreachable:  # it died meanwhile: the probe finds it lost now, and the trainer goes elsewhere
                self.supervisor.check_hosts(now=True)
        trainer.await_started()
        trainer.noticed = None  # settle() may find the old host lost: that is this failure; the next one is new
        self.restore(state.last_checkpoint)
        state.totals.steps_lost += lost_from - state.step
        self.recorder.event("replica_replaced", step=state.step, role="trainer", replica=None,
                            ranks=self.config.trainer.ranks, host=placer.trainer_hosts[0],
                            hosts=list(placer.trainer_hosts), pids=list(trainer.pids), path=state.last_checkpoint,
                            policy_version=state.policy_version,
                            seconds=round(time.monotonic() - noticed.detected_at, 3))
        if noticed.time_to_detect_s is not None:
            self.failover.detect_seconds.append(noticed.time_to_detect_s)
        self.log.recovered("trainer", noticed, at_step=state.step, action="restored_checkpoint",
                           path=state.last_checkpoint, steps_lost=lost_from - state.step)

    def recover_control(self, lost: ControlLost) -> None:
        """The dataset and replay buffer are gone: back to the last checkpoint with a new control proc."""
        if (reason := self.trainer.gone()) is not None:  # the same host had the trainer: its recovery restores both
            self.recover_trainer(CallFailed(reason, hung=False))
            return
        if self.state.last_checkpoint is None:
            raise ProcFailure(f"{lost}; no checkpoint to restore them from yet (checkpoint.every_steps)") from None
        lost_from = self.state.step
        self.restore(self.state.last_checkpoint)
        self.state.totals.steps_lost += lost_from - self.state.step
