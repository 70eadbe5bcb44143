from django.contrib import admin
from django.contrib.auth.admin import UserAdmin

from forgeboard.accounts.models import ApiToken, Membership, Project, User


@admin.register(User)
class ForgeboardUserAdmin(UserAdmin):
    fieldsets = (*UserAdmin.fieldsets, ("Platform", {"fields": ("is_operator",)}))
    list_display = ("username", "email", "is_operator", "is_staff", "is_active")


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "created_at")
    search_fields = ("slug", "name")
    inlines = [MembershipInline]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "project", "scope", "created_at", "last_used_at", "revoked_at")
    list_filter = ("scope",)
    readonly_fields = ("prefix", "token_hash", "created_at", "last_used_at")
