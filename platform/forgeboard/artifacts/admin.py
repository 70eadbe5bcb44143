from django.contrib import admin
from django.http import HttpRequest

from forgeboard.artifacts.models import Artifact


@admin.register(Artifact)
class ArtifactAdmin(admin.ModelAdmin):
    """Registered by `artifact_register` (path checked against the roots, audited), not in the admin."""

    list_display = ("id", "project", "name", "kind", "path", "created_at")
    list_filter = ("kind",)
    readonly_fields = ("project", "name", "kind", "path", "description", "created_by", "created_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Artifact | None = None) -> bool:
        return False
