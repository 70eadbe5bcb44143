"""Where a run's metrics and events are stored.

Metric points are the bulk of the data (millions per run): one narrow row per
(series, step) with a composite primary key, so the key index serves range
queries and makes a repeated point a no-op.
"""

from __future__ import annotations

from django.db import models

from forgeboard.runs.models import Run

METRIC_KEY_MAX_LENGTH = 200


class MetricSeries(models.Model):
    """One metric key of one run, with a summary kept current on ingest."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metric_series")
    key = models.CharField(max_length=METRIC_KEY_MAX_LENGTH)
    point_count = models.BigIntegerField(default=0)
    first_step = models.BigIntegerField(null=True, blank=True)
    last_step = models.BigIntegerField(null=True, blank=True)
    last_value = models.FloatField(null=True, blank=True)
    min_value = models.FloatField(null=True, blank=True)
    max_value = models.FloatField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "key"], name="metricseries_unique_key")]

    def __str__(self) -> str:
        return f"{self.run} {self.key}"


class MetricPoint(models.Model):
    pk = models.CompositePrimaryKey("series", "step")
    series = models.ForeignKey(MetricSeries, on_delete=models.CASCADE, related_name="points")
    step = models.BigIntegerField()
    value = models.FloatField(null=True, help_text="null when the engine reported NaN (SQLite cannot store NaN)")
    wall_time = models.FloatField(help_text="Unix seconds when the engine recorded the point")


class EventKind(models.TextChoices):
    STATE_CHANGED = "state_changed", "State changed"
    PLACEMENT_APPLIED = "placement_applied", "Placement applied"
    PLACEMENT_CHANGED = "placement_changed", "Placement changed"
    FAULT_INJECTED = "fault_injected", "Fault injected"
    FAILURE_DETECTED = "failure_detected", "Failure detected"
    REPLICA_REPLACED = "replica_replaced", "Replica replaced"
    RECOVERED = "recovered", "Recovered"
    REDIRECT_STARTED = "redirect_started", "Redirect started"
    REDIRECT_FINISHED = "redirect_finished", "Redirect finished"
    CHECKPOINT_SAVED = "checkpoint_saved", "Checkpoint saved"
    COMMAND_ISSUED = "command_issued", "Command issued"
    COMMAND_ACKNOWLEDGED = "command_acknowledged", "Command acknowledged"
    COMMAND_FINISHED = "command_finished", "Command finished"
    RESTARTED = "restarted", "Restarted"
    EVAL = "eval", "Evaluation"
    ROLLOUT = "rollout", "Rollout sample"
    MESSAGE = "message", "Message"


class RunEvent(models.Model):
    """A typed event with a per-run sequence number: clients resume from the last one they saw."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    seq = models.BigIntegerField()
    kind = models.CharField(max_length=32, choices=EventKind.choices)
    payload = models.JSONField(default=dict, blank=True)
    occurred_at = models.DateTimeField(help_text="When it happened, by the reporter's clock")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["run", "seq"], name="runevent_unique_seq"),
            models.CheckConstraint(condition=models.Q(kind__in=EventKind.values), name="runevent_kind_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.run} #{self.seq} {self.kind}"


class LogLine(models.Model):
    """A line of the run's output, kept for the dashboard's log tail."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="log_lines")
    batch_seq = models.BigIntegerField()
    index = models.PositiveIntegerField()
    line = models.TextField()
    wall_time = models.FloatField()

    class Meta:
        ordering = ["run", "batch_seq", "index"]
        constraints = [models.UniqueConstraint(fields=["run", "batch_seq", "index"], name="logline_unique_position")]


class StepTimeline(models.Model):
    """Where one training step's time went: the engine's `step_timeline` (a `telemetry_wire.StepTimeline`), one row
    per (run, step); a step run again after a restore from a checkpoint replaces its row."""

    pk = models.CompositePrimaryKey("run", "step")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="step_timelines")
    step = models.BigIntegerField()
    payload = models.JSONField()  # its "start": Unix seconds when the step started, by the engine's clock
