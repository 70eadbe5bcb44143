from django.contrib import admin

from forgeboard.experiments.models import ConfigSnapshot, Experiment


@admin.register(Experiment)
class ExperimentAdmin(admin.ModelAdmin):
    list_display = ("name", "project", "recipe", "created_by", "created_at")
    list_filter = ("recipe",)
    search_fields = ("name",)


@admin.register(ConfigSnapshot)
class ConfigSnapshotAdmin(admin.ModelAdmin):
    list_display = ("content_hash", "recipe", "created_at")
    readonly_fields = ("content_hash", "yaml_text", "overrides", "parsed", "recipe", "created_at")

    def has_change_permission(self, request, obj=None) -> bool:
        return False
