"""The torch sampler's top_p draw side by side (not a test): the nucleus drawn from each row's top candidates
(`sampler.draw_in_nucleus`) against sorting the whole vocabulary first, on one CPU thread.

    .venv/bin/python tests/bench/bench_top_p.py [--rows 128] [--top-p 0.9] [--repeats 3]

Rows are softmax(randn x scale): scale 1 spreads the nucleus over most of the vocabulary (the whole-sort fallback),
scale 6 keeps it to a few tokens, like a trained model's next token mostly is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.engine.sampler import draw_in_nucleus, draw_tokens  # noqa: E402


def sort_whole_vocabulary(probs: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    return draw_tokens(torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0)), generator)


def milliseconds(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.rows} rows, top_p {args.top_p}, 1 thread, torch {torch.__version__}")
    print(f"{'vocabulary':>10} {'scale':>5} {'nucleus median':>14} {'whole sort ms':>13} {'nucleus draw ms':>15} {'ratio':>6}")
    for vocabulary in (320, 151_936):
        for scale in (1.0, 6.0):
            probs = torch.softmax(torch.randn(args.rows, vocabulary) * scale, dim=-1)
            nucleus = int((probs.sort(dim=-1, descending=True).values.cumsum(-1) < args.top_p).sum(-1).median()) + 1
            generator = torch.Generator().manual_seed(0)
            repeats = args.repeats if vocabulary > 10_000 else 100 * args.repeats
            whole = milliseconds(lambda: sort_whole_vocabulary(probs, args.top_p, generator), repeats)  # noqa: B023
            ours = milliseconds(lambda: draw_in_nucleus(probs, args.top_p, generator), repeats)  # noqa: B023
            print(f"{vocabulary:>10} {scale:>5.0f} {nucleus:>14} {whole:>13.2f} {ours:>15.2f} {whole / ours:>5.1f}x")


if __name__ == "__main__":
    main()
