"""Where a run's files are on the host it runs on: its config, token, spool, logs, checkpoints and exports."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from forgeboard.runs.models import Run


def run_dir(run: Run) -> Path:
    return Path(settings.DATA_DIR) / "runs" / f"{run.pk}-{run.uid.hex[:12]}"
