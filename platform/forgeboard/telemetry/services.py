"""Where a run's events and metric points are written."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from forgeboard.errors import ValidationFailed
from forgeboard.runs.models import Run
from forgeboard.telemetry.streams import publish_run_update
from forgeboard.telemetry.models import METRIC_KEY_MAX_LENGTH, EventKind, MetricPoint, MetricSeries, RunEvent

MAX_EVENT_PAYLOAD_KEYS = 100


@transaction.atomic
def event_append(
    *, run: Run, kind: EventKind | str, payload: Mapping[str, Any] | None = None, occurred_at: datetime | None = None
) -> RunEvent:
    """Append an event with the run's next sequence number (the UPDATE's row lock orders concurrent appenders)."""
    if kind not in EventKind.values:
        raise ValidationFailed.on("kind", f"unknown event kind {kind!r}")
    Run.objects.filter(pk=run.pk).update(last_event_seq=F("last_event_seq") + 1)
    seq = Run.objects.filter(pk=run.pk).values_list("last_event_seq", flat=True).get()
    run.last_event_seq = seq
    event = RunEvent.objects.create(
        run_id=run.pk, seq=seq, kind=kind, payload=dict(payload or {}), occurred_at=occurred_at or timezone.now()
    )
    update = {"type": "run.update", "run": run.pk, "events": [event_to_wire(event)], "metrics": {}, "logs": []}
    transaction.on_commit(lambda: publish_run_update(run=run, update=update))
    return event


def event_to_wire(event: RunEvent) -> dict:
    return {"seq": event.seq, "kind": event.kind, "payload": event.payload, "time": event.occurred_at.isoformat()}


@dataclass(frozen=True)
class Point:
    key: str
    step: int
    value: float
    wall_time: float


def _check_point(point: Point) -> None:
    if not point.key or len(point.key) > METRIC_KEY_MAX_LENGTH:
        raise ValidationFailed.on("key", f"metric keys are 1-{METRIC_KEY_MAX_LENGTH} characters")
    if not (0 <= point.step < 2**63):
        raise ValidationFailed.on("step", f"step {point.step} is outside 0..2^63-1")
    if not math.isfinite(point.wall_time):
        raise ValidationFailed.on("wall_time", "must be a finite number")


@transaction.atomic
def metrics_record(*, run: Run, points: Iterable[Point]) -> int:
    """Store points; a (key, step) already stored is kept as it was. Returns how many were new."""
    by_key: dict[str, list[Point]] = {}
    for point in points:
        _check_point(point)
        by_key.setdefault(point.key, []).append(point)
    created = 0
    for key, key_points in by_key.items():
        series, _ = MetricSeries.objects.get_or_create(run=run, key=key)
        series = MetricSeries.objects.select_for_update().get(pk=series.pk)
        unique = {p.step: p for p in key_points}
        stored = set(
            MetricPoint.objects.filter(series=series, step__in=list(unique)).values_list("step", flat=True)
        )
        fresh = [p for step, p in unique.items() if step not in stored]
        if not fresh:
            continue
        MetricPoint.objects.bulk_create(
            [MetricPoint(series=series, step=p.step, value=p.value, wall_time=p.wall_time) for p in fresh],
            ignore_conflicts=True,
        )
        created += len(fresh)
        _refresh_summary(series=series, point_count=series.point_count + len(fresh), new_points=fresh)
    return created


def _refresh_summary(*, series: MetricSeries, point_count: int, new_points: list[Point]) -> None:
    finite = [p.value for p in new_points if math.isfinite(p.value)]
    latest = max(new_points, key=lambda p: p.step)
    series.point_count = point_count
    series.first_step = min([p.step for p in new_points] + ([series.first_step] if series.first_step is not None else []))
    if series.last_step is None or latest.step >= series.last_step:
        series.last_step, series.last_value = latest.step, latest.value
    if finite:
        series.min_value = min(finite + ([series.min_value] if series.min_value is not None else []))
        series.max_value = max(finite + ([series.max_value] if series.max_value is not None else []))
    series.save()
