"""What-if plans of a run config (#18): the engine's step-cost model (workers/engine/planning) asked about a config
before it is launched, calibrated from a run of the same project that recorded its step timelines.

  config_plan          a config (as the launch form or the API holds it) -> the engine's PlanReport as a dict
  run_calibration      a finished or running GRPO run's stored step_timeline events and metrics -> a Calibration,
                       the run's measured workload, and its placement (planning/fitting.py)
  stage_prediction     a regression stage's predicted and measured step seconds, from another stage's calibration
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.db.models import Exists, OuterRef

from forgeboard.accounts.models import Project
from forgeboard.cluster.models import Device, DeviceKind
from forgeboard.errors import NotFound, ValidationFailed
from forgeboard.experiments.services import validate_and_resolve
from forgeboard.runs.models import Run
from forgeboard.telemetry.models import MetricPoint, StepTimeline
from workers.engine.config import RunConfig
from workers.engine.planning.calibration import Calibration
from workers.engine.planning.devices import DEVICES, cpu_device
from workers.engine.planning.fitting import DEFAULT_WARMUP_STEPS, calibrate_from_records, measured_steps, median_step
from workers.engine.planning.report import PlanError, model_shape, plan_config
from workers.engine.planning.whatif import Placement, Workload, predict, workload_for

CALIBRATION_METRICS = ("response_length/mean", "data/train_tokens")
MAX_CALIBRATION_STEPS = 200  # the first steps after the warm-up are plenty for medians


@dataclass(frozen=True)
class RunCalibration:
    run: Run
    calibration: Calibration
    workload: Workload
    placement: Placement


def _plan_error(exc: PlanError) -> ValidationFailed:
    return ValidationFailed.on(exc.field, exc.message)


def run_device_kind(*, run: Run, config: RunConfig) -> str | None:
    """The device kind a run's trainer ran on: cpu, a GPU of the device table (by its inventory model name), or
    None for a GPU the table does not have."""
    if config.trainer.device == "cpu":
        return "cpu"
    models = list(Device.objects.filter(host__hostname=run.host, kind=DeviceKind.GPU).values_list("model", flat=True))
    if not models:
        return "cpu"
    for name in DEVICES:
        if any(name in model.lower() for model in models):
            return name
    return None


def _records(run: Run) -> Iterator[dict[str, Any]]:
    timelines = StepTimeline.objects.filter(run=run).order_by("step")[:MAX_CALIBRATION_STEPS + DEFAULT_WARMUP_STEPS]
    for timeline in timelines:
        yield {"kind": "event", "name": "step_timeline", **timeline.payload}
    points = (MetricPoint.objects.filter(series__run=run, series__key__in=CALIBRATION_METRICS,
                                         step__lte=MAX_CALIBRATION_STEPS + DEFAULT_WARMUP_STEPS)
              .values_list("series__key", "step", "value"))
    for key, step, value in points:
        if value is not None:
            yield {"kind": "metric", "key": key, "step": step, "value": value}


def run_calibration(*, run: Run) -> RunCalibration:
    """ValidationFailed on `calibration_run` when the run cannot calibrate: not GRPO, no step timelines yet, or a
    device the table does not have."""
    config = run.config.run_config
    if str(config.recipe) != "grpo":
        raise ValidationFailed.on("calibration_run", f"run {run.pk} is {config.recipe}: only GRPO runs calibrate")
    kind = run_device_kind(run=run, config=config)
    if kind is None:
        raise ValidationFailed.on("calibration_run", f"run {run.pk} ran on a GPU the device table does not have "
                                                     f"({', '.join(DEVICES)})")
    device = cpu_device() if kind == "cpu" else DEVICES[kind]
    try:
        shape = model_shape(config, model_path=run.artifact_paths.get("model.path"))
        calibration, workload, placement = calibrate_from_records(
            shape, config=config, records=list(_records(run)), device=device,
            source={"run": f"run {run.pk}", "run_id": run.pk})
    except PlanError as exc:
        raise ValidationFailed.on("calibration_run", f"run {run.pk}: {exc.message}") from None
    except ValueError as exc:
        raise ValidationFailed.on("calibration_run", f"run {run.pk}: {exc}") from None
    return RunCalibration(run=run, calibration=calibration, workload=workload, placement=placement)


MAX_CALIBRATION_CHOICES = 20


def calibration_runs(*, project: Project) -> list[Run]:
    """The project's newest GRPO runs that recorded step timelines (what a plan can be calibrated from)."""
    timelines = StepTimeline.objects.filter(run=OuterRef("pk"))
    runs = (Run.objects.filter(Exists(timelines), experiment__project=project, experiment__recipe="grpo")
            .select_related("experiment").order_by("-created_at"))
    return list(runs[:MAX_CALIBRATION_CHOICES])


