from django.contrib import admin
from django.http import HttpRequest

from forgeboard.cluster.models import AgentToken, Device, Host


class DeviceInline(admin.TabularInline):
    model = Device
    extra = 0


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ("hostname", "pool", "liveness", "intent", "health", "cpu_count", "last_heartbeat_at")
    list_filter = ("liveness", "intent", "health", "pool")
    inlines = [DeviceInline]


@admin.register(AgentToken)
class AgentTokenAdmin(admin.ModelAdmin):
    """Read-only: a token is made by `agent_token_create` (its plaintext is shown once), not in the admin."""

    list_display = ("name", "prefix", "created_by", "created_at", "last_used_at", "revoked_at")
    readonly_fields = ("name", "prefix", "token_hash", "created_by", "created_at", "last_used_at", "revoked_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
