"""Ingestion of a run's telemetry batches: in order, each exactly once, metrics in bulk (COPY on Postgres)."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.conf import settings
from django.db import connection, transaction
from django.db.models.functions import Mod
from django.utils import timezone

from forgeboard.alerts.services import alerts_for_recovery
from forgeboard.errors import Conflict, FieldProblem, ServiceError
from forgeboard.runs.models import Run
from forgeboard.telemetry.models import EventKind, LogLine, MetricPoint, MetricSeries, RunEvent, StepTimeline
from forgeboard.telemetry.services import event_to_wire, storable
from forgeboard.telemetry.streams import publish_run_update
from workers.engine.telemetry_wire import (
    MAX_DUPLICATES_LISTED,
    MAX_METRIC_KEYS_PER_RUN,
    MAX_REFUSED_PER_ANSWER,
    STEP_TIMELINE,
    DroppedDuplicate,
    RefusedItem,
    TelemetryBatch,
    WireMetric,
)

logger = logging.getLogger(__name__)
WIRE_POINTS_PER_KEY = 50
WIRE_LOG_LINES = 500  # as many as the run page keeps
WIRE_LOG_CHARS = 256_000  # of JSON: past the longest line the wire takes (telemetry_wire.MAX_LOG_LINE_CHARS), escaped
TIMELINE_KEEP_RECENT = 1_000  # steps whose timelines are all kept
TIMELINE_KEEP_EVERY = 100  # before those, the timeline of one step in this many


class SequenceGap(Conflict):
    code = "sequence_gap"

    def __init__(self, *, expected: int, got: int):
        super().__init__(f"expected telemetry batch {expected}, got {got}: resend from {expected}")
        self.expected = expected

    def as_dict(self) -> dict:
        return super().as_dict() | {"expected_seq": self.expected}


class ItemsRefused(ServiceError):
    """Items of batches not yet applied were refused: nothing of the request is stored, so the engine can send
    the same batches again without them and every batch is still applied once, in order."""

    status = 422
    code = "items_refused"

    def __init__(self, *, refused: Sequence[RefusedItem], applied_seq: int):
        shown = list(refused[:MAX_REFUSED_PER_ANSWER])
        super().__init__(
            f"{len(refused)} telemetry items refused; nothing stored: send the batches again without them",
            problems=[FieldProblem(r.field, r.reason) for r in shown[:50]],
        )
        self.refused = shown
        self.applied_seq = applied_seq

    def as_dict(self) -> dict:
        return super().as_dict() | {"applied_seq": self.applied_seq,
                                    "refused": [r.model_dump() for r in self.refused]}


@dataclass
class IngestResult:
    applied_seq: int
    duplicates: int = 0
    points: int = 0
    events: list[RunEvent] = field(default_factory=list)
    duplicates_dropped: list[DroppedDuplicate] = field(default_factory=list)
    duplicates_dropped_total: int = 0


def telemetry_ingest(
    *, run: Run, batches: Sequence[TelemetryBatch], refused: Sequence[RefusedItem] = ()
) -> IngestResult:
    """Apply batches in sequence order, in one transaction under the run's row lock. A batch already applied is
    skipped; a gap is refused (the batches before it are kept); refused items of a batch not yet applied, or its
    points of keys past the run's MAX_METRIC_KEYS_PER_RUN, refuse the request (ItemsRefused) before anything is
    stored. The keys are counted under the lock: two requests at once cannot both take the run's last free keys."""
    result = IngestResult(applied_seq=run.telemetry_seq)
    if not batches and not refused:
        Run.objects.filter(pk=run.pk).update(last_heartbeat_at=timezone.now())
        return result
    gap: SequenceGap | None = None
    with transaction.atomic():
        locked = Run.objects.select_for_update().only("pk", "telemetry_seq", "last_event_seq").get(pk=run.pk)
        result.applied_seq = locked.telemetry_seq
        if refused or any(batch.metrics for batch in batches):
            pending = [r for r in refused if r.seq > locked.telemetry_seq] or _keys_over_the_limit(
                run_id=run.pk, batches=batches, applied=locked.telemetry_seq)
            if pending:
                raise ItemsRefused(refused=pending, applied_seq=locked.telemetry_seq)
        for batch in sorted(batches, key=lambda b: b.seq):
            if batch.seq <= locked.telemetry_seq:
                result.duplicates += 1
                continue
            if batch.seq != locked.telemetry_seq + 1:
                gap = SequenceGap(expected=locked.telemetry_seq + 1, got=batch.seq)
                break
            _apply_batch(run=run, locked=locked, batch=batch, result=result)
    if gap is not None:
        raise gap
    return result


