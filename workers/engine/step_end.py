"""What every recipe does once a step is trained and its metrics logged (`StepEnd.after`), in this order:
  1. skipped updates  a step whose update was skipped (NaN or infinite gradients) is said on the run page, and
                      `trainer.max_skipped_updates` of them in a row end the run as diverged (`training.SkippedUpdates`)
  2. rollouts         the step's train rollouts to the rollouts table (GRPO)
  3. eval             the held-out eval every `eval.every_steps` and at the last step
  4. checkpoint       every `checkpoint.every_steps` and at the last step
  5. commands         the operator's commands (pause, checkpoint, cancel; on Monarch drills, placement changes and
                      redirects), then the error one of them met that the run cannot go on from ends it (`run_ending`)
  6. after_checkpoint what the recipe does after a checkpoint (SFT on Monarch: a trainer on a drained host moves)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from workers.engine.config import RunConfig
from workers.engine.metrics import Recorder
from workers.engine.run_control import RunControl
from workers.engine.training import SkippedUpdates

EvalT = TypeVar("EvalT")


class StepEnd(Generic[EvalT]):
    def __init__(self, *, config: RunConfig, recorder: Recorder, evaluate: Callable[[int], EvalT],
                 checkpoint: Callable[[int], Path], control: RunControl | None,
                 after_checkpoint: Callable[[int, Path], None] | None = None,
                 run_ending: Callable[[], None] | None = None):
        self.config, self.recorder, self.control = config, recorder, control
        self.evaluate, self.checkpoint = evaluate, checkpoint
        self.after_checkpoint = after_checkpoint  # (step, the checkpoint saved at its end): the recipe's, once commands ran
        self.run_ending = run_ending  # raises the error a command met that the run cannot go on from (Operator's)
        self.skipped_updates = SkippedUpdates(limit=config.trainer.max_skipped_updates, recorder=recorder)
        self.first_eval: EvalT | None = None  # before the first step (not on a resumed run)
        self.last_eval: EvalT | None = None
        self.saved: Path | None = None  # the newest checkpoint this run wrote

    def save(self, step: int) -> Path:
        """A checkpoint of step `step`, the step loop's or one the operator asked for (a cancel's final one too): the
        newest this run wrote."""
        self.saved = self.checkpoint(step)
        return self.saved

    def before_first(self, step: int) -> None:
        """The held-out eval at step 0, so that the first point of its curve is the model before training."""
        if self.config.eval.every_steps and step == 0:
            self.first_eval = self.last_eval = self.evaluate(step)

    def after(self, step: int, *, metrics: dict[str, float], rollouts: Any = None) -> bool:
        """Everything after step `step` (the module's list); False when the operator cancelled the run. `metrics`: the
        step's logged metrics, whose `train/update_skipped` may end the run (RunDiverged) before its eval and
        checkpoint. `rollouts`: the step's RolloutBatchRecord, whose first `eval.rollout_samples` go to the rollouts
        table. The checkpoint is recorded as soon as it is saved. Every command of the step runs, and is reported,
        before `run_ending` may end the run, cancelled or not; then `after_checkpoint`, whose failure (SFT's move of a
        drained trainer, TrainerLost) skips neither, and which a cancel or the run's end leaves out."""
        self.skipped_updates.check(metrics, step=step)
        cfg, last = self.config, self.config.trainer.steps
        if rollouts is not None:
            for i in range(min(cfg.eval.rollout_samples, len(rollouts))):
                self.recorder.rollout(step=step, prompt=rollouts.prompt_texts[i], completion=rollouts.response_texts[i],
                                      reward=rollouts.rewards[i], advantage=rollouts.advantages[i],
                                      policy_version=rollouts.policy_version, split="train")
        if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == last):
            self.last_eval = self.evaluate(step)
        saved_now = None
        if (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or step == last:
            saved_now = self.save(step)
        running = self.control is None or self.control.between_steps(step=step, checkpoint=lambda: self.save(step))
        if self.run_ending is not None:
            self.run_ending()
        if not running:
            return False
        if saved_now is not None and self.after_checkpoint is not None:
            self.after_checkpoint(step, saved_now)
        return True
