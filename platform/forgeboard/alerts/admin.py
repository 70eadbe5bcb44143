from django.contrib import admin
from django.http import HttpRequest

from forgeboard.alerts.models import Webhook, WebhookDelivery


@admin.register(Webhook)
class WebhookAdmin(admin.ModelAdmin):
    """Made by `webhook_create` (URL checked, secret minted, audited), not in the admin; the secret is not shown."""

    list_display = ("id", "project", "url", "active", "created_at")
    list_filter = ("active",)
    fields = ("project", "url", "events", "active", "created_by", "created_at")
    readonly_fields = ("project", "url", "events", "created_by", "created_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = ("id", "webhook", "event", "status_code", "attempts", "delivered_at", "created_at")
    list_filter = ("event",)
    readonly_fields = [f.name for f in WebhookDelivery._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
