"""Launch backends: start a claimed run's engine controller somewhere and return at once."""

from __future__ import annotations

import logging

from forgeboard.runs.models import LaunchBackend, Run
from forgeboard.runs.services import run_transition
from forgeboard.runs.states import RunState

logger = logging.getLogger(__name__)


def start_run(*, run_id: int) -> None:
    """Hand a launching run to its backend; a backend that cannot start it fails the run with the reason."""
    run = Run.objects.select_related("config").get(pk=run_id)
    if run.backend == LaunchBackend.LOCAL:
        from workers.launch.local import start_local

        try:
            start_local(run=run)
        except OSError as exc:
            run_transition(run_id=run_id, from_state=RunState.LAUNCHING, to_state=RunState.FAILED,
                           reason=f"local launch failed: {exc}")
        return
    if run.backend == LaunchBackend.SLURM:
        from workers.launch.slurm_backend import slurm_configured, submit_slurm

        if slurm_configured():
            submit_slurm(run=run)
            return
    if run.backend == LaunchBackend.KUBERNETES:
        from workers.launch.kubernetes_backend import kubernetes_configured, submit_kubernetes

        if kubernetes_configured():
            submit_kubernetes(run=run)
            return
    run_transition(
        run_id=run_id, from_state=RunState.LAUNCHING, to_state=RunState.FAILED,
        reason=f"launch backend {run.backend!r} is not configured on this worker",
    )
