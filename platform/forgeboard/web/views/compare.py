"""Compare 2-10 runs of a project: overlaid charts (loaded by the page from /api/v1), a summary and a config diff."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from forgeboard.errors import ServiceError
from forgeboard.runs.models import Run
from forgeboard.runs.selectors import config_diff, runs_for_compare
from forgeboard.telemetry.models import MetricSeries
from forgeboard.telemetry.selectors import KEY_METRICS, metric_first_wall_times, metric_series_of_runs
from forgeboard.web.errors import error_page, project_or_404

# Shown in the summary when a run has them; otherwise the first keys the runs have.
SUMMARY_METRICS = 4
CHART_BUCKETS = 500  # points per run and chart, fetched downsampled (mean per slice of steps)
PALETTE = ("#0b57d0", "#c5221f", "#188038", "#e37400", "#8430ce", "#007b83", "#b3165d", "#5f6368", "#1e8e3e",
           "#a142f4")  # the same order as FBCharts.PALETTE, so legend swatches in tables match the charts


@dataclass
class CompareRow:
    run: Run
    label: str
    color: str
    duration_s: float | None
    finals: list[float | None]


def _duration_s(run: Run) -> float | None:
    if run.started_at is None:
        return None
    return ((run.finished_at or timezone.now()) - run.started_at).total_seconds()


def _time_origin(run: Run, first_wall_time: float | None) -> float | None:
    """Seconds are counted from the run's start, or from its first point when the engine's clock is earlier."""
    started = run.started_at.timestamp() if run.started_at else None
    known = [t for t in (started, first_wall_time) if t is not None]
    return min(known) if known else None


def _summary_keys(series: list[MetricSeries]) -> list[str]:
    present = list(dict.fromkeys(s.key for s in series))
    preferred = [key for key in KEY_METRICS if key in present]
    return preferred or present[:SUMMARY_METRICS]


@login_required
@require_GET
def compare(request: HttpRequest, slug: str) -> HttpResponse:
    project = project_or_404(request, slug)
    try:
        runs = runs_for_compare(actor=request.user, project=project, run_ids=request.GET.getlist("runs"))
    except ServiceError as error:
        return error_page(request, error)
    run_ids = [run.pk for run in runs]
    series = list(metric_series_of_runs(run_ids=run_ids))
    by_run: dict[int, dict[str, MetricSeries]] = {run.pk: {} for run in runs}
    for s in series:
        by_run[s.run_id][s.key] = s
    summary_keys = _summary_keys(series)
    first_times = metric_first_wall_times(run_ids=run_ids)
    rows, chart_runs = [], []
    for i, run in enumerate(runs):
        label = f"{run.experiment.name} #{run.number}"
        color = PALETTE[i % len(PALETTE)]
        finals = [by_run[run.pk][key].last_value if key in by_run[run.pk] else None for key in summary_keys]
        rows.append(CompareRow(run=run, label=label, color=color, duration_s=_duration_s(run), finals=finals))
        chart_runs.append({
            "id": run.pk, "label": label, "t0": _time_origin(run, first_times.get(run.pk)),
            "points": {key: s.point_count for key, s in by_run[run.pk].items()},
        })
    diff = config_diff(runs=runs)
    only_diff = request.GET.get("only") == "diff"
    chart_data: dict[str, Any] = {
        "runs": chart_runs, "keys": list(dict.fromkeys(s.key for s in series)), "buckets": CHART_BUCKETS,
        "pointsUrl": "/api/v1/runs/{id}/metrics/",
    }
    return render(request, "web/compare.html", {
        "project": project, "runs": runs, "rows": rows, "summary_keys": summary_keys, "diff": diff,
        "differing": sum(1 for row in diff if row.differs), "only_diff": only_diff, "chart_data": chart_data,
        "run_ids": ",".join(str(pk) for pk in run_ids),
    })
