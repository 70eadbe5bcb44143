"""Checkpoints of a Monarch run (GRPO or SFT) and going back to them: a trainer proc that dies or hangs takes the
trainer mesh with it (the mesh is respawned, on another of its hosts when its host was lost, up to
`trainer.recover_failures` times); a lost control proc is started again elsewhere. Either way every stateful actor
goes back to the last checkpoint (or to the run's start). A trainer on a drained host moves at a checkpoint, or
sooner when a recovery places its new mesh elsewhere."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from workers.engine.actors.calls import CallFailed, ProcFailure
from workers.engine.actors.failover import Failover
from workers.engine.actors.hosts import HostsUnreachable
from workers.engine.checkpoint import check_plain_data
from workers.engine.checkpoint_folders import check_resume_recipe, resume_field
from workers.engine.config import RunConfig
from workers.engine.controller.control_procs import ControlLost, ControlProcs
from workers.engine.controller.generation import GenerationPipeline
from workers.engine.controller.incidents import Noticed, RecoveryLog
from workers.engine.controller.state import RunState, TrainerDrain
from workers.engine.controller.supervision import Supervisor
from workers.engine.controller.trainer import TrainerHandle, TrainerLost
from workers.engine.metrics import Recorder
from workers.engine.startup import record_resumed
from workers.engine.tasks.stream import ProblemStream


class TrainerRecovery:
    """Respawning a lost trainer mesh and going back to the last checkpoint, for either recipe; `restore` (the
    recipe's own) puts the rest of the run's state back."""

    def __init__(self, *, config: RunConfig, trainer: TrainerHandle, supervisor: Supervisor, failover: Failover,
                 log: RecoveryLog, recorder: Recorder, state: RunState):
        self.config, self.trainer, self.supervisor = config, trainer, supervisor
        self.failover, self.log, self.recorder, self.state = failover, log, recorder, state
        self.resumed_progress: dict[str, Any] = {}  # what the ranks loaded from checkpoint.resume_from (`load`)

    def restore(self, path: str | None) -> None:
        """Put every stateful part back to a checkpoint (or to the run's start)."""
        raise NotImplementedError

    def progress(self) -> dict[str, Any]:
        """The recipe's progress saved beside the trainer's state."""
        raise NotImplementedError

    def checkpoint(self, step: int) -> Path:
        """Save the trainer and the recipe's progress at `step`: the run's newest checkpoint."""
        path = self.trainer.save(step, self.progress())
        self.state.last_checkpoint = str(path)
        self.recorder.event("checkpoint_saved", step=step, path=str(path), policy_version=self.state.policy_version)
        return path

    def load(self, path: str) -> dict[str, Any]:
        """Every trainer rank back to a checkpoint; the progress saved with it. The run's own checkpoints are its
        recipe's (and may be on a disk only the trainer's hosts see); `checkpoint.resume_from` may be the other
        recipe's, a ConfigError: told by its checkpoint.json before the ranks load it (one without a usable
        checkpoint.json is refused there too), and by its progress before that is read (a checkpoint.json written by
        hand may name the wrong recipe). Its trainer.pt must be whole and plain data too (`check_plain_data`), checked
        here before any rank reads it; what only the ranks can check (the weights' checksums, their fit to the model)
        comes back from them as the same field's ConfigError (`TrainerHandle.load`). Each names the field that named it."""
        if path != self.config.checkpoint.resume_from:
            return self.trainer.load(path)
        field = resume_field(self.config)
        check_resume_recipe(path, recipe=self.config.recipe, field=field)
        check_plain_data(path, field=field)
        progress = self.trainer.load(path)
        check_resume_recipe(path, recipe=self.config.recipe, progress=progress, field=field)
        self.resumed_progress = progress
        return progress

    def resume(self, path: str) -> None:
        """Start from `checkpoint.resume_from`."""
        self.restore(path)
        self.state.last_checkpoint = path
        record_resumed(self.recorder, step=self.state.step, path=path, progress=self.resumed_progress,
                       policy_version=self.state.policy_version)

    def recover_trainer(self, failure: CallFailed) -> None:
        """The trainer mesh lost a proc (or hangs): respawn it and go back to the last checkpoint. The new mesh may fail
        before the restore is done (as it starts, as it loads the checkpoint, or as the generations in flight are
        dropped: a request retried there has its failed replica replaced with the new mesh's weights): one more
        failure, recovered the same way, within the same `trainer.recover_failures`. Each failure gets its `recovered`
        once the run is whole; the steps lost are the first's. A new mesh off the host an operator drained finishes
        that drain (also one whose move at the checkpoint failed half-way): no move at the next checkpoint."""
        state, trainer, placer = self.state, self.trainer, self.trainer.placer
        lost_from, failures = state.step, []
        new_failure: CallFailed | None = failure
        while new_failure is not None:
            failures.append(self.stop_trainer(new_failure))
            new_failure = self.start_and_restore()
        state.totals.steps_lost += lost_from - state.step
        self.recorder.event("replica_replaced", step=state.step, role="trainer", replica=None,
                            ranks=self.config.trainer.ranks, host=placer.trainer_hosts[0],
                            hosts=list(placer.trainer_hosts), pids=list(trainer.pids), path=state.last_checkpoint,
                            policy_version=state.policy_version,
                            seconds=round(time.monotonic() - failures[0].detected_at, 3))
        for noticed in failures:
            if noticed.time_to_detect_s is not None:
                self.failover.detect_seconds.append(noticed.time_to_detect_s)
            steps_lost = lost_from - state.step if noticed is failures[0] else 0
            self.log.recovered("trainer", noticed, at_step=state.step, action="restored_checkpoint",
                               path=state.last_checkpoint, steps_lost=steps_lost)
        drain = state.trainer_drain
        if drain is not None and drain.host not in placer.trainer_hosts:  # the new mesh left the drained host
            self.finish_drain(drain=drain, path=state.last_checkpoint, since=failures[0].detected_at, in_recovery=True)
        elif drain is not None:
            self.drain_waits(drain)

    def stop_trainer(self, failure: CallFailed) -> Noticed:
        """Stop the failed trainer mesh for a new one (ProcFailure when `trainer.recover_failures` are spent); the
        failure, as noticed."""
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
        trainer.noticed = None  # settle() may find the old host lost: that is this failure; the next one is new
        return noticed

    def start_and_restore(self) -> CallFailed | None:
        """A new trainer mesh, started and back at the last checkpoint with the rest of the run; its failure
        meanwhile (TrainerLost), or None."""
        try:
            self.launch_trainer()
            self.trainer.await_started()
            self.restore(self.state.last_checkpoint)
        except TrainerLost as lost:
            return lost.failure
        return None

    def launch_trainer(self) -> None:
        """Spawn a new trainer mesh on the first of its hosts still there."""
        while True:
            try:
                self.trainer.launch()
                return
            except HostsUnreachable:  # it died meanwhile: the probe finds it lost now, and the trainer goes elsewhere
                self.supervisor.check_hosts(now=True)

    def move_trainer(self, *, drain: TrainerDrain, path: str) -> None:
        """The operator drained a host of the trainer's: respawn the mesh on undrained hosts and load the checkpoint
        just saved, so no step is lost. A mesh that fails meanwhile is TrainerLost: the step loop recovers it, and that
        recovery finishes the drain when it leaves the drained host. While no undrained host can take the trainer
        (those up at the drain were lost since), the healthy mesh stays and the drain waits (`drain_waits`); so does
        a move whose new hosts were lost as it spawned there, leaving only the drained one."""
        started, trainer = time.monotonic(), self.trainer
        if self.drain_waits(drain):
            return
        trainer.leave_group()
        trainer.stop()
        self.launch_trainer()
        trainer.await_started()
        trainer.load(path)
        if drain.host in trainer.placer.trainer_hosts:
            self.drain_waits(drain)
            return
        self.finish_drain(drain=drain, path=path, since=started, in_recovery=False)

    def drain_waits(self, drain: TrainerDrain) -> bool:
        """Whether the drain must wait for a host to take the trainer (no undrained one is up); the run page is told
        why once per drain, not at every checkpoint."""
        refusal = self.trainer.placer.trainer_move_refusal(draining=drain.host)
        if refusal is not None and not drain.said_waiting:
            drain.said_waiting = True
            self.recorder.event("message", step=self.state.step, text=(
                f"the drain of host {drain.host} waits: {refusal}; the trainer stays there until one can take it"))
        return refusal is not None

    def finish_drain(self, *, drain: TrainerDrain, path: str | None, since: float, in_recovery: bool) -> None:
        """The trainer has left the drained host (`in_recovery`: a recovery's new mesh did, the drain's own move did
        not): the drain is done, a migration. `path`: the checkpoint the new mesh loaded; `since`: when it began."""
        state, trainer, placer = self.state, self.trainer, self.trainer.placer
        state.trainer_drain = None
        state.totals.migrations += 1
        ranks = {str(rank): placer.rank_host(rank) for rank in range(placer.trainer_ranks)}
        self.recorder.event("redirect_finished", step=state.step, action="drain", host=drain.host, moved={}, plan={},
                            moved_roles={"trainer": ranks}, from_hosts=drain.from_hosts, pids=list(trainer.pids),
                            path=path, seconds=round(time.monotonic() - since, 3), in_recovery=in_recovery)


class Recovery(TrainerRecovery):
    """A GRPO run's checkpoints and restores: the trainer, the dataset and replay buffer of the control proc, and the
    generations in flight."""

    def __init__(self, *, config: RunConfig, trainer: TrainerHandle, control: ControlProcs, supervisor: Supervisor,
                 pipeline: GenerationPipeline, failover: Failover, log: RecoveryLog, recorder: Recorder,
                 state: RunState):
        super().__init__(config=config, trainer=trainer, supervisor=supervisor, failover=failover, log=log,
                         recorder=recorder, state=state)
        self.control, self.pipeline = control, pipeline
        self.initial_progress = {"step": 0, "policy_version": 0, "generations": 0, "staleness": {},
                                 "data": control.dataset.state_dict.call_one().get(),
                                 "buffer": control.buffer.state_dict.call_one().get()}

    def progress(self) -> dict[str, Any]:
        control = self.control
        return self.state.progress(data_now=lambda: control.call(control.dataset.state_dict.call_one()),
                                   buffer=lambda: control.call(control.buffer.state_dict.call_one()))

    def restore(self, path: str | None) -> None:
        """Put every stateful actor back to a checkpoint (or to the run's start). A lost control proc is replaced, also
        one lost as it loads (each within `failover.max_replacements`): its steps lost are those of a failure noticed
        before the restore; one during it loses none more."""
        state, control = self.state, self.control
        lost_from, lost_before = state.step, control.noticed
        progress = self.load(path) if path else self.initial_progress
        state.resume(progress)
        control_failures: list[Noticed] = []
        while True:
            if control.noticed is not None:
                control_failures.append(control.replace())
            try:
                control.call(control.dataset.load_state_dict.call_one(progress["data"]))
                control.call(control.buffer.load_state_dict.call_one(progress["buffer"]))
                break
            except ControlLost:  # noticed (`control.noticed`): replaced next
                pass
        for noticed in control_failures:  # whole again, whatever befalls the trainer next
            self.log.recovered("replay_buffer", noticed, at_step=state.step, action="restored_checkpoint", path=path,
                               steps_lost=lost_from - state.step if noticed is lost_before else 0)
        self.pipeline.drain(dropped=True)  # launched from later states (TrainerLost: the trainer failed meanwhile)
        state.generator_version = -1  # the generators hold newer weights: sync before generating

    def recover_control(self, lost: ControlLost) -> None:
        """The dataset and replay buffer are gone: back to the last checkpoint with a new control proc."""
        if (reason := self.trainer.gone()) is not None:  # the same host had the trainer: its recovery restores both
            self.recover_trainer(CallFailed(reason, hung=False))
            return
        if self.state.last_checkpoint is None:
            raise ProcFailure(f"{lost}; no checkpoint to restore them from yet (checkpoint.every_steps)") from None
        lost_from = self.state.step
        try:
            self.restore(self.state.last_checkpoint)
        except TrainerLost as trainer_lost:  # as it loaded or the generations were dropped: its recovery restores again
            self.recover_trainer(trainer_lost.failure)
        self.state.totals.steps_lost += lost_from - self.state.step


class SftRecovery(TrainerRecovery):
    """An SFT run's checkpoints and restores: the trainer ranks and the controller's place in the example stream. The
    progress saved is the single-process recipe's, so either recipe resumes the other's checkpoints."""

    def __init__(self, *, config: RunConfig, trainer: TrainerHandle, stream: ProblemStream, supervisor: Supervisor,
                 failover: Failover, log: RecoveryLog, recorder: Recorder, state: RunState):
        super().__init__(config=config, trainer=trainer, supervisor=supervisor, failover=failover, log=log,
                         recorder=recorder, state=state)
        self.stream = stream
        self.initial_progress = self.progress()

    def progress(self) -> dict[str, Any]:
        return {"step": self.state.step, "policy_version": self.state.policy_version, "data": self.stream.state_dict()}

    def move_drained_trainer(self, step: int, path: Path) -> None:
        """After the step loop's checkpoint (`StepEnd.after_checkpoint`): a trainer on a drained host moves, loading
        it (not after the last step: the run ends there)."""
        if (drain := self.state.trainer_drain) is not None and step < self.config.trainer.steps:
            self.move_trainer(drain=drain, path=str(path))

    def restore(self, path: str | None) -> None:
        progress = self.load(path) if path else self.initial_progress
        self.state.step, self.state.policy_version = progress["step"], progress["policy_version"]
        self.stream.load_state_dict(progress["data"])
