from django.contrib import admin

from forgeboard.regressions.models import Suite, SuiteRun


@admin.register(Suite)
class SuiteAdmin(admin.ModelAdmin):
    list_display = ("name", "project", "created_by", "created_at")


@admin.register(SuiteRun)
class SuiteRunAdmin(admin.ModelAdmin):
    list_display = ("id", "suite", "verdict", "created_at", "finished_at")
    list_filter = ("verdict",)
