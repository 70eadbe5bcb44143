"""A what-if plan for a run config, as the CLI, the API and the launch page show it: which model shape, which
device, which calibration, and per scale the placement as written and the best split (`whatif.plan`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.engine.planning.calibration import Calibration
from workers.engine.planning.devices import device as device_spec
from workers.engine.planning.shapes import KNOWN_SHAPES, ModelShape
from workers.engine.planning.whatif import (DEFAULT_SCALES, Placement, ScalePlan, StepPrediction, Workload, plan, predict,
                                            workload_for)

DEFAULT_DEVICE = "h100"
MAX_SCALES = 16
MAX_DEVICES = 100_000


class PlanError(ValueError):
    """A plan that cannot be made: `field` names what to change."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


MAX_MODEL_CONFIG_BYTES = 1 << 20


def model_shape(config: Any, *, model: str | None = None, model_path: str | None = None) -> ModelShape:
    """`model` (a known shape's name), or else the config.json of the model folder (`model_path`, or the config's
    model.path)."""
    if model:
        if model not in KNOWN_SHAPES:
            raise PlanError("model", f"unknown shape {str(model)[:100]!r}; known: {', '.join(KNOWN_SHAPES)}")
        return KNOWN_SHAPES[model]
    folder = model_path or config.model.path
    file = Path(folder) / "config.json" if folder else None
    if file is None or not file.is_file():
        raise PlanError("model", "the config's model folder is not on this machine: name a shape "
                                 f"({', '.join(KNOWN_SHAPES)})")
    try:
        with open(file, "rb") as handle:
            text = handle.read(MAX_MODEL_CONFIG_BYTES + 1)
        if len(text) > MAX_MODEL_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_MODEL_CONFIG_BYTES} bytes")
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return ModelShape.from_hf_config(data, name=Path(folder).name)
    except (OSError, ValueError, RecursionError) as exc:
        raise PlanError("model", f"cannot read the model folder's config.json: {exc}"[:300]) from None


def parse_scales(text: str) -> tuple[int, ...]:
    """'3,12,48,192' -> (3, 12, 48, 192)."""
    try:
        scales = tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise PlanError("gpus", "a comma-separated list of whole numbers, e.g. 3,12,48,192") from None
    if not scales or len(scales) > MAX_SCALES or any(not 2 <= s <= MAX_DEVICES for s in scales):
        raise PlanError("gpus", f"1 to {MAX_SCALES} scales, each 2 to {MAX_DEVICES} devices")
    return scales


@dataclass(frozen=True)
class PlanReport:
    model: ModelShape
    device: str
    calibration: Calibration
    calibration_note: str
    workload: Workload
    placement: Placement
    as_configured: StepPrediction  # the placement at its own size
    scales: list[ScalePlan]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": {"name": self.model.name, "params": self.model.params()},
            "device": self.device, "calibration": self.calibration.to_dict(),
            "calibration_note": self.calibration_note,
            "workload": {"prompts": self.workload.prompts, "group_size": self.workload.group_size,
                         "prompt_tokens": self.workload.prompt_tokens,
                         "response_tokens": self.workload.response_tokens, "mode": self.workload.overlapped},
            "placement": self.placement.describe(),
            "as_configured": self.as_configured.to_dict(),
            "scales": [scale.to_dict() for scale in self.scales],
        }


def plan_config(config: Any, *, device: str = DEFAULT_DEVICE, scales: tuple[int, ...] = DEFAULT_SCALES,
                model: str | None = None, model_path: str | None = None, calibration: Calibration | None = None,
                measured: Workload | None = None, batch: str = "scaled") -> PlanReport:
    """The plan of a validated GRPO `RunConfig`. A calibration measured on another device kind is not applied (its
    efficiencies are that device's); the defaults are used and the note says so. `measured`: the calibration run's
    workload, whose prompt and response lengths the plan assumes (else the config's longest)."""
    if str(config.recipe) != "grpo":
        raise PlanError("recipe", "the what-if planner models GRPO steps")
    try:
        spec = device_spec(device)
    except KeyError as exc:
        raise PlanError("device", str(exc.args[0])) from None
    shape = model_shape(config, model=model, model_path=model_path)
    note = "the defaults (no measured run)"
    used = Calibration(device=spec.name)
    if calibration is not None and calibration.device == spec.name:
        used, note = calibration, f"fitted from {calibration.source.get('run') or 'a run'} on {spec.name}"
    elif calibration is not None:
        note = f"the defaults: the measured run was on {calibration.device or 'another device'}, not {spec.name}"
    workload = workload_for(config, measured=measured)
    placement = Placement.from_config(config)
    try:
        scaled = plan(shape, workload, placement, device=spec, calibration=used, scales=scales, batch=batch)
    except ValueError as exc:
        raise PlanError("gpus", str(exc)) from None
    return PlanReport(model=shape, device=spec.name, calibration=used, calibration_note=note, workload=workload,
                      placement=placement, scales=scaled,
                      as_configured=predict(shape, workload, placement, device=spec, calibration=used))


def format_report(report: PlanReport) -> str:
    """The plan as a table: one line per scale for the placement as written, one for the best split."""
    w = report.workload
    lines = [
        f"model {report.model.name} ({report.model.params() / 1e6:,.1f}M params) on {report.device}; "
        f"calibration: {report.calibration_note}",
        f"workload: {w.prompts} prompts x {w.group_size} at {report.placement.devices} devices (prompts scale with "
        f"the devices), {w.prompt_tokens:.0f} prompt + {w.response_tokens:.0f} response tokens, mode {w.overlapped}",
        f"as configured ({report.placement.describe()}, {report.placement.devices} devices): step "
        f"{report.as_configured.step_s:.3f} s, bottleneck {report.as_configured.bottleneck}",
        "",
        f"{'devices':>7}  {'':<10} {'placement':<46} {'step s':>8} {'seq/s':>9} {'gen tok/s':>10} "
        f"{'train tok/s':>11} {'gen util':>8} {'train util':>10}  bottleneck",
    ]
    for scale in report.scales:
        for label, p in (("as written", scale.as_written), ("best", scale.best)):
            extra = f"  (x{scale.gain:.2f})" if label == "best" else ""
            fits = "" if p.fits else "  DOES NOT FIT: " + "; ".join(p.notes)
            lines.append(
                f"{scale.devices if label == 'as written' else '':>7}  {label:<10} {p.placement.describe():<46} "
                f"{p.step_s:>8.3f} {p.sequences_per_s:>9.1f} {p.generated_tokens_per_s:>10.0f} "
                f"{p.train_tokens_per_s:>11.0f} {p.utilization['generator']:>8.0%} {p.utilization['trainer']:>10.0%}"
                f"  {p.bottleneck}{extra}{fits}")
    return "\n".join(lines)
