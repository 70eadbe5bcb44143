"""Webhooks a project subscribes to run alerts, and each delivery of one alert to one webhook."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from forgeboard.accounts.models import Project


class AlertEvent(models.TextChoices):
    RUN_FAILED = "run_failed", "Run failed"
    RUN_LOST = "run_lost", "Run lost"
    DRILL_RECOVERY_SLOW = "drill_recovery_slow", "Drill recovery slower than its threshold"


class Webhook(models.Model):
    """POSTs JSON to `url`, signed: `X-Forgeboard-Signature: sha256=<HMAC-SHA256 of the body with secret>`."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="webhooks")
    url = models.URLField(max_length=2000)
    events = models.JSONField(default=list, help_text="The AlertEvent values this webhook receives")
    secret = models.CharField(max_length=128, help_text="Signs each body; shown to the owner who creates it")
    active = models.BooleanField(default=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["project", "id"]

    def __str__(self) -> str:
        return f"webhook {self.pk} of {self.project} → {self.url}"


class WebhookDelivery(models.Model):
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=32, choices=AlertEvent.choices)
    payload = models.JSONField()
    status_code = models.PositiveSmallIntegerField(null=True, blank=True, help_text="Of the last attempt")
    attempts = models.PositiveIntegerField(default=0)
    delivered_at = models.DateTimeField(null=True, blank=True, help_text="When an attempt got a 2xx answer")
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(event__in=AlertEvent.values), name="webhookdelivery_event_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.event} to webhook {self.webhook_id} ({self.attempts} attempts)"
