"""Command line: `python -m workers.engine COMMAND ...`.

  train --config FILE [section.key=value ...]   validate, preflight, then run the recipe
  make-tiny-model --family qwen3 --out DIR      a tiny random model + byte tokenizer (HF folder)
  export --checkpoint PATH --out DIR            a checkpoint as an HF folder a new run can start from
  schema                                        the config's JSON Schema
  plan --config FILE [--gpus 3,12,48,192]       what a step will cost at each scale, and the best split
       [--device h100] [--model qwen3-1.7b] [--calibrate-from RUN.jsonl [--calibration-config FILE]] [--json]

Config and preflight problems print one `field: message` line each and exit with code 2
before any model is loaded or process started (what preflight only warns about prints as
`warning: field: message`, and the run goes on). torch is imported only after that. A file a
field names that the run refuses once it has started (a checkpoint's trainer.pt, the model's
weights, in the process or in a Monarch trainer rank) exits with code 2 the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from workers.engine.config import ConfigError, RunConfig, config_json_schema, load_config_file
from workers.engine.preflight import preflight

EXIT_CONFIG_ERROR = 2


def _print_config_error(exc: ConfigError) -> None:
    print(f"{exc.heading}:", file=sys.stderr)
    for error in exc.errors:
        print(f"  {error}", file=sys.stderr)


def load_and_check(path: str, overrides: Sequence[str]) -> RunConfig:
    """The config, validated and preflighted; preflight's warnings printed (`warning: field: message`)."""
    config = load_config_file(path, overrides=overrides)
    for warning in preflight(config):
        print(f"warning: {warning}", file=sys.stderr)
    return config


def _control_plane_sink(config: RunConfig):  # noqa: ANN202 - ControlPlaneSink | None
    """Report to the control plane when a launch backend started this process (FORGEBOARD_* variables)."""
    from workers.engine.control_plane import ControlPlaneSink, ControlPlaneTarget
    from workers.engine.env import SPOOL_DIR_ENV, read_env

    target = ControlPlaneTarget.from_environment()
    if target is None:
        return None
    spool = read_env(SPOOL_DIR_ENV) or f".forgeboard-spool-{target.run_id}"
    return ControlPlaneSink(target, spool_dir=spool, flush_seconds=config.telemetry.flush_seconds)


def _run_control(sink):  # noqa: ANN001, ANN202 - ControlPlaneSink -> RunControl
    """Operator commands for this run, pulled between steps; executed once (ledger beside the spool)."""
    from workers.engine.command_channel import CommandChannel
    from workers.engine.run_control import RunControl

    return RunControl(CommandChannel(sink.target, ledger=sink.spool / "commands.json"))


def _train(args: argparse.Namespace) -> int:
    try:
        config = load_and_check(args.config, args.overrides)
    except ConfigError as exc:
        _print_config_error(exc)
        return EXIT_CONFIG_ERROR

    from workers.engine.metrics import ConsoleSink, JsonlSink, Recorder, Sink

    sinks: list[Sink] = []
    if config.telemetry.console:
        sinks.append(ConsoleSink(total_steps=config.trainer.steps, desc=config.recipe))
    if config.telemetry.jsonl_path:
        sinks.append(JsonlSink(config.telemetry.jsonl_path, flush_seconds=config.telemetry.flush_seconds))
    control_plane = _control_plane_sink(config)
    control = None
    if control_plane is not None:
        sinks.append(control_plane)
        control = _run_control(control_plane)
    recorder = Recorder(sinks)
    try:
        if config.recipe == "sft" and config.placement.runs_on_monarch:
            with _local_hosts(config.placement.local_hosts):
                from workers.engine.recipes.sft_monarch import train_sft_monarch

                result = train_sft_monarch(config, recorder, control=control)
        elif config.recipe == "sft":
            from workers.engine.recipes.sft import train_sft

            result = train_sft(config, recorder, control=control)
        elif config.placement.runs_on_monarch:
            with _local_hosts(config.placement.local_hosts):
                from workers.engine.recipes.grpo_monarch import train_grpo_monarch

                result = train_grpo_monarch(config, recorder, control=control)
        else:
            from workers.engine.recipes.grpo import train_grpo

            result = train_grpo(config, recorder, control=control)
    except ConfigError as exc:  # what preflight cannot tell before loading (a checkpoint's recipe, from its progress)
        _print_config_error(exc)
        return EXIT_CONFIG_ERROR
    finally:
        recorder.close()
    summary = {
        "recipe": config.recipe,
        "steps": result.step,
        "steps_per_s": round(len(result.losses) / result.seconds, 3) if result.seconds else None,
        "final_loss": result.losses[-1] if result.losses else None,
        "eval_reward_mean_start": result.first_eval.reward_mean if result.first_eval else None,
        "eval_reward_mean": result.eval.reward_mean if result.eval else None,
        "eval_accuracy": result.eval.accuracy if result.eval else None,
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
    }
    print(json.dumps(summary))
    return 0


