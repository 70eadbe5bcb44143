"""Pages. Thin: read through selectors, write through services."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db import connection
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from forgeboard.accounts.permissions import project_role
from forgeboard.accounts.selectors import memberships_of, project_get, projects_for_user
from forgeboard.errors import NotFound
from forgeboard.experiments.selectors import experiments_for_project
from forgeboard.runs.selectors import runs_for_project


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok"})


@login_required
def home(request: HttpRequest) -> HttpResponse:
    projects = projects_for_user(user=request.user)
    return render(request, "web/home.html", {"projects": projects})


@login_required
def project_detail(request: HttpRequest, slug: str) -> HttpResponse:
    try:
        project = project_get(actor=request.user, slug=slug)
    except NotFound:
        raise Http404("no such project") from None
    context = {
        "project": project,
        "role": project_role(actor=request.user, project=project),
        "experiments": experiments_for_project(project=project),
        "runs": runs_for_project(project=project)[:50],
        "members": memberships_of(project=project),
    }
    return render(request, "web/project.html", context)
