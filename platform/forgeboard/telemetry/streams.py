"""Pushes to websocket subscribers through the channel layer (Redis, or SQLite in the embedded default).

Subscribers of a run get its events, downsampled metrics and log lines; subscribers of a project
get its runs' state changes. Pushing is best effort: the database holds everything, and a client
that reconnects reads what it missed from there. Each run update says how far the run's events and
telemetry batches go, so a stream that finds some missing (an update lost or late) sends them from
the database too. A credential's streams are told when its access is withdrawn
(`publish_access_withdrawn`), so they check it again at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from forgeboard.runs.models import Run

logger = logging.getLogger(__name__)


def run_group(run_id: int) -> str:
    return f"run-{run_id}"


def project_group(project_id: int) -> str:
    return f"project-{project_id}"


def actor_group(*, kind: str, pk: int) -> str:
    """The streams a user ("user") or an API token ("token") holds open."""
    return f"{kind}-{pk}"


def publish_access_withdrawn(*, groups: Iterable[str]) -> None:
    """Once the transaction that withdrew some access commits, tell these actor groups' streams to check theirs."""
    targets = list(groups)

    def send() -> None:
        layer = get_channel_layer()
        for group in targets if layer is not None else ():
            try:
                async_to_sync(layer.group_send)(group, {"type": "access.check"})
            except Exception:  # noqa: BLE001 - each stream also checks on its own every STREAM_ACCESS_RECHECK_S
                logger.exception("could not tell %s's streams to check their access", group)

    transaction.on_commit(send)


def publish_run_update(*, run: Run, update: dict, telemetry_seq: int) -> None:
    """Push a run's update to its subscribers, with how far the run's telemetry goes as of it (`telemetry_seq`, from the
    caller, which read it as it stored the update: a batch's own, or for the platform's events the run's last): a
    stream that missed the run's last batches learns it here, however long the engine stays quiet."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        seqs = [e["seq"] for e in update.get("events", [])]
        steps = [point[0] for points in update.get("metrics", {}).values() for point in points]
        # Encoded once here rather than once per subscriber: fan-out to many clients stays cheap.
        message = {"type": "run.update", "update": update, "text": json.dumps(update),
                   "min_seq": min(seqs, default=None), "last_step": max(steps, default=None),
                   "telemetry_seq": telemetry_seq}
        async_to_sync(layer.group_send)(run_group(run.pk), message)
        state_changes = [e for e in update.get("events", []) if e["kind"] == "state_changed"]
        if state_changes:
            project_id = run.experiment.project_id
            async_to_sync(layer.group_send)(
                project_group(project_id),
                {"type": "project.update", "update": {"type": "run.state", "run": run.pk,
                                                      "state": state_changes[-1]["payload"].get("to")}},
            )
    except Exception:  # noqa: BLE001 - the stored data is the source of truth; log and go on
        logger.exception("could not push an update for run %s", run.pk)
