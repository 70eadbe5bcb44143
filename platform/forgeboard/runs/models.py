"""Runs and the operator commands sent to them."""

from __future__ import annotations

import uuid
from typing import get_args

from django.conf import settings
from django.db import models

from forgeboard.experiments.models import ConfigSnapshot, Experiment
from forgeboard.runs.states import RunState
from workers.engine.config import PlacementConfig


_BACKEND_LABELS = {"local": "Local subprocess", "monarch": "Monarch multi-host", "slurm": "SLURM",
                   "kubernetes": "Kubernetes"}
# The engine's placement backends (placement.backend), with their labels here.
LaunchBackend = models.TextChoices("LaunchBackend", [
    (backend.upper(), (backend, _BACKEND_LABELS[backend]))
    for backend in get_args(PlacementConfig.model_fields["backend"].annotation)])


# Runs queued and placed by a cluster scheduler, not on Forgeboard's inventory.
EXTERNAL_BACKENDS = frozenset({LaunchBackend.SLURM, LaunchBackend.KUBERNETES})


class Run(models.Model):
    uid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False, help_text="Names its files and jobs")
    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="runs")
    number = models.PositiveIntegerField(help_text="1, 2, 3… within the experiment")
    config = models.ForeignKey(ConfigSnapshot, on_delete=models.PROTECT, related_name="runs")
    state = models.CharField(max_length=16, choices=RunState.choices, default=RunState.QUEUED)
    placement_plan = models.JSONField(default=dict, blank=True)
    artifact_paths = models.JSONField(
        default=dict, blank=True,
        help_text="The config's paths and artifact references resolved in the run's project at launch: "
                  '{"model.path": "/abs", ...}; what its engine is given (artifacts/resolver.py)')
    allocation = models.JSONField(
        default=dict, blank=True, help_text="What the scheduler reserved while the run is active: {hostname: {gpus, slots}}"
    )
    priority = models.SmallIntegerField(default=0)
    launched_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children",
        help_text="The run this one was cloned or resumed from",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    restart_count = models.PositiveIntegerField(default=0)
    max_restarts = models.PositiveIntegerField(default=0)
    exit_reason = models.TextField(blank=True)
    backend = models.CharField(max_length=16, choices=LaunchBackend.choices, default=LaunchBackend.LOCAL)
    host = models.CharField(max_length=255, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    job_id = models.CharField(max_length=255, blank=True)
    leftover_stop_since = models.DateTimeField(
        null=True, blank=True,
        help_text="A failed run whose last attempt may still run (its job_id, or its engine's pid on host): since when "
                  "the reconciler asks a worker to stop it, at every pass until one confirms it gone or the stop "
                  "timeout passes (runs/reconcile.py); null when nothing is left to stop")
    log_path = models.CharField(max_length=1024, blank=True)
    last_event_seq = models.BigIntegerField(default=0)
    telemetry_seq = models.BigIntegerField(
        default=0, help_text="The last telemetry batch applied; the next must be this + 1 (exactly once)"
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["experiment", "number"], name="run_unique_number"),
            models.CheckConstraint(condition=models.Q(state__in=RunState.values), name="run_state_valid"),
        ]
        indexes = [models.Index(fields=["state", "priority", "created_at"], name="run_queue_idx")]

    def __str__(self) -> str:
        return f"{self.experiment}#{self.number}"


class CommandKind(models.TextChoices):
    CANCEL = "cancel", "Cancel"
    PAUSE = "pause", "Pause"
    RESUME = "resume", "Resume"
    PLACEMENT_CHANGE = "placement_change", "Placement change"
    FAULT_DRILL = "fault_drill", "Fault drill"
    LOAD_REDIRECT = "load_redirect", "Load redirect"
    CHECKPOINT = "checkpoint", "Checkpoint now"


class CommandState(models.TextChoices):
    PENDING = "pending", "Pending"
    DELIVERED = "delivered", "Delivered"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    EXPIRED = "expired", "Expired"


# A controller may still finish these; the others are final (but see `command_finish` for a late report).
OPEN_COMMAND_STATES = (CommandState.PENDING, CommandState.DELIVERED)


class Command(models.Model):
    """An operator command. The controller pulls it by id, acknowledges it, and reports its result."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="commands")
    kind = models.CharField(max_length=32, choices=CommandKind.choices)
    payload = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=CommandState.choices, default=CommandState.PENDING)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    delivery_count = models.PositiveIntegerField(default=0)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(kind__in=CommandKind.values), name="command_kind_valid"),
            models.CheckConstraint(condition=models.Q(state__in=CommandState.values), name="command_state_valid"),
        ]
        indexes = [models.Index(fields=["run", "state", "id"], name="command_pending_idx")]

    def __str__(self) -> str:
        return f"{self.kind} for {self.run} ({self.state})"


class RunToken(models.Model):
    """The credential a run's controller uses to report telemetry and pull commands: `fbr_<prefix>_<secret>`."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="tokens")
    prefix = models.CharField(max_length=16, unique=True)
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"run token fbr_{self.prefix}_… for {self.run}"


class PendingChildRun(models.Model):
    """A run asked for from a checkpoint whose export was not done yet: the task that finishes the export starts it
    (or says on the parent's timeline why it could not). One export serves every run asked for meanwhile."""

    parent = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="pending_children")
    step = models.BigIntegerField()
    actor_kind = models.CharField(max_length=8, help_text="user or token: who asked, and as whom the run starts")
    actor_id = models.BigIntegerField()
    experiment = models.ForeignKey(Experiment, null=True, blank=True, on_delete=models.CASCADE,
                                   help_text="The child's experiment; none: the parent's")
    config_yaml = models.TextField(null=True, blank=True, help_text="The child's config; none: the parent's")
    overrides = models.JSONField(default=list, blank=True)
    priority = models.SmallIntegerField(null=True, blank=True, help_text="None: the parent's")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["parent", "step"], name="pending_child_export_idx")]

    def __str__(self) -> str:
        return f"a run from step {self.step} of {self.parent}"


class CheckpointExportState(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    FAILED = "failed"


class CheckpointExport(models.Model):
    """An export of a run's checkpoint that is queued, running or failed: a complete export folder says done, and
    its row is deleted then. Read and written under the run's row lock (runs/checkpoints.py `_lock_exports`)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="exports")
    step = models.BigIntegerField()
    state = models.CharField(max_length=8, choices=CheckpointExportState.choices)
    error = models.TextField(blank=True, default="", help_text="Why it failed, when it did")
    attempt = models.PositiveIntegerField(
        default=1, help_text="Which sending of its task runs it: a task message of another attempt does nothing")
    requeues = models.PositiveSmallIntegerField(
        default=0, help_text="How often it was lost and queued again since it was asked for")
    requested_by = models.CharField(max_length=200, help_text="Who asked first (user:NAME or token:PREFIX)")
    worker = models.CharField(max_length=200, blank=True, default="", help_text="The host and process running it")
    updated_at = models.DateTimeField(
        help_text="When its state was last written: queued or running longer than FORGEBOARD_EXPORT_LOST_AFTER_S "
                  "means lost")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "step"], name="checkpoint_export_once"),
            models.CheckConstraint(condition=models.Q(state__in=CheckpointExportState.values),
                                   name="checkpoint_export_state_valid"),
        ]
        indexes = [models.Index(fields=["state", "updated_at"], name="checkpoint_export_lost_idx")]

    def __str__(self) -> str:
        return f"export of step {self.step} of {self.run} ({self.state})"
