"""SFT on Monarch over two hosts that are real Monarch worker processes on this machine: a drain of the trainer's
host moves it at the next checkpoint. (In its own file: multi-host runs need Monarch's TCP transport, chosen by the
session's first Monarch call, so conftest runs these first.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_monarch_sft import _config
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.recipes.sft import train_sft


class DrainAfterFirstStep:
    """An operator who drains host0, where the trainer's ranks are, after step 1."""

    def __init__(self) -> None:
        self.control = None
        self.outcome = None

    def poll(self, handler) -> int:  # noqa: ANN001
        if self.control._step != 1 or self.outcome is not None:
            return 0
        self.outcome = handler("load_redirect", {"action": "drain", "host": "host0"})
        return 1


@pytest.mark.slow
def test_a_drained_trainer_host_moves_the_sft_trainer_at_the_next_checkpoint(tiny_trainable_qwen3: Path,
                                                                             tmp_path: Path) -> None:
    """Two worker-process hosts; both ranks on host0. Drained after step 1, the trainer moves to host1 at the step-2
    checkpoint, with nothing lost: the run's losses equal one process's."""
    from workers.engine.actors.hosts import parse_workers
    from workers.engine.actors.local_workers import environment_value, local_workers
    from workers.engine.recipes.sft_monarch import train_sft_monarch
    from workers.engine.run_control import RunControl

    every = ("trainer.steps=4", "checkpoint.every_steps=2", "eval.every_steps=0")
    one = train_sft(_config(tiny_trainable_qwen3, tmp_path / "one", *every), Recorder())
    config = _config(tiny_trainable_qwen3, tmp_path / "drained", *every, "placement.backend=monarch",
                     "placement.local_hosts=2", "trainer.ranks=2", "placement.trainer.procs_per_host=2")
    sink, script = MemorySink(), DrainAfterFirstStep()
    with local_workers(count=2, log_dir=tmp_path / "workers") as workers:
        control = RunControl(script, poll_seconds=0.0)
        script.control = control
        result = train_sft_monarch(config, Recorder([sink]), control=control,
                                   workers=parse_workers(environment_value(workers)))
    assert script.outcome["trainer_ranks"] == [0, 1] and script.outcome["moves_at"] == "the next checkpoint"
    assert sink.events("meshes_ready")[0]["trainer_hosts"] == ["host0"]
    [moved] = sink.events("redirect_finished")
    assert moved["step"] == 2 and moved["moved_roles"] == {"trainer": {"0": "host1", "1": "host1"}}
    first_pids = sink.events("meshes_ready")[0]["trainer_pids"]
    assert moved["from_hosts"] == ["host0"] and set(moved["pids"]).isdisjoint(first_pids)
    assert result.step == 4 and result.losses == pytest.approx(one.losses, abs=1e-5)
    assert sink.series("faults/migrations")[-1] == (4, 1)
