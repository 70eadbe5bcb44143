"""Reading regression suites for the pages: a project's suites, a suite's runs, and each stage's prediction error
over the suite's history."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import QuerySet

from forgeboard.accounts.models import Project
from forgeboard.errors import NotFound, is_db_id
from forgeboard.regressions.models import StageResult, Suite, SuiteRun

HISTORY_RUNS = 20


def suites_for_project(*, project: Project) -> QuerySet[Suite]:
    return Suite.objects.filter(project=project).order_by("name")


def suite_in_project(*, project: Project, name: str) -> Suite:
    suite = Suite.objects.filter(project=project, name=name).first()
    if suite is None:
        raise NotFound(f"no suite {name[:100]!r} in {project.slug}")
    return suite


def suite_run_of(*, suite: Suite, suite_run_id: str | None) -> SuiteRun | None:
    """The suite's run with that id, or its newest run (None when it has none). NotFound for an id of no run of
    this suite."""
    runs = SuiteRun.objects.filter(suite=suite)
    if not suite_run_id:
        return runs.order_by("-created_at", "-id").first()
    found = runs.filter(pk=int(suite_run_id)).first() if str(suite_run_id).isdigit() and is_db_id(
        int(suite_run_id)) else None
    if found is None:
        raise NotFound(f"no run {str(suite_run_id)[:30]} of suite {suite.name}")
    return found


def stages_of(*, suite_run: SuiteRun) -> list[StageResult]:
    return list(suite_run.stages.select_related("run__experiment").prefetch_related("checks"))


@dataclass(frozen=True)
class HistoryRow:
    suite_run: SuiteRun
    errors: list[float | None]  # per stage name, in `stage_names` order


def prediction_history(*, suite: Suite) -> tuple[list[str], list[HistoryRow]]:
    """The suite's newest runs (at most HISTORY_RUNS), each with every stage's prediction error."""
    runs = list(SuiteRun.objects.filter(suite=suite).order_by("-created_at", "-id")[:HISTORY_RUNS])
    stages = StageResult.objects.filter(suite_run__in=runs).order_by("id")
    names: list[str] = []
    by_run: dict[int, dict[str, float | None]] = {}
    for stage in stages:
        if stage.name not in names:
            names.append(stage.name)
        by_run.setdefault(stage.suite_run_id, {})[stage.name] = stage.prediction_error
    return names, [HistoryRow(run, [by_run.get(run.pk, {}).get(name) for name in names]) for run in runs]