def _apply_batch(*, run: Run, locked: Run, batch: TelemetryBatch, result: IngestResult) -> None:
    """Store one batch, the next in sequence, under the lock of `locked` (the run's row, whose sequence numbers
    move on with the batch)."""
    metrics, dropped = _last_value_per_step(batch)
    result.points += _store_metrics(run_id=run.pk, metrics=metrics)
    result.duplicates_dropped_total += len(dropped)
    result.duplicates_dropped.extend(dropped[:MAX_DUPLICATES_LISTED - len(result.duplicates_dropped)])
    events = _store_events(run=locked, batch=batch)
    timelines = _store_timelines(run_id=run.pk, batch=batch)
    _alert_slow_recoveries(run=run, events=events)
    LogLine.objects.bulk_create(
        [LogLine(run_id=run.pk, batch_seq=batch.seq, index=i, line=storable(log.line), wall_time=log.time)
         for i, log in enumerate(batch.logs)]
    )
    Run.objects.filter(pk=run.pk).update(
        telemetry_seq=batch.seq, last_event_seq=locked.last_event_seq, last_heartbeat_at=timezone.now()
    )
    locked.telemetry_seq = batch.seq
    result.applied_seq = batch.seq
    result.events.extend(events)
    update = _wire_update(run=run, batch=batch, events=events, timelines=timelines)
    transaction.on_commit(lambda: publish_run_update(run=run, update=update, telemetry_seq=batch.seq))


def _keys_over_the_limit(*, run_id: int, batches: Sequence[TelemetryBatch], applied: int) -> list[RefusedItem]:
    """The points of batches not yet applied whose keys would take the run past MAX_METRIC_KEYS_PER_RUN keys (the
    keys first seen last are refused)."""
    pending = [(position, batch) for position, batch in enumerate(batches) if batch.seq > applied]
    keys = dict.fromkeys(metric.key for _, batch in pending for metric in batch.metrics)
    series = MetricSeries.objects.filter(run_id=run_id)
    if series.count() + len(keys) <= MAX_METRIC_KEYS_PER_RUN:  # every request: one count, the keys read only near it
        return []
    known = set(series.values_list("key", flat=True))  # at most the limit
    new = [key for key in keys if key not in known]
    over = set(new[max(0, MAX_METRIC_KEYS_PER_RUN - len(known)):])
    if not over:
        return []
    return [RefusedItem(seq=batch.seq, section="metrics", index=index, field=f"batches.{position}.metrics.{index}.key",
                        reason=f"a run has at most {MAX_METRIC_KEYS_PER_RUN} metric keys")
            for position, batch in pending for index, metric in enumerate(batch.metrics) if metric.key in over]


def _last_value_per_step(batch: TelemetryBatch) -> tuple[list[WireMetric], list[DroppedDuplicate]]:
    """Within a batch the last value for a key and step wins; the earlier ones are reported as dropped."""
    last: dict[tuple[str, int], int] = {}
    dropped: list[DroppedDuplicate] = []
    for index, metric in enumerate(batch.metrics):
        earlier = last.get((metric.key, metric.step))
        if earlier is not None:
            dropped.append(DroppedDuplicate(seq=batch.seq, key=metric.key, step=metric.step, index=earlier))
        last[(metric.key, metric.step)] = index
    if not dropped:
        return list(batch.metrics), []
    return [batch.metrics[i] for i in sorted(last.values())], dropped


def _store_events(*, run: Run, batch: TelemetryBatch) -> list[RunEvent]:
    """Every event but the step timelines (`_store_timelines`), each with the run's next event sequence number."""
    events = []
    for wire in batch.events:
        if wire.kind == STEP_TIMELINE:
            continue
        run.last_event_seq += 1
        events.append(RunEvent(run_id=run.pk, seq=run.last_event_seq, kind=wire.kind, payload=storable(wire.payload),
                               occurred_at=datetime.fromtimestamp(wire.time, UTC)))
    return RunEvent.objects.bulk_create(events)