@contextmanager
def _local_hosts(count: int) -> Iterator[None]:
    """`placement.local_hosts` worker processes for the run, named in FORGEBOARD_MONARCH_WORKERS as a
    cluster backend would; none when a launcher provided the workers (that variable, or a monarch.job's)."""
    from workers.engine.env import JOB_ENV, WORKERS_ENV, env_is_set, read_env

    if not count or env_is_set(WORKERS_ENV) or read_env(JOB_ENV):
        yield
        return
    from workers.engine.actors.local_workers import environment_value, local_workers

    with local_workers(count=count) as workers:
        os.environ[WORKERS_ENV] = environment_value(workers)
        try:
            yield
        finally:
            del os.environ[WORKERS_ENV]


def _make_tiny_model(args: argparse.Namespace) -> int:
    from workers.engine.models.tiny import make_tiny_model

    out = make_tiny_model(args.out, family=args.family, hidden_size=args.hidden_size, num_layers=args.layers,
                          intermediate_size=2 * args.hidden_size, seed=args.seed)
    print(out)
    return 0


def _export(args: argparse.Namespace) -> int:
    from workers.engine.models.hf_folder import export_hf

    try:
        print(export_hf(args.checkpoint, args.out))
    except ConfigError as exc:  # a checkpoint it refuses: the reason, not a traceback (the platform shows the tail)
        _print_config_error(exc)
        return EXIT_CONFIG_ERROR
    return 0


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(config_json_schema(), indent=2))
    return 0


def _plan(args: argparse.Namespace) -> int:
    """A what-if plan (workers/engine/planning): a calibration is fitted from a recorded run's JSONL telemetry (its
    config: --calibration-config, or the planned config when it is the same run)."""
    from workers.engine.planning.devices import device as device_spec
    from workers.engine.planning.fitting import calibrate_from_records
    from workers.engine.planning.report import PlanError, format_report, model_shape, parse_scales, plan_config

    try:
        config = load_config_file(args.config)
        calibration, measured = None, None
        if args.calibrate_from:
            measured_config = load_config_file(args.calibration_config or args.config)
            records = [json.loads(line) for line in open(args.calibrate_from, encoding="utf-8") if line.strip()]
            shape = model_shape(measured_config, model=args.model)
            calibration, measured, _ = calibrate_from_records(
                shape, config=measured_config, records=records, device=device_spec(args.calibration_device),
                source={"run": os.path.basename(args.calibrate_from)})
        report = plan_config(config, device=args.device or (calibration.device if calibration else "h100"),
                             scales=parse_scales(args.gpus), model=args.model, calibration=calibration,
                             measured=measured, batch=args.batch)
    except ConfigError as exc:
        _print_config_error(exc)
        return EXIT_CONFIG_ERROR
    except (PlanError, OSError, KeyError, ValueError) as exc:
        print(f"cannot plan: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.engine", description="Forgeboard training engine")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run a GRPO or SFT config")
    train.add_argument("--config", required=True, help="YAML run config")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")
    train.set_defaults(run=_train)

    tiny = commands.add_parser("make-tiny-model", help="write a tiny random model as an HF folder")
    tiny.add_argument("--family", choices=["qwen3", "llama3"], default="qwen3")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_make_tiny_model)

    export = commands.add_parser("export", help="export a checkpoint as an HF folder")
    export.add_argument("--checkpoint", required=True, help="a step_* folder or a checkpoints folder (newest)")
    export.add_argument("--out", required=True)
    export.set_defaults(run=_export)

    schema = commands.add_parser("schema", help="print the config JSON Schema")
    schema.set_defaults(run=_schema)

    plan = commands.add_parser("plan", help="predict a GRPO step's cost at several scales, and the best split")
    plan.add_argument("--config", required=True, help="YAML run config (GRPO)")
    plan.add_argument("--gpus", default="3,12,48,192", help="comma-separated device counts")
    plan.add_argument("--device", default=None, help="a100, h100, h200, b200 or cpu (default: the calibration's, "
                                                     "else h100)")
    plan.add_argument("--model", default=None, help="a known shape (qwen3-0.6b ... llama3-70b) instead of the "
                                                    "config's model folder")
    plan.add_argument("--batch", choices=["scaled", "fixed"], default="scaled",
                      help="scaled: the step's prompts grow with the devices; fixed: the same prompts")
    plan.add_argument("--calibrate-from", default=None, help="a run's telemetry JSONL (telemetry.jsonl_path)")
    plan.add_argument("--calibration-config", default=None, help="that run's config (default: --config)")
    plan.add_argument("--calibration-device", default="cpu", help="the device kind that run ran on")
    plan.add_argument("--json", action="store_true", help="the plan as JSON")
    plan.set_defaults(run=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))
