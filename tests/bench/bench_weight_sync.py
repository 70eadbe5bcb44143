"""What a weight sync costs (not a test): every trainer rank staging its part for the generators' inboxes to read over
Monarch's RDMA (what a run does, `actors/weight_outbox.py`) beside trainer rank 0 sending the whole state dict to
each inbox in turn as an endpoint message (what runs did before), for several model sizes, trainer ranks and
generator replicas, interleaved rounds in one process.

For each case: `path` is the seconds the trainer's side spends before it may train on (the sync's cost on the step's
path), `delivered` the seconds until every inbox holds the weights.

    .venv/bin/python tests/bench/bench_weight_sync.py [--rounds 3] [--sizes 1,15,100] [--replicas 1,2,4] [--ranks 1,2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from monarch.actor import Actor, endpoint  # noqa: E402

from workers.engine.actors.procs import set_proc_threads, spawn_procs  # noqa: E402
from workers.engine.actors.weight_outbox import WeightOutbox, WeightPublication, read_publication  # noqa: E402


def fake_state(million_params: float) -> dict[str, torch.Tensor]:
    """A decoder-like state dict of fp32 tensors: 24 blocks of 4 square matrices, an embedding and a head."""
    width = max(64, int((million_params * 1e6 / (24 * 4 + 2 * 8)) ** 0.5))
    g = torch.Generator().manual_seed(0)
    state = {"embed": torch.randn(8 * width, width, generator=g), "head": torch.randn(8 * width, width, generator=g)}
    for layer in range(24):
        for name in ("q", "k", "v", "o"):
            state[f"layers.{layer}.{name}"] = torch.randn(width, width, generator=g)
    return state


class BenchTrainerRank(Actor):
    def __init__(self, million_params: float) -> None:
        set_proc_threads()
        self.state = fake_state(million_params)
        self.outboxes: dict[int, WeightOutbox] = {}  # by world size: each case stages into its own memory, as a run

    @endpoint
    def stage(self, rank: int, world: int) -> Any:
        outbox = self.outboxes.setdefault(world, WeightOutbox())
        return outbox.stage(self.state, rank=rank, world=world, sharded=False, reuse=True)

    @endpoint
    def push(self, inboxes: list[Any], publication: int) -> float:
        """The earlier path: the whole state dict to each inbox in turn (a send serialises it at once)."""
        start = time.perf_counter()
        state = {name: tensor.clone() for name, tensor in self.state.items()}  # full_model_state's copy
        for inbox in inboxes:
            inbox.put.call_one(publication, state)
        return time.perf_counter() - start


class BenchInbox(Actor):
    def __init__(self) -> None:
        set_proc_threads()
        self.held: dict[int, dict[str, torch.Tensor]] = {}

    @endpoint
    def put(self, publication: int, weights: dict[str, torch.Tensor]) -> None:
        self.held = {publication: weights}  # the newest only, as a generator takes them

    @endpoint
    def fetch(self, publication: WeightPublication) -> float:
        weights, seconds = read_publication(publication)
        self.held = {publication.number: weights}
        return seconds

    @endpoint
    def holds(self, publication: int) -> bool:
        return publication in self.held


def rdma_sync(trainer: Any, ranks: int, inboxes: list[Any], publication: int) -> tuple[float, float]:
    start = time.perf_counter()
    parts = [trainer.slice(procs=r).stage.call_one(r, ranks) for r in range(ranks)]
    parts = [p.get() for p in parts]
    path = time.perf_counter() - start
    sent = WeightPublication(number=publication, version=publication, parts=tuple(p for p in parts if p is not None),
                             read_timeout_s=600)
    for fetched in [inbox.fetch.call_one(sent) for inbox in inboxes]:
        fetched.get()
    return path, time.perf_counter() - start


def push_sync(trainer: Any, inboxes: list[Any], publication: int) -> tuple[float, float]:
    start = time.perf_counter()
    trainer.slice(procs=0).push.call_one(inboxes, publication).get()
    path = time.perf_counter() - start
    for inbox in inboxes:  # the trainer's sends and these questions come from two senders: ask until it holds them
        while not inbox.holds.call_one(publication).get():
            time.sleep(0.002)
    return path, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="1,15,100", help="millions of fp32 parameters")
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--ranks", default="1,2")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    replica_counts = [int(r) for r in args.replicas.split(",")]
    rank_counts = [int(r) for r in args.ranks.split(",")]
    results: dict[tuple, list[tuple[float, float]]] = {}
    publication = 0
    for size in sizes:
        trainer_procs = spawn_procs(max(rank_counts), threads=1)
        inbox_procs = spawn_procs(max(replica_counts), threads=1)
        try:
            trainer = trainer_procs.spawn("bench_trainer", BenchTrainerRank, size)
            inboxes_mesh = inbox_procs.spawn("bench_inbox", BenchInbox)
            inboxes = [inboxes_mesh.slice(procs=i) for i in range(max(replica_counts))]
            for ranks in rank_counts:  # warm: each case's memory and registrations, as a run's first sync
                trainer.slice(procs=0).stage.call_one(0, ranks).get()
            for _ in range(args.rounds):
                for replicas in replica_counts:
                    for ranks in rank_counts:
                        publication += 1
                        results.setdefault((size, replicas, ranks, "rdma"), []).append(
                            rdma_sync(trainer, ranks, inboxes[:replicas], publication))
                    publication += 1
                    results.setdefault((size, replicas, 1, "push"), []).append(
                        push_sync(trainer, inboxes[:replicas], publication))
        finally:
            trainer_procs.stop().get()
            inbox_procs.stop().get()
    print(f"{'M params':>8} {'replicas':>8} {'path':>5} {'ranks':>5} {'on path s':>10} {'delivered s':>11} "
          f"{'path / push':>11} {'delivered / push':>16}")
    for size in sizes:
        for replicas in replica_counts:
            push = results[(size, replicas, 1, "push")]
            push_path, push_done = (statistics.median(v[i] for v in push) for i in (0, 1))
            print(f"{size:8g} {replicas:8d} {'push':>5} {1:5d} {push_path:10.4f} {push_done:11.4f} {'1.00':>11} "
                  f"{'1.00':>16}")
            for ranks in rank_counts:
                rdma = results[(size, replicas, ranks, "rdma")]
                path, done = (statistics.median(v[i] for v in rdma) for i in (0, 1))
                print(f"{size:8g} {replicas:8d} {'rdma':>5} {ranks:5d} {path:10.4f} {done:11.4f} "
                      f"{path / push_path:11.2f} {done / push_done:16.2f}")


if __name__ == "__main__":
    main()
