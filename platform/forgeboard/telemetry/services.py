"""Where a run's events and metric points are written."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from forgeboard.errors import ValidationFailed
from forgeboard.runs.models import Run
from forgeboard.telemetry.models import EventKind, RunEvent
from forgeboard.telemetry.streams import publish_run_update


NUL = "\x00"


def storable(value: Any) -> Any:
    """The value with NUL characters replaced (U+FFFD): Postgres text and jsonb refuse them, and a random
    model's completions contain them. Applied to everything a run reports that is stored as text."""
    if isinstance(value, str):
        return value.replace(NUL, "\ufffd") if NUL in value else value
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


@transaction.atomic
def event_append(
    *, run: Run, kind: EventKind | str, payload: Mapping[str, Any] | None = None, occurred_at: datetime | None = None
) -> RunEvent:
    """Append an event with the run's next sequence number (the UPDATE's row lock orders concurrent appenders)."""
    if kind not in EventKind.values:
        raise ValidationFailed.on("kind", f"unknown event kind {kind!r}")
    Run.objects.filter(pk=run.pk).update(last_event_seq=F("last_event_seq") + 1)
    # The run's last telemetry batch too, read under the UPDATE's row lock with its sequence (an ingest holds that lock
    # while it stores a batch): the event's subscribers learn from it which batches it comes after.
    seq, telemetry_seq = Run.objects.filter(pk=run.pk).values_list("last_event_seq", "telemetry_seq").get()
    run.last_event_seq = seq
    event = RunEvent.objects.create(
        run_id=run.pk, seq=seq, kind=kind, payload=storable(dict(payload or {})), occurred_at=occurred_at or timezone.now()
    )
    update = {"type": "run.update", "run": run.pk, "events": [event_to_wire(event)], "metrics": {}, "logs": []}
    transaction.on_commit(lambda: publish_run_update(run=run, update=update, telemetry_seq=telemetry_seq))
    return event


def event_to_wire(event: RunEvent) -> dict:
    return {"seq": event.seq, "kind": event.kind, "payload": event.payload, "time": event.occurred_at.isoformat()}