def _store_timelines(*, run_id: int, batch: TelemetryBatch) -> list[dict]:
    """The batch's step timelines (validated on the wire as `StepTimeline`), one row per step: the latest wins, so a
    step run again after a restore from a checkpoint shows its second run. A week-long run keeps every step's row for
    its last TIMELINE_KEEP_RECENT steps and one in TIMELINE_KEEP_EVERY before them."""
    latest = {wire.payload["step"]: wire.payload for wire in batch.events if wire.kind == STEP_TIMELINE}
    if not latest:
        return []
    StepTimeline.objects.bulk_create(
        [StepTimeline(run_id=run_id, step=step, payload=payload) for step, payload in latest.items()],
        update_conflicts=True, unique_fields=["run", "step"], update_fields=["payload"])
    if max(latest) > TIMELINE_KEEP_RECENT:  # a shorter run keeps every step: no query
        StepTimeline.objects.filter(run_id=run_id, step__lt=max(latest) - TIMELINE_KEEP_RECENT).alias(
            every=Mod("step", TIMELINE_KEEP_EVERY)).exclude(every=0).delete()
    return [latest[step] for step in sorted(latest)]


def _alert_slow_recoveries(*, run: Run, events: list[RunEvent]) -> None:
    for event in events:
        seconds = event.payload.get("time_to_recover_s") if event.kind == EventKind.RECOVERED else None
        if isinstance(seconds, int | float) and not isinstance(seconds, bool) and math.isfinite(seconds) and seconds >= 0:
            alerts_for_recovery(run=run, recovery_s=float(seconds), threshold_s=float(settings.RECOVERY_ALERT_S))


def _series_ids(*, run_id: int, keys: set[str]) -> dict[str, int]:
    existing = dict(MetricSeries.objects.filter(run_id=run_id, key__in=keys).values_list("key", "pk"))
    missing = keys - existing.keys()
    if missing:
        MetricSeries.objects.bulk_create([MetricSeries(run_id=run_id, key=k) for k in missing], ignore_conflicts=True)
        existing = dict(MetricSeries.objects.filter(run_id=run_id, key__in=keys).values_list("key", "pk"))
    return existing


def _store_metrics(*, run_id: int, metrics: Sequence[WireMetric]) -> int:
    if not metrics:
        return 0
    series = _series_ids(run_id=run_id, keys={m.key for m in metrics})
    unique = {(series[m.key], m.step): m for m in metrics}  # unique already (_last_value_per_step)
    rows = [(sid, step, None if math.isnan(m.value) else m.value, m.time) for (sid, step), m in unique.items()]
    inserted = _insert_points_postgres(rows) if connection.vendor == "postgresql" else _insert_points_generic(rows)
    by_series: dict[int, list[WireMetric]] = {}
    for (sid, _), metric in unique.items():
        by_series.setdefault(sid, []).append(metric)
    summaries = [_batch_summary(series_id=sid, points=points, inserted=inserted[sid])
                 for sid, points in by_series.items()]
    if connection.vendor == "postgresql":
        _update_summaries_postgres(summaries)
    else:
        for summary in summaries:
            _update_summary(summary)
    return sum(inserted.values())


@dataclass(frozen=True)
class _Summary:
    series_id: int
    inserted: int
    first_step: int
    last_step: int
    last_value: float
    min_value: float | None
    max_value: float | None


def _batch_summary(*, series_id: int, points: list[WireMetric], inserted: int) -> _Summary:
    latest = max(points, key=lambda p: p.step)
    finite = [p.value for p in points if math.isfinite(p.value)]
    return _Summary(series_id=series_id, inserted=inserted, first_step=min(p.step for p in points),
                    last_step=latest.step, last_value=latest.value, min_value=min(finite, default=None),
                    max_value=max(finite, default=None))


def _update_summaries_postgres(summaries: list[_Summary]) -> None:
    """One UPDATE for every series of the batch (LEAST/GREATEST skip NULLs)."""
    table = MetricSeries._meta.db_table
    values = ", ".join(["(%s::bigint, %s::bigint, %s::bigint, %s::bigint, %s::float8, %s::float8, %s::float8)"]
                       * len(summaries))
    params = [x for s in summaries for x in (s.series_id, s.inserted, s.first_step, s.last_step, s.last_value,
                                             s.min_value, s.max_value)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} AS s SET point_count = s.point_count + v.inserted, "
            "first_step = LEAST(s.first_step, v.first_step), "
            "last_step = GREATEST(s.last_step, v.last_step), "
            "last_value = CASE WHEN s.last_step IS NULL OR v.last_step >= s.last_step "
            "THEN v.last_value ELSE s.last_value END, "
            "min_value = LEAST(s.min_value, v.min_value), max_value = GREATEST(s.max_value, v.max_value) "
            f"FROM (VALUES {values}) AS v(id, inserted, first_step, last_step, last_value, min_value, max_value) "
            "WHERE s.id = v.id",
            params,
        )


