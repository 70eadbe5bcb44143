"""What every recipe does once a step is trained and its metrics logged: its train rollouts to the rollouts table
(GRPO), the held-out eval every `eval.every_steps` and at the last step, a checkpoint every
`checkpoint.every_steps` and at the last step, then the operator's commands (pause, checkpoint, cancel), then what the
recipe does after a checkpoint (SFT: a trainer on a drained host moves)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from workers.engine.config import RunConfig
from workers.engine.metrics import Recorder
from workers.engine.run_control import RunControl

EvalT = TypeVar("EvalT")


class StepEnd(Generic[EvalT]):
    def __init__(self, *, config: RunConfig, recorder: Recorder, evaluate: Callable[[int], EvalT],
                 checkpoint: Callable[[int], Path], control: RunControl | None,
                 after_checkpoint: Callable[[int, Path], None] | None = None):
        self.config, self.recorder, self.control = config, recorder, control
        self.evaluate, self.checkpoint = evaluate, checkpoint
        self.after_checkpoint = after_checkpoint  # (step, the checkpoint saved at its end): the recipe's, once commands ran
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

    def after(self, step: int, *, rollouts: Any = None) -> bool:
        """Everything after step `step`; False when the operator cancelled the run. `rollouts`: the step's
        RolloutBatchRecord, whose first `eval.rollout_samples` go to the rollouts table. The checkpoint is recorded as
        soon as it is saved and the operator's commands run before `after_checkpoint`: a failure there (SFT's move of a
        drained trainer, TrainerLost) skips neither, and a cancel ends the run without it."""
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
        if self.control is not None and not self.control.between_steps(step=step, checkpoint=lambda: self.save(step)):
            return False
        if saved_now is not None and self.after_checkpoint is not None:
            self.after_checkpoint(step, saved_now)
        return True
