from django.contrib import admin

from forgeboard.telemetry.models import MetricSeries, RunEvent


@admin.register(MetricSeries)
class MetricSeriesAdmin(admin.ModelAdmin):
    list_display = ("run", "key", "point_count", "last_step", "last_value")
    search_fields = ("key",)


@admin.register(RunEvent)
class RunEventAdmin(admin.ModelAdmin):
    list_display = ("run", "seq", "kind", "occurred_at")
    list_filter = ("kind",)
