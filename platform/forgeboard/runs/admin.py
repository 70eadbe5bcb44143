from django.contrib import admin

from forgeboard.runs.models import Command, Run


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("__str__", "state", "launched_by", "created_at", "restart_count", "host")
    list_filter = ("state", "backend")
    readonly_fields = ("state", "state_changed_at", "last_event_seq", "config")


@admin.register(Command)
class CommandAdmin(admin.ModelAdmin):
    list_display = ("id", "run", "kind", "state", "created_by", "created_at", "acknowledged_at")
    list_filter = ("kind", "state")
