"""Regression suites: define, launch (one run per stage), and judge each check against its baseline."""

from __future__ import annotations

import math
import statistics
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Avg
from django.utils import timezone
from pydantic import ValidationError

from forgeboard.accounts.models import Project, Role
from forgeboard.accounts.permissions import Actor, actor_user, require_project_role
from forgeboard.audit.services import audit_record
from forgeboard.errors import AlreadyExists, FieldProblem, ValidationFailed, clean_text
from forgeboard.experiments.models import Experiment
from forgeboard.experiments.services import validate_run_config
from forgeboard.regressions.models import CheckResult, StageResult, Suite, SuiteRun, Verdict
from forgeboard.regressions.spec import CheckSpec, HistoryBaseline, SuiteSpec
from forgeboard.runs.models import Run
from forgeboard.runs.planning import run_calibration, stage_prediction
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import TERMINAL_STATES, RunState
from forgeboard.telemetry.models import MetricPoint, MetricSeries


def _parse_spec(spec: Any) -> SuiteSpec:
    try:
        return SuiteSpec.model_validate(spec)
    except ValidationError as exc:
        problems = [FieldProblem(".".join(["spec", *(str(p) for p in e["loc"])]), e["msg"]) for e in exc.errors()[:50]]
        raise ValidationFailed("; ".join(f"{p.field}: {p.message}" for p in problems[:5]), problems=problems) from None


def _check_stages(*, project: Project, spec: SuiteSpec) -> None:
    """Every stage names an experiment of this project and a config that experiment can run."""
    for i, stage in enumerate(spec.stages):
        experiment = Experiment.objects.filter(pk=stage.experiment_id, project=project).first()
        if experiment is None:
            raise ValidationFailed.on(f"spec.stages.{i}.experiment_id", f"no experiment {stage.experiment_id} in "
                                                                        f"{project.slug}")
        try:
            validate_run_config(yaml_text=stage.config_yaml, overrides=stage.overrides, recipe=experiment.recipe,
                                project=project)
        except ValidationFailed as exc:
            problems = [FieldProblem(f"spec.stages.{i}.{p.field}", p.message) for p in exc.problems]
            raise ValidationFailed(f"stage {stage.name!r}: {exc.message}", problems=problems) from None
        for j, check in enumerate(stage.checks):
            if check.baseline.kind == "pinned" and not Run.objects.filter(
                    pk=check.baseline.run_id, experiment__project=project).exists():
                raise ValidationFailed.on(f"spec.stages.{i}.checks.{j}.baseline.run_id",
                                          f"no run {check.baseline.run_id} in {project.slug}")


def suite_create(*, actor: Actor, project: Project, name: str, spec: Any, description: str = "") -> Suite:
    require_project_role(actor=actor, project=project, minimum=Role.MEMBER, action="defining regression suites")
    name = clean_text(field="name", value=name, max_length=100)
    description = clean_text(field="description", value=description, max_length=10_000, required=False)
    parsed = _parse_spec(spec)
    _check_stages(project=project, spec=parsed)
    try:
        with transaction.atomic():
            suite = Suite.objects.create(project=project, name=name, description=description,
                                         spec=parsed.model_dump(mode="json"), created_by=actor_user(actor))
            audit_record(actor=actor, action="suite.create", target=suite, project=project, payload={"name": name})
    except IntegrityError:
        raise AlreadyExists.on("name", f"a suite named {name!r} already exists in {project.slug}") from None
    return suite


def suite_launch(*, actor: Actor, suite: Suite) -> SuiteRun:
    """Launch every stage's run now; the verdict comes once they have all ended (suite_run_refresh)."""
    project = suite.project
    require_project_role(actor=actor, project=project, minimum=Role.MEMBER, action="launching regression suites")
    spec = SuiteSpec.model_validate(suite.spec)
    with transaction.atomic():
        suite_run = SuiteRun.objects.create(suite=suite, spec=suite.spec, created_by=actor_user(actor))
        for stage in spec.stages:
            experiment = Experiment.objects.get(pk=stage.experiment_id, project=project)
            run = run_launch(actor=actor, experiment=experiment, config_yaml=stage.config_yaml,
                             overrides=stage.overrides)
            StageResult.objects.create(suite_run=suite_run, name=stage.name, run=run)
        audit_record(actor=actor, action="suite.launch", target=suite_run, project=project,
                     payload={"suite": suite.name})
    return suite_run


def metric_value(*, run: Run, metric: str, at: str | int) -> float | None:
    series = MetricSeries.objects.filter(run=run, key=metric).first()
    if series is None or series.point_count == 0:
        return None
    if at == "last":
        return series.last_value
    if at == "min":
        return series.min_value
    if at == "max":
        return series.max_value
    points = MetricPoint.objects.filter(series=series)
    if at == "mean":
        return points.aggregate(mean=Avg("value"))["mean"]
    point = points.filter(step__lte=at).order_by("-step").values_list("value", flat=True).first()
    return point


