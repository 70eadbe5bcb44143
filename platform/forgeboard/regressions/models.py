"""Regression suites, their runs, and the verdict of every stage and check."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from forgeboard.accounts.models import Project
from forgeboard.runs.models import Run


class Suite(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="suites")
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True)
    spec = models.JSONField(help_text="a validated SuiteSpec (regressions/spec.py)")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="suite_unique_name")]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.name}"


class Verdict(models.TextChoices):
    RUNNING = "running", "Running"
    PASSED = "passed", "Passed"
    FAILED = "failed", "Failed"
    WARNED = "warned", "Passed with warnings"
    NO_BASELINE = "no_baseline", "No baseline yet"
    ERROR = "error", "Error"


class SuiteRun(models.Model):
    suite = models.ForeignKey(Suite, on_delete=models.CASCADE, related_name="suite_runs")
    spec = models.JSONField(help_text="the suite's spec when this run was launched")
    verdict = models.CharField(max_length=16, choices=Verdict.choices, default=Verdict.RUNNING)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]


class StageResult(models.Model):
    suite_run = models.ForeignKey(SuiteRun, on_delete=models.CASCADE, related_name="stages")
    name = models.CharField(max_length=100)
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="stage_results")
    verdict = models.CharField(max_length=16, choices=Verdict.choices, default=Verdict.RUNNING)
    predicted_step_s = models.FloatField(null=True, blank=True, help_text="the what-if model's step seconds for the "
                                         "stage's config, calibrated on the suite run's first stage (runs/planning.py)")
    measured_step_s = models.FloatField(null=True, blank=True, help_text="the median step of the stage's run")
    prediction_note = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["id"]

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured, or None without both."""
        if self.predicted_step_s is None or not self.measured_step_s:
            return None
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s


class CheckResult(models.Model):
    stage = models.ForeignKey(StageResult, on_delete=models.CASCADE, related_name="checks")
    name = models.CharField(max_length=100)
    metric = models.CharField(max_length=200)
    gate = models.BooleanField()
    value = models.FloatField(null=True)
    baseline = models.FloatField(null=True)
    threshold = models.FloatField(null=True)
    verdict = models.CharField(max_length=16, choices=Verdict.choices)
    detail = models.TextField(blank=True)

    class Meta:
        ordering = ["id"]
