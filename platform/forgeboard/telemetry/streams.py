"""Pushes to websocket subscribers through the channel layer (Redis, or SQLite in the embedded default).

Subscribers of a run get its events, downsampled metrics and log lines; subscribers of a project
get its runs' state changes. Pushing is best effort: the database holds everything, and a client
that reconnects reads what it missed from there.
"""

from __future__ import annotations

import json
import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)


def run_group(run_id: int) -> str:
    return f"run-{run_id}"


def project_group(project_id: int) -> str:
    return f"project-{project_id}"


def publish_run_update(*, run, update: dict) -> None:  # noqa: ANN001 - a Run; imported lazily by callers
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        seqs = [e["seq"] for e in update.get("events", [])]
        # Encoded once here rather than once per subscriber: fan-out to many clients stays cheap.
        message = {"type": "run.update", "update": update, "text": json.dumps(update),
                   "min_seq": min(seqs, default=None)}
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
