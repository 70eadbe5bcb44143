"""Reads of metrics and events: ranges, downsampled series, and events after a cursor."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from django.db.models import Avg, Count, ExpressionWrapper, F, IntegerField, Max, Min, Q, QuerySet

from forgeboard.runs.models import Run
from forgeboard.telemetry.models import EventKind, LogLine, MetricPoint, MetricSeries, RunEvent, StepTimeline
from forgeboard.telemetry.services import event_to_wire


# The metrics a runs list or a comparison summarises a run by, when the run has them.
KEY_METRICS = ("reward/mean", "eval/reward_mean", "eval/accuracy", "loss")


def metric_keys(*, run: Run) -> QuerySet[MetricSeries]:
    return MetricSeries.objects.filter(run=run).order_by("key")


def metric_range(
    *, run: Run, key: str, start_step: int | None = None, end_step: int | None = None, limit: int = 10_000
) -> list[tuple[int, float, float]]:
    points = MetricPoint.objects.filter(series__run=run, series__key=key)
    if start_step is not None:
        points = points.filter(step__gte=start_step)
    if end_step is not None:
        points = points.filter(step__lte=end_step)
    return list(points.order_by("step").values_list("step", "value", "wall_time")[:limit])


@dataclass(frozen=True)
class Bucket:
    step: int
    mean: float
    low: float
    high: float
    count: int
    wall_time: float | None = None  # the latest wall time in the slice (Unix seconds, the engine's clock)


def metric_downsampled(
    *, run: Run, key: str, buckets: int, start_step: int | None = None, end_step: int | None = None
) -> list[Bucket]:
    """At most `buckets` points over the step range, each the mean, min and max of its slice of steps."""
    series = MetricSeries.objects.filter(run=run, key=key).first()
    if series is None or series.first_step is None:
        return []
    lo = series.first_step if start_step is None else start_step
    hi = series.last_step if end_step is None else end_step
    width = max(1, -(-(hi - lo + 1) // max(1, buckets)))
    rows = (
        MetricPoint.objects.filter(series=series, step__gte=lo, step__lte=hi)
        .annotate(bucket=ExpressionWrapper((F("step") - lo) / width, output_field=IntegerField()))
        .values("bucket")
        .annotate(last_step=Max("step"), mean=Avg("value"), low=Min("value"), high=Max("value"), count=Count("step"),
                  wall_time=Max("wall_time"))
        .order_by("bucket")
    )
    return [Bucket(step=r["last_step"], mean=r["mean"], low=r["low"], high=r["high"], count=r["count"],
                   wall_time=r["wall_time"]) for r in rows]


def metrics_from_step(*, run: Run, step: int, buckets: int) -> dict[str, list[Bucket]]:
    """Every series' points from `step` on (all of them from step 0), at most `buckets` a key: from the step itself,
    since a step's keys may come in different batches (its evaluation after its loss)."""
    start = step if step else None
    return {series.key: metric_downsampled(run=run, key=series.key, buckets=buckets, start_step=start)
            for series in MetricSeries.objects.filter(run=run, last_step__gte=step)}


@dataclass(frozen=True)
class LoggedLine:
    """A log line and where the run reported it: its telemetry batch and its index there."""

    batch: int
    index: int
    text: str


def log_tail(*, run_id: int, after_batch: int, through_batch: int, last: int, after_index: int | None = None,
             before_index: int | None = None) -> list[LoggedLine]:
    """The last `last` log lines of the run's telemetry batches after `after_batch` through `through_batch`, in the
    order they were reported; with `after_index`, the lines of the batch `after_batch` after that index too; with
    `before_index`, of the batch `through_batch` only its lines before that index."""
    lines = LogLine.objects.filter(run_id=run_id, batch_seq__lte=through_batch)
    if after_index is None:
        lines = lines.filter(batch_seq__gt=after_batch)
    else:
        lines = lines.filter(Q(batch_seq__gt=after_batch) | Q(batch_seq=after_batch, index__gt=after_index))
    if before_index is not None:
        lines = lines.exclude(batch_seq=through_batch, index__gte=before_index)
    rows = lines.order_by("-batch_seq", "-index").values_list("batch_seq", "index", "line")[:last]
    return [LoggedLine(batch=batch, index=index, text=text) for batch, index, text in rows][::-1]


def events_after(*, run: Run, after_seq: int = 0, limit: int = 1000) -> QuerySet[RunEvent]:
    return RunEvent.objects.filter(run=run, seq__gt=after_seq).order_by("seq")[:limit]


def events_page(*, run_id: int, after_seq: int, through_seq: int, max_events: int, max_chars: int) -> list[dict]:
    """The run's events after `after_seq` up to `through_seq`, as the streams send them, in order: at most
    `max_events`, and none more once their JSON reaches `max_chars` (the first is kept however long it is)."""
    events = RunEvent.objects.filter(run_id=run_id, seq__gt=after_seq, seq__lte=through_seq).order_by("seq")
    page: list[dict] = []
    chars = 0
    for event in events[:max_events].iterator(chunk_size=100):
        wire = event_to_wire(event)
        page.append(wire)
        chars += len(json.dumps(wire))
        if chars >= max_chars:
            break
    return page


def metric_series_of_runs(*, run_ids: Sequence[int]) -> QuerySet[MetricSeries]:
    """Every series of these runs, by key then run: one query for a compare page's keys and final values."""
    return MetricSeries.objects.filter(run_id__in=list(run_ids)).order_by("key", "run_id")


def metric_first_wall_times(*, run_ids: Sequence[int]) -> dict[int, float]:
    """Per run, the wall time of its earliest first point over all its series (runs without points are left out).

    Reads one point per series through the primary key (series, step), not the run's whole history.
    """
    rows = (
        MetricPoint.objects.filter(series__run_id__in=list(run_ids), step=F("series__first_step"))
        .values("series__run_id")
        .annotate(first=Min("wall_time"))
    )
    return {row["series__run_id"]: row["first"] for row in rows}


def step_timelines(*, run: Run, last: int, from_step: int = 0) -> list[dict]:
    """The last `last` steps' timelines (`telemetry_wire.StepTimeline` payloads) from `from_step` on, in step order."""
    rows = (StepTimeline.objects.filter(run=run, step__gte=from_step).order_by("-step")
            .values_list("payload", flat=True)[:last])
    return list(rows)[::-1]


ROLLOUT_TEXT_CHARS = 2_000  # of a prompt or a completion, kept for a table that shows fewer


@dataclass(frozen=True)
class RolloutSample:
    """A rollout event's fields as a table shows them: what is not of its type (the engine's word) is None."""

    step: int | None
    prompt: str
    completion: str
    reward: float | None
    advantage: float | None
    policy_version: int | None


def _whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: object) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _text(value: object) -> str:
    return value[:ROLLOUT_TEXT_CHARS] if isinstance(value, str) else ""


def rollout_samples(*, run: Run, last: int) -> list[RolloutSample]:
    """The run's newest `last` rollout samples, newest first."""
    payloads = (RunEvent.objects.filter(run=run, kind=EventKind.ROLLOUT).order_by("-seq")
                .values_list("payload", flat=True)[:last])
    return [RolloutSample(step=_whole(p.get("step")), prompt=_text(p.get("prompt")),
                          completion=_text(p.get("completion")), reward=_number(p.get("reward")),
                          advantage=_number(p.get("advantage")), policy_version=_whole(p.get("policy_version")))
            for p in payloads if isinstance(p, dict)]
