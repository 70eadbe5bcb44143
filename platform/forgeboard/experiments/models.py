"""Experiments and the immutable config snapshots their runs are launched with."""

from __future__ import annotations

from functools import cached_property

from django.conf import settings
from django.db import models

from forgeboard.accounts.models import Project
from workers.engine.config import Recipe as EngineRecipe
from workers.engine.config import RunConfig

# The engine's recipes, labelled by their names ("GRPO").
Recipe = models.TextChoices("Recipe", [(recipe.name, (recipe.value, recipe.name)) for recipe in EngineRecipe])


class Experiment(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="experiments")
    name = models.CharField(max_length=200)
    recipe = models.CharField(max_length=16, choices=Recipe.choices)
    description = models.TextField(blank=True)
    tags = models.JSONField(default=list, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["project", "name"], name="experiment_unique_name"),
            models.CheckConstraint(condition=models.Q(recipe__in=Recipe.values), name="experiment_recipe_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.name}"


class ImmutableError(Exception):
    pass


class ConfigSnapshot(models.Model):
    """YAML exactly as submitted, the overrides applied to it, the validated result, and a hash. Never changes."""

    content_hash = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the text and the overrides")
    yaml_text = models.TextField()
    overrides = models.JSONField(default=list, blank=True)
    parsed = models.JSONField()
    recipe = models.CharField(max_length=16, choices=Recipe.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    def save(self, *args, **kwargs) -> None:
        if self.pk is not None:
            raise ImmutableError("a config snapshot cannot be changed")
        super().save(*args, **kwargs)

    @cached_property
    def run_config(self) -> RunConfig:
        """The engine's typed config of this snapshot: what the platform asks about a run's config after launch
        (its roles, processes, backend, hosts), defaults and all from the engine's schema."""
        return RunConfig.model_validate(self.parsed)

    def __str__(self) -> str:
        return f"config {self.content_hash[:12]}"
