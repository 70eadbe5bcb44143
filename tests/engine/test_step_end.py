"""The end of a step, as every recipe ends one (`StepEnd.after`): a skipped update is checked before the step's eval
and checkpoint, and an error an operator's command met that the run cannot go on from ends the run once every command
of the step has run and been reported, whether or not the run was cancelled in them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.fake_fleet import grpo_config
from tests.engine.test_controller_operator import _operator
from tests.engine.test_run_control import FakeChannel
from workers.engine.fields import ConfigError
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.run_control import RunControl
from workers.engine.step_end import StepEnd
from workers.engine.training import UPDATE_SKIPPED, RunDiverged

TRAINED, SKIPPED = {UPDATE_SKIPPED: 0.0}, {UPDATE_SKIPPED: 1.0}


class Seen:
    """What a StepEnd did, in order: ("eval" | "checkpoint" | "commands" | "after_checkpoint", step)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def evaluate(self, step: int) -> int:
        self.calls.append(("eval", step))
        return step

    def checkpoint(self, step: int) -> Path:
        self.calls.append(("checkpoint", step))
        return Path(f"ckpt/{step}")

    def between_steps(self, *, step: int, checkpoint) -> bool:  # noqa: ANN001
        self.calls.append(("commands", step))
        return True

    def after_checkpoint(self, step: int, path: Path) -> None:
        self.calls.append(("after_checkpoint", step))


def test_a_skipped_update_is_checked_before_the_steps_eval_checkpoint_and_commands():
    """The check every recipe made before `after`, now its first part: the row's last skipped step ends the run before
    its eval, checkpoint and commands (a diverged step's weights are not saved); a trained step between starts the
    count again."""
    config = grpo_config(eval="{every_steps: 1}", checkpoint="{every_steps: 1}",
                         trainer="{steps: 9, max_skipped_updates: 2}")
    sink, seen = MemorySink(), Seen()
    end = StepEnd(config=config, recorder=Recorder([sink]), evaluate=seen.evaluate, checkpoint=seen.checkpoint,
                  control=seen, after_checkpoint=seen.after_checkpoint)
    assert [end.after(1, metrics=SKIPPED), end.after(2, metrics=TRAINED), end.after(3, metrics=SKIPPED)] == [True] * 3
    assert seen.calls == [(part, step) for step in (1, 2, 3)
                          for part in ("eval", "checkpoint", "commands", "after_checkpoint")]
    seen.calls.clear()
    with pytest.raises(RunDiverged, match="NaN or infinite for 2 steps in a row from step 3: the run diverged"):
        end.after(4, metrics=SKIPPED)
    assert seen.calls == [], "neither the diverged step's eval, nor its checkpoint, nor its commands"
    assert end.saved == Path("ckpt/3") and end.last_eval == 3
    said = [(e["step"], e["text"].split(":")[0]) for e in sink.events("message")]
    assert said == [(1, "the gradients of step 1 were NaN or infinite"),
                    (3, "the gradients of step 3 were NaN or infinite")]


def _ending_step(cancel: bool) -> tuple[StepEnd, FakeChannel, list, ConfigError]:
    """A StepEnd wired as the Monarch recipes wire it (the Operator's commands through a RunControl, its
    `raise_run_ending` as `run_ending`), with this step's commands queued: a new generator replica whose warm-up meets a
    refused model folder, a replica removed, a checkpoint asked for, and (`cancel`) a cancel."""
    fleet, operator = _operator()
    refused = ConfigError.on("model.path", "config.json is not JSON")

    def prepare(replica):  # noqa: ANN001, ANN202
        raise refused

    fleet.supervisor.prepare = prepare
    channel = FakeChannel()
    control = RunControl(channel, poll_seconds=0.0)
    control.operator = operator.operate
    moved: list = []
    end = StepEnd(config=grpo_config(checkpoint="{every_steps: 2}", trainer="{steps: 9}"), recorder=fleet.recorder,
                  evaluate=lambda step: None, checkpoint=lambda step: Path(f"ckpt/{step}"), control=control,
                  after_checkpoint=lambda step, path: moved.append(step), run_ending=operator.raise_run_ending)
    assert end.after(1, metrics=TRAINED) and channel.outcomes == [], "nothing met: the run goes on"
    channel.push("placement_change", {"action": "add", "role": "generator", "host": "c"})
    channel.push("placement_change", {"action": "remove", "role": "generator", "replica": 1})
    channel.push("checkpoint")
    if cancel:
        channel.push("cancel")
    return end, channel, moved, refused


@pytest.mark.parametrize("cancel", [False, True])
def test_an_error_a_command_met_ends_the_run_once_every_command_of_the_step_ran(cancel: bool):
    """Cancelled or not, the step's every command runs and is reported, then the error escapes `after` (the step loop
    does not catch it: the run ends with it), before the move a checkpoint would have led to (SFT's drained trainer):
    the run ends anyway. Before, each Monarch loop called `Operator.raise_run_ending` itself after `after`."""
    end, channel, moved, refused = _ending_step(cancel)
    with pytest.raises(ConfigError) as ended:
        end.after(2, metrics=TRAINED)
    assert ended.value is refused
    assert channel.outcomes == [
        ("placement_change", f"the run ends: {refused}"),
        ("placement_change", {"action": "remove", "role": "generator", "replica": 1, "host": None,
                              "plan": {"0": "a"}}),
        ("checkpoint", {"step": 2, "path": "ckpt/2"}),
        *([("cancel", {"step": 2, "path": "ckpt/2"})] if cancel else []),
    ]
    assert end.saved == Path("ckpt/2") and moved == []
