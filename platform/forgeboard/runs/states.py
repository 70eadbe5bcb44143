"""Run states and the only transitions allowed between them."""

from __future__ import annotations

from django.db import models


class RunState(models.TextChoices):
    QUEUED = "queued", "Queued"
    LAUNCHING = "launching", "Launching"
    RUNNING = "running", "Running"
    PAUSED = "paused", "Paused"
    CANCELLING = "cancelling", "Cancelling"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    LOST = "lost", "Lost"


S = RunState
TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    S.QUEUED: frozenset({S.LAUNCHING, S.CANCELLED}),
    S.LAUNCHING: frozenset({S.RUNNING, S.FAILED, S.CANCELLING, S.LOST}),
    # Back to launching: its cluster scheduler requeued its job (SLURM after a node failure, `scontrol requeue`), which
    # starts its engine again when it runs it (workers/launch/jobs.py `follow_job`).
    S.RUNNING: frozenset({S.PAUSED, S.CANCELLING, S.SUCCEEDED, S.FAILED, S.LOST, S.LAUNCHING}),
    # Paused -> succeeded: an engine leaves its pause only for a resume or a cancel (workers/engine/run_control.py), so
    # one that finished while its run reads paused was resumed, and had not yet reported it.
    S.PAUSED: frozenset({S.RUNNING, S.CANCELLING, S.SUCCEEDED, S.FAILED, S.LOST, S.LAUNCHING}),
    # Never lost: a run its owner asked to stop is not restarted; one whose controller went silent ends cancelled.
    S.CANCELLING: frozenset({S.CANCELLED, S.FAILED}),
    # A lost run is restarted from its last checkpoint (back to queued) or given up on; or it ends as its attempt did
    # when the party that watches that attempt finds it finished after all, before the attempt is confirmed stopped
    # (its local engine exited, its job completed: runs/reconcile.py `lost_attempt_finished`).
    S.LOST: frozenset({S.QUEUED, S.FAILED, S.SUCCEEDED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
# The one move out of an end state, made only by `run_transition(..., late_outcome=True)`: a run that failed only
# because it was lost (out of restarts, or its attempt not confirmed stopped in time) is still followed until its
# attempt is confirmed gone (`Run.leftover_stop_since`); if that attempt is then found to have finished by itself (its
# local engine exited 0, its job completed), the run succeeded after all (runs/reconcile.py `lost_attempt_finished`).
# Kept out of TRANSITIONS: a failed run is ended for everything else (commands, alerts, the scheduler's capacity).
LATE_OUTCOMES: dict[RunState, frozenset[RunState]] = {S.FAILED: frozenset({S.SUCCEEDED})}
TERMINAL_STATES = frozenset(state for state, targets in TRANSITIONS.items() if not targets)
ACTIVE_STATES = frozenset({S.LAUNCHING, S.RUNNING, S.PAUSED, S.CANCELLING})
# The states in which the cancel action moves a run on, and those in which it takes operator commands (the services
# refuse the rest; the run page shows only the actions that apply and follows the run's state as it changes).
CANCELLABLE_STATES = frozenset({S.QUEUED, S.LAUNCHING, S.RUNNING, S.PAUSED})
COMMAND_STATES = frozenset({S.LAUNCHING, S.RUNNING, S.PAUSED})


def sources_of(target: RunState) -> frozenset[RunState]:
    return frozenset(source for source, targets in TRANSITIONS.items() if target in targets)