def _insert_points_postgres(rows: list[tuple[int, int, float, float]]) -> Counter:
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMP TABLE IF NOT EXISTS fb_points_in "
            "(series_id bigint, step bigint, value double precision, wall_time double precision) "
            "ON COMMIT DELETE ROWS"
        )
        # One text buffer rather than a write per row: this loop is the hot path of ingestion.
        null = "\\N"
        text = "".join(f"{sid}\t{step}\t{null if value is None else repr(value)}\t{wall!r}\n"
                       for sid, step, value, wall in rows)
        with cursor.cursor.copy("COPY fb_points_in (series_id, step, value, wall_time) FROM STDIN") as copy:
            copy.write(text)
        cursor.execute(
            f"WITH inserted AS (INSERT INTO {MetricPoint._meta.db_table} (series_id, step, value, wall_time) "
            "SELECT series_id, step, value, wall_time FROM fb_points_in "
            "ON CONFLICT (series_id, step) DO NOTHING RETURNING series_id) "
            "SELECT series_id, count(*) FROM inserted GROUP BY series_id"
        )
        inserted = Counter(dict(cursor.fetchall()))
        cursor.execute("TRUNCATE fb_points_in")
    return inserted


def _insert_points_generic(rows: list[tuple[int, int, float, float]]) -> Counter:
    stored: set[tuple[int, int]] = set()
    for sid in {r[0] for r in rows}:
        steps = [r[1] for r in rows if r[0] == sid]
        stored |= {(sid, s) for s in MetricPoint.objects.filter(series_id=sid, step__in=steps)
                   .values_list("step", flat=True)}
    fresh = [r for r in rows if (r[0], r[1]) not in stored]
    MetricPoint.objects.bulk_create(
        [MetricPoint(series_id=sid, step=step, value=value, wall_time=t) for sid, step, value, t in fresh],
        ignore_conflicts=True, batch_size=5000,
    )
    return Counter(r[0] for r in fresh)


def _update_summary(summary: _Summary) -> None:
    series = MetricSeries.objects.select_for_update().get(pk=summary.series_id)
    series.point_count += summary.inserted
    series.first_step = min(x for x in (series.first_step, summary.first_step) if x is not None)
    if series.last_step is None or summary.last_step >= series.last_step:
        series.last_step, series.last_value = summary.last_step, summary.last_value
    series.min_value = min((x for x in (series.min_value, summary.min_value) if x is not None), default=None)
    series.max_value = max((x for x in (series.max_value, summary.max_value) if x is not None), default=None)
    series.save()


def wire_number(value: float | None) -> float | None:
    """JSON has no NaN or infinity: browsers get null for them."""
    return value if value is not None and math.isfinite(value) else None


def _wire_update(*, run: Run, batch: TelemetryBatch, events: list[RunEvent], timelines: list[dict]) -> dict:
    """What subscribers get: every event and step timeline, at most a few points per metric key, and the batch's last
    log lines up to WIRE_LOG_LINES and WIRE_LOG_CHARS of JSON (the database has all): `logs_left_out` says how many
    lines before them it leaves out, which the run stream sends from the database."""
    by_key: dict[str, list[list[float]]] = {}
    for metric in batch.metrics:  # the engine reports in step order
        by_key.setdefault(metric.key, []).append([metric.step, wire_number(metric.value)])
    for key, points in by_key.items():
        if len(points) > WIRE_POINTS_PER_KEY:
            sampled = points[:: -(-len(points) // WIRE_POINTS_PER_KEY)]
            if sampled[-1] is not points[-1]:
                sampled.append(points[-1])
            by_key[key] = sampled
    logs = _wire_logs([log.line for log in batch.logs])
    return {
        "type": "run.update",
        "run": run.pk,
        "batch": batch.seq,
        "events": [event_to_wire(e) for e in events],
        "metrics": by_key,
        "logs": logs,
        "logs_left_out": len(batch.logs) - len(logs),
        "timelines": timelines,
    }


def _wire_logs(lines: Sequence[str]) -> list[str]:
    """The last of these lines, up to WIRE_LOG_LINES of them and WIRE_LOG_CHARS as JSON (none if the last is longer)."""
    kept: list[str] = []
    chars = 0
    for line in reversed(lines[-WIRE_LOG_LINES:]):
        chars += len(json.dumps(line)) + 2  # its quotes and escapes, and the comma and space between lines
        if chars > WIRE_LOG_CHARS:
            break
        kept.append(line)
    return kept[::-1]
