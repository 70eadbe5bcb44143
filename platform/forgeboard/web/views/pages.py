"""Health, the project list, and a project's members and roles."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods

from forgeboard.accounts.models import Role
from forgeboard.accounts.permissions import project_role
from forgeboard.accounts.selectors import member_candidate, memberships_of, projects_for_user
from forgeboard.accounts.services import membership_remove, membership_set
from forgeboard.errors import ServiceError
from forgeboard.web.errors import project_or_404, refusal_or_flash


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok"})


@login_required
@require_GET
def home(request: HttpRequest) -> HttpResponse:
    projects = projects_for_user(user=request.user)
    return render(request, "web/home.html", {"projects": projects})


@login_required
@require_http_methods(["GET", "POST"])
def members(request: HttpRequest, slug: str) -> HttpResponse:
    project = project_or_404(request, slug)
    if request.method == "POST":
        try:
            _change_membership(request, project=project)
        except ServiceError as error:
            if refused := refusal_or_flash(request, error):
                return refused
        return redirect("project_members", slug=slug)
    role = project_role(actor=request.user, project=project)
    return render(request, "web/members.html", {
        "project": project, "role": role, "is_owner": role == Role.OWNER,
        "members": memberships_of(project=project), "roles": Role.choices,
    })


def _change_membership(request: HttpRequest, *, project) -> None:  # noqa: ANN001 - a Project
    user = member_candidate(actor=request.user, project=project, username=request.POST.get("username", "").strip())
    if request.POST.get("action") == "remove":
        membership_remove(actor=request.user, project=project, user=user)
        messages.success(request, f"{user.username} removed from {project.name}")
        return
    membership = membership_set(actor=request.user, project=project, user=user, role=request.POST.get("role", ""))
    messages.success(request, f"{user.username} is now {membership.get_role_display().lower()}")
