"""The audit trail: who did what to which object, when, with what payload."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class AuditEvent(models.Model):
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    actor_label = models.CharField(max_length=200, help_text="user:NAME or token:PREFIX, kept if the user is deleted")
    action = models.CharField(max_length=100, db_index=True)
    target_type = models.CharField(max_length=100)
    target_id = models.CharField(max_length=100)
    project = models.ForeignKey(
        "accounts.Project", null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_events"
    )
    payload = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["target_type", "target_id"], name="audit_target_idx")]

    def __str__(self) -> str:
        return f"{self.actor_label} {self.action} {self.target_type}:{self.target_id}"
