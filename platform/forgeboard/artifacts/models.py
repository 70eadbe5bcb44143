"""Models and datasets registered by name in a project, each a path inside the configured artifact roots."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from forgeboard.accounts.models import Project


class ArtifactKind(models.TextChoices):
    MODEL = "model", "Model (Hugging Face folder)"
    DATASET = "dataset", "Dataset (JSONL file)"


class Artifact(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="artifacts")
    name = models.CharField(max_length=100, help_text="referenced as <name> in its project, <project>/<name> elsewhere")
    kind = models.CharField(max_length=16, choices=ArtifactKind.choices)
    path = models.CharField(max_length=4096, help_text="resolved (no symlinks, no ..), inside FORGEBOARD_ARTIFACT_ROOTS")
    description = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["project", "name"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="artifact_unique_name_in_project")]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.name}"
