from django.contrib import admin

from forgeboard.cluster.models import Device, Host


class DeviceInline(admin.TabularInline):
    model = Device
    extra = 0


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ("hostname", "pool", "state", "health", "cpu_count", "last_heartbeat_at")
    list_filter = ("state", "health", "pool")
    inlines = [DeviceInline]