def _baseline(*, suite_run: SuiteRun, stage_name: str, check: CheckSpec) -> tuple[float, float] | None:
    """(baseline, tolerance) or None when there is no history yet."""
    if check.baseline.kind == "pinned":
        value = metric_value(run=Run.objects.get(pk=check.baseline.run_id), metric=check.metric, at=check.at)
        return None if value is None else (value, check.baseline.tolerance * abs(value))
    history: HistoryBaseline = check.baseline
    earlier = (SuiteRun.objects.filter(suite=suite_run.suite, verdict__in=[Verdict.PASSED, Verdict.WARNED],
                                       created_at__lt=suite_run.created_at)
               .order_by("-created_at")[: history.window])
    values = list(CheckResult.objects.filter(stage__suite_run__in=earlier, stage__name=stage_name, name=check.name,
                                             value__isnull=False).values_list("value", flat=True))
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    median = statistics.median(values)
    sigma = statistics.pstdev(values) if len(values) > 1 else 0.0
    return median, max(history.min_tolerance * abs(median), history.sigmas * sigma)


def _judge(*, suite_run: SuiteRun, stage: StageResult, check: CheckSpec) -> CheckResult:
    value = metric_value(run=stage.run, metric=check.metric, at=check.at)
    result = CheckResult(stage=stage, name=check.name, metric=check.metric, gate=check.gate, value=value)
    if value is None or not math.isfinite(value):
        result.verdict = Verdict.FAILED if check.gate else Verdict.WARNED
        result.detail = f"the run reported no finite {check.metric!r} at {check.at}"
        return result
    baseline = _baseline(suite_run=suite_run, stage_name=stage.name, check=check)
    if baseline is None:
        result.verdict, result.detail = Verdict.NO_BASELINE, "no earlier passing run to compare with"
        return result
    result.baseline, tolerance = baseline
    higher = check.direction == "higher_is_better"
    result.threshold = result.baseline - tolerance if higher else result.baseline + tolerance
    worse = value < result.threshold if higher else value > result.threshold
    if worse:
        result.verdict = Verdict.FAILED if check.gate else Verdict.WARNED
        result.detail = (f"{check.metric} = {value:.6g} is worse than the threshold {result.threshold:.6g} "
                         f"(baseline {result.baseline:.6g}, {check.direction.replace('_', ' ')})")
    else:
        result.verdict = Verdict.PASSED
        result.detail = f"{check.metric} = {value:.6g}, threshold {result.threshold:.6g}"
    return result


def _worst(verdicts: list[str]) -> str:
    for verdict in (Verdict.ERROR, Verdict.FAILED, Verdict.WARNED):
        if verdict in verdicts:
            return verdict
    return Verdict.PASSED


def _predict_stages(stages: list[StageResult]) -> None:
    """Each stage's step predicted by the what-if model calibrated on the first stage that succeeded and recorded
    GRPO step timelines, beside the step it measured (the first stage is then its own calibration: error ~0)."""
    calibrated = None
    for stage in stages:
        if stage.run.state == RunState.SUCCEEDED:
            try:
                calibrated = run_calibration(run=stage.run)
                break
            except ValidationFailed:
                continue
    for stage in stages:
        prediction = stage_prediction(run=stage.run, calibrated=calibrated)
        stage.predicted_step_s, stage.measured_step_s = prediction.predicted_step_s, prediction.measured_step_s
        stage.prediction_note = prediction.note[:300]


def suite_run_refresh(*, suite_run: SuiteRun) -> SuiteRun:
    """Judge the suite run once all its stage runs have ended; before that (or after) it changes nothing."""
    if suite_run.verdict != Verdict.RUNNING:
        return suite_run
    stages = list(suite_run.stages.select_related("run"))
    if any(stage.run.state not in TERMINAL_STATES for stage in stages):
        return suite_run
    spec = SuiteSpec.model_validate(suite_run.spec)
    checks_of = {stage.name: stage.checks for stage in spec.stages}
    with transaction.atomic():
        locked = SuiteRun.objects.select_for_update().get(pk=suite_run.pk)
        if locked.verdict != Verdict.RUNNING:
            return locked
        for stage in stages:
            if stage.run.state != RunState.SUCCEEDED:
                stage.verdict = Verdict.ERROR
                CheckResult.objects.create(stage=stage, name="run", metric="", gate=True, verdict=Verdict.ERROR,
                                           detail=f"run {stage.run.pk} ended {stage.run.state}: {stage.run.exit_reason}")
            else:
                results = [_judge(suite_run=locked, stage=stage, check=c) for c in checks_of[stage.name]]
                CheckResult.objects.bulk_create(results)
                stage.verdict = _worst([r.verdict for r in results])
        _predict_stages(stages)
        for stage in stages:
            stage.save(update_fields=["verdict", "predicted_step_s", "measured_step_s", "prediction_note"])
        locked.verdict = _worst([s.verdict for s in stages])
        locked.finished_at = timezone.now()
        locked.save(update_fields=["verdict", "finished_at"])
    return locked
