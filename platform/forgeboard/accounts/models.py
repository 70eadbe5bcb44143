"""Users, projects (teams) with roles, and API tokens."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import AbstractUser
from django.core.validators import RegexValidator
from django.db import models


class User(AbstractUser):
    is_operator = models.BooleanField(
        default=False, help_text="Platform-wide operator: may change the cluster inventory and drain hosts."
    )


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"
    MEMBER = "member", "Member"
    OWNER = "owner", "Owner"

    @property
    def rank(self) -> int:
        return {"viewer": 1, "member": 2, "owner": 3}[self.value]


slug_validator = RegexValidator(r"^[a-z0-9][a-z0-9-]{0,62}$", "lowercase letters, digits and dashes, 1-63 characters")


class Project(models.Model):
    slug = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, through="Membership", related_name="projects")
    max_concurrent_runs = models.PositiveIntegerField(
        null=True, blank=True, help_text="Runs launching, running, paused or cancelling at once; empty: unlimited"
    )
    max_gpus = models.PositiveIntegerField(
        null=True, blank=True, help_text="GPUs held by the project's active runs at once; empty: unlimited"
    )

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "user"], name="membership_unique_user"),
            models.CheckConstraint(condition=models.Q(role__in=Role.values), name="membership_role_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.user} is {self.role} of {self.project}"


class TokenScope(models.TextChoices):
    READ = "read", "Read only"
    WRITE = "write", "Read and write"


class ApiToken(models.Model):
    """A bearer token `fb_<prefix>_<secret>`; only a SHA-256 of the whole token is stored."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    token_hash = models.CharField(max_length=64, unique=True)
    scope = models.CharField(max_length=8, choices=TokenScope.choices)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "name"], name="apitoken_unique_name"),
            models.CheckConstraint(condition=models.Q(scope__in=TokenScope.values), name="apitoken_scope_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.name} (fb_{self.prefix}_…)"
