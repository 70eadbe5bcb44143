"""What refusing a checkpoint of NaN or infinite values costs a load (not a test): `checkpoint_checks.values_problem`
(one aminmax over each weight and moment) beside torch.load alone and the whole `load_checkpoint`, with it and
without it, on a checkpoint of about `--mib` MiB of float32 weights and AdamW's two moments (3x that on disk).

    .venv/bin/python tests/bench/bench_checkpoint_checks.py [--mib 400] [--rounds 3] [--threads 0]

Each round times every form once, in turn (interleaved, so a slower moment of the machine falls on all of them); the
file is read once before the rounds, so every form reads it from the page cache. `--threads 0`: torch's default.
Prints each round's seconds, their median and least, then the ratios of each; `isfinite().all()` is the plain form of the check,
for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.engine import checkpoint  # noqa: E402
from workers.engine.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from workers.engine.checkpoint_checks import values_problem  # noqa: E402
from workers.engine.config import OptimizerConfig  # noqa: E402
from workers.engine.training import build_optimizer, build_scheduler  # noqa: E402

WIDTH = 2048  # each weight a WIDTH x WIDTH float32 matrix: 16 MiB


def stepped_model(mib: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Linear layers of about `mib` MiB of weights, after one AdamW step (so the optimizer holds both moments)."""
    layers = max(1, round(mib * 2**20 / (WIDTH * WIDTH * 4)))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    optimizer, scheduler = fresh_optimizer(model)
    model(torch.randn(2, WIDTH)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def fresh_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = build_optimizer(model, OptimizerConfig())
    return optimizer, build_scheduler(optimizer, OptimizerConfig(), total_steps=10)


def isfinite_all(state: dict) -> bool:
    """The plain form of the check: torch.isfinite over every weight and moment."""
    tensors = [*state["model"].values(), *(moment for moments in state["optimizer"]["state"].values()
                                           for name, moment in moments.items() if name != "step")]
    return all(bool(torch.isfinite(tensor).all()) for tensor in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=400, help="MiB of weights (the file holds 3x: AdamW's moments)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_checks_") as tmp:
        model, optimizer, scheduler = stepped_model(args.mib)
        path = save_checkpoint(Path(tmp) / "checkpoints", step=1, recipe="sft", model_state=model.state_dict(),
                               optimizer_state=optimizer.state_dict(), scheduler_state=scheduler.state_dict(),
                               progress={"step": 1, "data": {}}, model_folder=tmp, keep_last=1)
        state_file = path / "trainer.pt"
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
        print(f"checkpoint: {len(model)} weights of {WIDTH}x{WIDTH} float32, {weights:.0f} MiB of weights, "
              f"trainer.pt {state_file.stat().st_size / 2**20:.0f} MiB; torch threads {torch.get_num_threads()}")
        state = torch.load(state_file, map_location="cpu", weights_only=True)  # into the page cache
        assert values_problem(state, optimizer=optimizer) is None and isfinite_all(state)

        def whole_load() -> None:
            own_optimizer, own_scheduler = fresh_optimizer(model)
            load_checkpoint(path, model=model, optimizer=own_optimizer, scheduler=own_scheduler, recipe="sft")

        def load_without_values_check() -> None:
            checkpoint.values_problem = lambda state, *, optimizer: None
            try:
                whole_load()
            finally:
                checkpoint.values_problem = values_problem

        forms: dict[str, Callable[[], object]] = {
            "torch.load": lambda: torch.load(state_file, map_location="cpu", weights_only=True),
            "load_checkpoint before (no values check)": load_without_values_check,
            "load_checkpoint after (values check)": whole_load,
            "values check alone (aminmax)": lambda: values_problem(state, optimizer=optimizer),
            "isfinite().all() alone": lambda: isfinite_all(state),
        }
        seconds: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, form in forms.items():
                started = time.perf_counter()
                form()
                seconds[name].append(time.perf_counter() - started)

    width = max(len(name) for name in forms)
    print(f"{'':{width}}  " + "  ".join(f"round {i + 1:<3}" for i in range(args.rounds)) + "    median       min")
    for name, times in seconds.items():
        print(f"{name:{width}}  " + "  ".join(f"{t:8.3f} s" for t in [*times, statistics.median(times), min(times)]))
    for summary in (statistics.median, min):  # min: the round the machine's other work disturbed least
        of = {name: summary(times) for name, times in seconds.items()}
        before, after = of["load_checkpoint before (no values check)"], of["load_checkpoint after (values check)"]
        check, load = of["values check alone (aminmax)"], of["torch.load"]
        print(f"{summary.__name__}: load_checkpoint after / before {after / before:.2f} ({after - before:+.3f} s); "
              f"values check alone / torch.load {check / load:.2f}, / load_checkpoint before {check / before:.2f}; "
              f"load_checkpoint before / torch.load {before / load:.2f}, after / torch.load {after / load:.2f}; "
              f"isfinite().all() / values check {of['isfinite().all() alone'] / check:.1f}")


if __name__ == "__main__":
    main()
