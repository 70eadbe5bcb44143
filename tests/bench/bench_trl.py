"""GRPO throughput side by side (not a test): this engine vs TRL's GRPOTrainer, and our async vs sync.

    .venv/bin/python tests/bench/bench_trl.py [--steps 12] [--warmup 2] [--threads 2] [--repeats 3] [--out var/bench_trl]

Needs `trl` (the `bench` extra). Every configuration runs in its own fresh interpreter, one
after the other, on the same tiny random Qwen3 folder (`workers.engine.models.tiny`), the
same `a+b=` arithmetic prompts, group size, batch, max response length, learning rate and
total torch thread count (`--threads`, split over the processes that compute) and precision (`--precision`):

  trl            TRL GRPOTrainer, one process x threads. Offline: HF_HUB_OFFLINE=1, the local
                 folder, a datasets.Dataset built in memory, no vLLM, report_to none. One
                 generation and one optimizer step per step over all B*G completions (loss
                 `dapo` = token-mean, beta 0: no reference model, like ours).
  ours_local     recipes/grpo.py sync, one process x threads (same process layout as TRL).
  ours_sync      recipes/grpo_monarch.py, trainer proc + generator proc x threads/2 each.
  ours_sync_in_trainer  the same with generator.in_trainer: no generator proc, the trainer's proc generates from a
                 copy of its weights, x threads (one computing process, like TRL's and ours_local).
  ours_sync_in_trainer_dp  the same with trainer.ranks=2 x threads/2 each: each rank generates its share of the
                 groups and trains on it (data parallel), so no thread waits on another proc's turn.
  ours_async     the same with grpo.mode=async, max_policy_age=1 (--max-policy-age): generation overlaps training.
  ours_async2    the same with max_policy_age=2: up to 3 batches in flight (new weights reach a replica between
                 requests, through its weight inbox, without waiting behind the requests queued there).
  ours_pipelined the same with grpo.mode=pipelined: on-policy, each step generated in
                 --pipeline-chunks requests, each trained on while the next one generates.
  ours_sync_turns (reference, not in the equal-total comparison) ours_sync with each proc at all T threads:
                 in sync mode the trainer and the generator take turns, so at most T threads are busy at once.

Start-up = wall seconds from launching the configuration's interpreter to the end of its first
step (interpreter and imports, model and data loading, procs, the first step), printed in its own
table with each phase: `imports` until the recipe (or GRPOTrainer) is called, then for ours the
recipe's startup_phase events (placing, spawning procs, loading the model, each role's procs ready
after so many seconds, side by side) and the first step.

Train tokens/s = tokens in the rows the trainer ran forward+backward on (padded prompt +
response rectangle: ours from the trainer's own metrics, TRL's counted by a forward hook on
grad-enabled forwards), divided by the wall time from the end of the last warm-up step to
the end of the last step; generation, reward, weight sync and the optimizer are all inside.
These machines are noisy (other suites share the 2 cores): with --repeats N every
configuration runs once per round, ratios are taken within each round and the median
over rounds is printed with every round's value; the table shows each configuration's
median run. Single processes with 2 threads swing the most under load (OpenMP threads
wait for each other when a core is taken); the one-thread rows are the steadiest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "WANDB_DISABLED": "true", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
               "DISABLE_MLFLOW_INTEGRATION": "TRUE", "HF_HUB_DISABLE_TELEMETRY": "1"}

# name -> (kind, threads per computing process as a function of the --threads total T)
RUNS = {
    "trl": ("trl", lambda t: t),
    "ours_local": ("local", lambda t: t),
    "ours_sync": ("monarch_sync", lambda t: max(1, t // 2)),
    "ours_sync_in_trainer": ("monarch_sync_in_trainer", lambda t: t),  # one proc generates and trains, as TRL's
    "ours_sync_in_trainer_dp": ("monarch_sync_in_trainer_dp", lambda t: max(1, t // 2)),  # two ranks, each both
    "ours_async": ("monarch_async", lambda t: max(1, t // 2)),
    "ours_async2": ("monarch_async2", lambda t: max(1, t // 2)),
    "ours_pipelined": ("monarch_pipelined", lambda t: max(1, t // 2)),
    # reference rows, not part of the equal-total comparison: one process with T/2 threads
    # (on a shared 2-core machine one thread often beats two, for both frameworks)
    "trl_half": ("trl", lambda t: max(1, t // 2)),
    "ours_local_half": ("local", lambda t: max(1, t // 2)),
    # reference row: in sync mode the trainer and the generator take turns, so each proc gets all T threads
    # (2T configured, at most T busy at once); not part of the equal-total comparison
    "ours_sync_turns": ("monarch_sync", lambda t: t),
}
DEFAULT_RUNS = "trl,ours_local,ours_sync,ours_sync_in_trainer,ours_sync_in_trainer_dp,ours_async,ours_async2,ours_pipelined,trl_half,ours_local_half"


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- workers


def _ours(args: argparse.Namespace, mode: str, threads: int) -> dict:
    from workers.engine.config import load_config
    from workers.engine.metrics import Recorder

    monarch = mode.startswith("monarch")
    in_trainer = mode.startswith("monarch_sync_in_trainer")
    ranks = 2 if mode == "monarch_sync_in_trainer_dp" else 1
    _set_threads(1 if monarch else threads)  # a Monarch controller only routes and tokenizes
    overrides = [
        f"data.max_operand={args.max_operand}", "data.eval_size=64", f"generator.max_new_tokens={args.max_new_tokens}",
        f"trainer.steps={args.steps}", f"trainer.batch_size={args.prompts}", f"trainer.micro_batch_size={args.prompts * args.group}",
        f"grpo.group_size={args.group}", f"trainer.optimizer.lr={args.lr}", "eval.every_steps=0", "eval.rollout_samples=0",
        f"checkpoint.folder={Path(args.out) / ('ckpt_' + mode)}", "telemetry.console=false",
        f"trainer.threads_per_process={threads}", "trainer.device=cpu", "grpo.loss_aggregation=token",
        *(["trainer.mixed_precision=bf16"] if args.precision == "bf16" else []),  # the default is off
        f"grpo.packing={'true' if args.packing == 'on' else 'false'}",
    ]
    if monarch:
        overrides += ["placement.backend=monarch", f"trainer.ranks={ranks}", "generator.replicas=1"]
    if mode == "monarch_async":
        overrides += ["grpo.mode=async", f"grpo.max_policy_age={args.max_policy_age}"]
    elif mode == "monarch_async2":
        overrides += ["grpo.mode=async", "grpo.max_policy_age=2"]
    elif mode == "monarch_pipelined":
        overrides += ["grpo.mode=pipelined", f"grpo.pipeline_chunks={args.pipeline_chunks}"]
    elif in_trainer:  # no generator proc: the trainer's rank generates
        overrides = [o for o in overrides if o != "generator.replicas=1"] + ["grpo.mode=sync", "generator.in_trainer=true"]
    else:
        overrides += ["grpo.mode=sync"]
    config = load_config(f"recipe: grpo\nmodel: {{path: '{args.model}'}}\n", overrides=overrides)

    steps: dict[int, dict[str, float]] = {}
    ends: dict[int, float] = {}
    startup: dict[str, object] = {"imports_s": time.time() - args.launched_at, "phases": {}, "parts": {}}

    class StepSink:
        def write(self, record: dict) -> None:
            if record["kind"] == "metric":
                if record["step"] not in ends:
                    ends[record["step"]] = time.perf_counter()  # first metric of a step: the step just ended
                    if record["step"] == 1:
                        startup["first_step_end_s"] = time.time() - args.launched_at
                steps.setdefault(record["step"], {})[record["key"]] = record["value"]
            elif record["kind"] == "event" and record["name"] == "startup_phase":
                if record["phase"] == "ready":
                    startup["ready_s"] = time.time() - args.launched_at
                if phases := startup["phases"]:
                    previous = list(phases)[-1]
                    phases[previous] = record["previous_s"]
                    startup["parts"].update(record.get("previous_parts") or {})
                startup["phases"][record["phase"]] = None

        def close(self) -> None:
            pass

    if monarch:
        from workers.engine.recipes.grpo_monarch import train_grpo_monarch as train
    else:
        from workers.engine.recipes.grpo import train_grpo as train
    startup["imports_s"] = time.time() - args.launched_at
    train(config, Recorder([StepSink()]))
    measured = [s for s in sorted(steps) if s > args.warmup]
    train_tokens = sum(round(steps[s]["data/train_tokens"]) for s in measured)
    return {
        "processes": (f"{ranks} trainer+control" if in_trainer else "trainer+generator+control") if monarch else "1 process",
        "threads": ("+".join([str(threads)] * ranks) if in_trainer else f"{threads}+{threads}") if monarch else str(threads),
        "steps": len(measured),
        "wall_s": ends[measured[-1]] - ends[args.warmup],
        "train_tokens": train_tokens,
        "response_len": sum(steps[s]["response_length/mean"] for s in measured) / len(measured),
        "reward": sum(steps[s]["reward/mean"] for s in measured) / len(measured),
        "generate_s_per_step": sum(steps[s].get("time/generate_s", steps[s].get("time/generate_wait_s", 0.0))
                                   for s in measured) / len(measured),
        "train_s_per_step": sum(steps[s]["time/train_s"] for s in measured) / len(measured),
        "weight_sync_share": sum(steps[s].get("time/weight_sync_s", 0.0) for s in measured)
        / sum(steps[s]["time/step_s"] for s in measured),
        "startup": startup,
    }


def _trl(args: argparse.Namespace, threads: int) -> dict:
    _set_threads(threads)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    startup: dict[str, object] = {"imports_s": time.time() - args.launched_at}

    from workers.engine.config import ARITHMETIC_TRAIN_SIZE
    from workers.engine.rewards import exact_math
    from workers.engine.tasks import Problem
    from workers.engine.tasks.arithmetic import arithmetic_task

    task = arithmetic_task(max_operand=args.max_operand, train_size=ARITHMETIC_TRAIN_SIZE, eval_size=64, seed=0)
    dataset = Dataset.from_list([{"prompt": p.messages, "answer": p.answer} for p in task.train])

    def exact_math_reward(prompts, completions, answer, **kwargs) -> list[float]:  # noqa: ANN001
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [exact_math(Problem(messages=[], response=a, answer=a), t, True) for t, a in zip(texts, answer)]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    counted = {"tokens": 0}

    def count_tokens(module, fargs, fkwargs):  # noqa: ANN001, ANN202
        ids = fkwargs.get("input_ids", fargs[0] if fargs else None)
        if ids is not None and torch.is_grad_enabled() and module.training:
            counted["tokens"] += ids.numel()

    model.register_forward_pre_hook(count_tokens, with_kwargs=True)

    per_step: list[tuple[float, int]] = []
    lengths: list[float] = []
    rewards: list[float] = []

    class Timing(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):  # noqa: ANN001, ANN201
            per_step.append((time.perf_counter(), counted["tokens"]))
            startup.setdefault("first_step_end_s", time.time() - args.launched_at)

        def on_log(self, targs, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    rows = args.prompts * args.group
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trl"), max_steps=args.steps, per_device_train_batch_size=rows,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=args.group,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
        max_grad_norm=1.0, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        use_vllm=False, use_cpu=True, bf16=args.precision == "bf16", fp16=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0, log_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=exact_math_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timing()])
    startup["ready_s"] = time.time() - args.launched_at
    startup["phases"] = {"model, data and GRPOTrainer": startup["ready_s"] - startup["imports_s"]}
    trainer.train()
    first, last = per_step[args.warmup - 1], per_step[-1]
    measured_lengths = lengths[args.warmup:] or lengths
    return {
        "processes": "1 process",
        "threads": str(threads),
        "steps": len(per_step) - args.warmup,
        "wall_s": last[0] - first[0],
        "train_tokens": last[1] - first[1],
        "response_len": sum(measured_lengths) / max(len(measured_lengths), 1),
        "reward": sum(rewards[args.warmup:]) / max(len(rewards[args.warmup:]), 1),
        "startup": startup,
    }


def worker(args: argparse.Namespace) -> None:
    kind, threads_of = RUNS[args.worker]
    threads = threads_of(args.threads)
    result = _trl(args, threads) if kind == "trl" else _ours(args, kind, threads)
    result["train_tokens_per_s"] = result["train_tokens"] / result["wall_s"]
    result["s_per_step"] = result["wall_s"] / result["steps"]
    Path(args.result).write_text(json.dumps(result))


# --------------------------------------------------------------------------- controller


def _run_one(name: str, args: argparse.Namespace, model: Path, out: Path) -> dict | None:
    kind, threads_of = RUNS[name]
    threads = threads_of(args.threads)
    result_file = out / f"{name}.json"
    result_file.unlink(missing_ok=True)
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    forwarded = {k: v for k, v in vars(args).items()
                 if k not in ("worker", "model", "result", "runs", "repeats", "launched_at") and v is not None}
    cmd = [sys.executable, __file__, "--worker", name, "--model", str(model), "--result", str(result_file),
           *[f"--{k.replace('_', '-')}={v}" for k, v in forwarded.items()], f"--launched-at={time.time()}"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0 or not result_file.exists():
        print(f"{name}: failed (exit {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}", file=sys.stderr)
        return None
    result = json.loads(result_file.read_text())
    result["process_s"] = time.perf_counter() - started
    print(f"  {name}: {result['train_tokens_per_s']:.0f} train tokens/s ({result['s_per_step']:.3f} s/step, "
          f"whole process {result['process_s']:.0f} s)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in total for each configuration")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--max-policy-age", type=int, default=1)
    parser.add_argument("--pipeline-chunks", type=int, default=4, help="ours_pipelined: generation requests per step")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: both compute in bfloat16 on float32 weights (TRL bf16=True, our "
                             "trainer.mixed_precision=bf16, whose generator holds bfloat16 weights)")
    parser.add_argument("--packing", choices=["on", "off"], default="on",
                        help="ours: grpo.packing (each group's prompt once, padding-free rows)")
    parser.add_argument("--hidden", type=int, default=64, help="tiny model width")
    parser.add_argument("--layers", type=int, default=2, help="tiny model depth")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="comma-separated subset of " + ",".join(RUNS))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all runs, interleaved; the median is reported")
    parser.add_argument("--out", default="var/bench_trl")
    parser.add_argument("--worker", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1 or args.steps <= args.warmup:
        parser.error("need --warmup >= 1 and --steps > --warmup")
    if args.worker:
        worker(args)
        return
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")

    for key, value in OFFLINE_ENV.items():
        os.environ[key] = value
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    from workers.engine.models.tiny import make_tiny_model

    model = make_tiny_model(out / f"tiny-qwen3-h{args.hidden}-l{args.layers}", family="qwen3", hidden_size=args.hidden,
                            num_layers=args.layers, intermediate_size=2 * args.hidden)
    load_before = os.getloadavg()
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(args.repeats):
        print(f"round {round_index + 1}/{args.repeats}", flush=True)
        for name in names:
            result = _run_one(name, args, model, out)
            if result is not None:
                rounds[name].append(result)
    results = {}
    for name, runs in rounds.items():
        if runs:
            ordered = sorted(runs, key=lambda r: r["train_tokens_per_s"])
            results[name] = {**ordered[(len(ordered) - 1) // 2],  # the (lower) median run
                             "every_round_tokens_per_s": [round(r["train_tokens_per_s"]) for r in runs]}

    print()
    print(f"tiny Qwen3 hidden={args.hidden} layers={args.layers} vocab=320 | {args.prompts} prompts x {args.group} "
          f"completions, <= {args.max_new_tokens} new tokens | {args.precision} | {args.steps} steps, first {args.warmup} not timed | "
          f"{args.threads} torch threads in total | median run of {args.repeats} | torch {torch.__version__}")
    print(f"machine: {os.cpu_count()} cores, load average (1 min) {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
          "monarch runs: a trainer and a generator proc compute, a control proc (data, reward, buffer) and the "
          "controller mostly wait")
    header = (f"{'run':<20} {'processes':<26} {'threads':>7} {'steps':>5} {'s/step':>7} {'gen s':>6} {'train s':>7} "
              f"{'tokens/step':>11} {'resp len':>8} {'reward':>6} {'train tok/s':>11} {'seqs/s':>6} {'sync %':>6}")
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        gen = f"{r['generate_s_per_step']:.3f}" if "generate_s_per_step" in r else "-"
        train = f"{r['train_s_per_step']:.3f}" if "train_s_per_step" in r else "-"
        print(f"{name:<20} {r['processes']:<26} {r['threads']:>7} {r['steps']:>5} {r['s_per_step']:>7.3f} {gen:>6} {train:>7} "
              f"{r['train_tokens'] / r['steps']:>11.0f} {r['response_len']:>8.1f} {r['reward']:>6.3f} {r['train_tokens_per_s']:>11.0f} "
              f"{r['steps'] * args.prompts * args.group / r['wall_s']:>6.1f} "
              + (f"{100 * r['weight_sync_share']:>5.1f}%" if "weight_sync_share" in r else f"{'-':>6}"))
    if args.repeats > 1:
        for name, r in results.items():
            print(f"  {name}: train tok/s by round {r['every_round_tokens_per_s']}")
    print()

    print("start-up: wall seconds from launching the interpreter to the end of the first step (median over rounds; "
          "imports: until the recipe or GRPOTrainer is called; ready: setup done; phases of the median run)")
    startup_header = f"{'run':<20} {'first step':>10} {'/ trl':>6} {'imports':>7} {'ready':>6}  phases"
    print(startup_header)
    print("-" * len(startup_header))
    starts: dict[str, float] = {}
    for name, runs in rounds.items():
        timed = sorted((r for r in runs if "first_step_end_s" in r.get("startup", {})),
                       key=lambda r: r["startup"]["first_step_end_s"])
        if not timed:
            continue
        median = timed[(len(timed) - 1) // 2]["startup"]
        starts[name] = median["first_step_end_s"]
        phases = " · ".join(f"{phase.replace('_', ' ')} {seconds:.1f}" for phase, seconds in median.get("phases", {}).items()
                            if seconds is not None)
        if median.get("parts"):
            phases += " (ready after: " + ", ".join(f"{k} {v:.1f}" for k, v in median["parts"].items()) + ")"
        if "ready_s" in median:
            phases += f" · first step {starts[name] - median['ready_s']:.1f}"
        versus = f"{starts[name] / starts['trl']:.2f}" if "trl" in starts else "-"
        print(f"{name:<20} {starts[name]:>10.1f} {versus:>6} {median['imports_s']:>7.1f} {median.get('ready_s', 0.0):>6.1f}  "
              f"{phases or '-'}")
    if "trl" in starts:
        worst = max((n for n in starts if n.startswith("ours_") and not n.endswith("_half")), key=starts.get, default=None)
        if worst is not None:
            value = starts[worst] / starts["trl"]
            print(f"slowest start of ours ({worst}) / trl: {value:.2f}x  goal <= 2x: {'met' if value <= 2 else 'NOT met'}"
                  f"; moonshot <= 1x: {'met' if value <= 1 else 'not met'}")
    print()

    ratios: dict[str, dict] = {}

    def ratio(a: str, b: str, goal: float, note: str = "") -> None:
        """Median over rounds of a / b within each round (runs of one round are close in time)."""
        pairs = [(x["train_tokens_per_s"], y["train_tokens_per_s"]) for x, y in zip(rounds.get(a, []), rounds.get(b, []))]
        if len(rounds.get(a, [])) != args.repeats or len(rounds.get(b, [])) != args.repeats or not pairs:
            return
        per_round = [x / y for x, y in pairs]
        value = statistics.median(per_round)
        ratios[f"{a}/{b}"] = {"median": value, "by_round": per_round}
        spread = f" (rounds: {', '.join(f'{v:.2f}' for v in per_round)})" if len(per_round) > 1 else ""
        print(f"{a} / {b}: {value:.2f}x{spread}  goal >= {goal}x: {'met' if value >= goal else 'NOT met'}{note}")

    print(f"equal thread totals ({args.threads}):")
    ratio("ours_async", "trl", 2.0)
    ratio("ours_sync", "trl", 2.0)
    ratio("ours_sync_in_trainer", "trl", 2.0, " (sync, generating in the trainer's proc)")
    ratio("ours_sync_in_trainer", "ours_sync", 1.0)
    ratio("ours_sync_in_trainer_dp", "trl", 2.0, " (sync, two ranks each generating and training its share)")
    ratio("ours_sync_in_trainer_dp", "ours_sync_in_trainer", 1.0)
    ratio("ours_local", "trl", 2.0)
    ratio("ours_async", "ours_sync", 1.5)
    ratio("ours_async2", "ours_async", 1.0, " (max_policy_age 2 vs 1)")
    ratio("ours_pipelined", "ours_sync", 1.0, " (on-policy; overlap within a step)")
    print("one process each, T/2 threads each (reference):")
    ratio("ours_local_half", "trl_half", 2.0)
    ratio("ours_async", "trl_half", 2.0, " (ours with T threads in two procs, TRL with T/2)")
    print("sync mode with each proc at T threads, taking turns (reference):")
    ratio("ours_sync_turns", "trl", 2.0)
    ratio("ours_sync_turns", "ours_sync", 1.0)
    (out / "summary.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if v is not None},
                                                  "results": results, "ratios": ratios, "first_step_s": starts},
                                                 indent=2))


if __name__ == "__main__":
    main()
