"""How long a Monarch GRPO run takes to end (not a test): from its last step's metrics to the recipe's return, with the
run's own procs sent SIGTERM before their meshes stop (what a run does) beside Monarch's graceful stop of one mesh
after another (`Hosts.procs_are_children` forced off), interleaved rounds in one process.

    .venv/bin/python tests/bench/bench_teardown.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.engine.conftest import ARITHMETIC  # noqa: E402
from workers.engine.actors.hosts import Hosts  # noqa: E402
from workers.engine.config import load_config  # noqa: E402
from workers.engine.metrics import MemorySink, Recorder  # noqa: E402
from workers.engine.models.tiny import make_tiny_model  # noqa: E402
from workers.engine.recipes.grpo_monarch import train_grpo_monarch  # noqa: E402


class LastRecordTime(MemorySink):
    last_metric_at = 0.0  # perf_counter seconds of the last metric written

    def write(self, record: dict) -> None:
        super().write(record)
        if record.get("kind") == "metric":
            self.last_metric_at = time.perf_counter()


def end_seconds(model: Path, root: Path, *, sigterm: bool) -> float:
    config = load_config(f"recipe: grpo\nmodel: {{path: '{model}'}}\n", overrides=[
        *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "trainer.ranks=1", "generator.replicas=1",
        "trainer.steps=2", "trainer.batch_size=4", "grpo.group_size=2", "eval.every_steps=0",
        f"checkpoint.folder={root / 'checkpoints'}", "telemetry.console=false", "trainer.threads_per_process=1"])
    sink = LastRecordTime()
    original = Hosts.procs_are_children
    if not sigterm:
        Hosts.procs_are_children = property(lambda self: False)
    try:
        train_grpo_monarch(config, Recorder([sink]))
        return time.perf_counter() - sink.last_metric_at
    finally:
        Hosts.procs_are_children = original


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        model = make_tiny_model(root / "model", family="qwen3")
        seconds: dict[str, list[float]] = {"sigterm": [], "graceful": []}
        for round_ in range(args.rounds):
            for name in ("graceful", "sigterm") if round_ % 2 else ("sigterm", "graceful"):
                seconds[name].append(end_seconds(model, root / f"{name}-{round_}", sigterm=name == "sigterm"))
                print(f"round {round_} {name}: {seconds[name][-1]:.2f} s", flush=True)
    ratios = [g / s for g, s in zip(seconds["graceful"], seconds["sigterm"])]
    print(f"run end, last metric to return: sigterm {statistics.median(seconds['sigterm']):.2f} s, graceful "
          f"{statistics.median(seconds['graceful']):.2f} s; graceful / sigterm per round "
          f"{', '.join(f'{r:.1f}' for r in ratios)}")


if __name__ == "__main__":
    main()