def project_run(*, project: Project, run_id: int) -> Run:
    """A run of this project; another project's run gets the answer a missing one gets."""
    run = Run.objects.select_related("config", "experiment__project").filter(
        pk=run_id, experiment__project=project).first()
    if run is None:
        raise NotFound(f"no run {run_id} in {project.slug}")
    return run


def config_plan(*, project: Project, recipe: str, yaml_text: str, overrides: Sequence[str] = (), device: str,
                scales: tuple[int, ...], model: str | None = None, calibration_run_id: int | None = None,
                batch: str = "scaled") -> dict[str, Any]:
    """The plan of a config as `run_launch` would take it (validated and resolved in `project`)."""
    config, paths = validate_and_resolve(yaml_text=yaml_text, overrides=overrides, recipe=recipe, project=project)
    calibrated = None
    if calibration_run_id is not None:
        calibrated = run_calibration(run=project_run(project=project, run_id=calibration_run_id))
    try:
        report = plan_config(config, device=device, scales=scales, model=model, model_path=paths.get("model.path"),
                             calibration=calibrated.calibration if calibrated else None,
                             measured=calibrated.workload if calibrated else None, batch=batch)
    except PlanError as exc:
        raise _plan_error(exc) from None
    return report.to_dict()


@dataclass(frozen=True)
class StagePrediction:
    predicted_step_s: float | None
    measured_step_s: float | None
    note: str


def measured_step_seconds(*, run: Run) -> float | None:
    """The median step of a run's stored timelines after the warm-up, or None without any."""
    timelines = [{"kind": "event", "name": "step_timeline", **t.payload}
                 for t in StepTimeline.objects.filter(run=run).order_by("step")[:MAX_CALIBRATION_STEPS]]
    if not timelines:
        return None
    return median_step(measured_steps(timelines), warmup=DEFAULT_WARMUP_STEPS).seconds


def stage_prediction(*, run: Run, calibrated: RunCalibration | None) -> StagePrediction:
    """A stage run's step predicted from another run's calibration (its measured lengths; the stage's own batch,
    group, mode and placement), beside the step the stage measured."""
    measured = measured_step_seconds(run=run)
    if calibrated is None:
        return StagePrediction(None, measured, "no calibration: the first stage recorded no GRPO step timelines")
    config = run.config.run_config
    if str(config.recipe) != "grpo":
        return StagePrediction(None, measured, "only GRPO stages are predicted")
    try:
        shape = model_shape(config, model_path=run.artifact_paths.get("model.path"))
    except PlanError as exc:
        return StagePrediction(None, measured, exc.message)
    kind = run_device_kind(run=run, config=config)
    if kind != calibrated.calibration.device:
        return StagePrediction(None, measured, f"ran on {kind or 'an unknown GPU'}, calibrated on "
                                               f"{calibrated.calibration.device}")
    device = cpu_device() if kind == "cpu" else DEVICES[kind]
    workload = workload_for(config, measured=calibrated.workload)
    try:
        predicted = predict(shape, workload, Placement.from_config(config), device=device,
                            calibration=calibrated.calibration)
    except (ValueError, ArithmeticError) as exc:
        return StagePrediction(None, measured, f"cannot predict: {exc}")
    source = calibrated.run
    return StagePrediction(predicted.step_s, measured,
                           f"calibrated on {source.experiment.name} #{source.number} (run {source.pk})")
