from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin
from django.db.models import QuerySet
from django.http import HttpRequest

from forgeboard.accounts.models import ApiToken, Membership, Project, User
from forgeboard.accounts.services import api_token_revoke
from forgeboard.errors import ServiceError


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
    """Read-only: a token is created where its secret can be shown once (Settings → API tokens, `forgeboard
    token create`), and revoked through the service so that it is audited."""

    list_display = ("name", "prefix", "project", "scope", "created_by", "created_at", "last_used_at", "expires_at",
                    "revoked_at")
    list_filter = ("scope",)
    search_fields = ("name", "prefix", "project__slug")
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: ApiToken | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: ApiToken | None = None) -> bool:
        return False

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        revoked = 0
        for token in queryset.select_related("project").filter(revoked_at__isnull=True):
            try:
                api_token_revoke(actor=request.user, token=token)
                revoked += 1
            except ServiceError as error:
                self.message_user(request, f"{token}: {error.message}", messages.ERROR)
        self.message_user(request, f"{revoked} token(s) revoked")
