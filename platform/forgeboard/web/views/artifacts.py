"""A project's artifacts: the registered models and datasets its configs name; operators register them here."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from forgeboard.accounts.permissions import project_role
from forgeboard.artifacts.models import ArtifactKind
from forgeboard.artifacts.selectors import artifact_named, artifacts_for_project
from forgeboard.artifacts.services import artifact_delete, artifact_register
from forgeboard.errors import ServiceError
from forgeboard.web.errors import project_or_404, refusal_or_flash


@login_required
@require_http_methods(["GET", "POST"])
def artifacts(request: HttpRequest, slug: str) -> HttpResponse:
    project = project_or_404(request, slug)
    if request.method == "POST":
        try:
            if request.POST.get("action") == "delete":
                artifact = artifact_named(project=project, name=request.POST.get("name", ""))
                if artifact is not None:
                    artifact_delete(actor=request.user, artifact=artifact)
                    messages.success(request, f"{artifact.name} removed")
            else:
                artifact = artifact_register(actor=request.user, project=project, name=request.POST.get("name", ""),
                                             kind=request.POST.get("kind", ""), path=request.POST.get("path", ""),
                                             description=request.POST.get("description", ""))
                messages.success(request, f"{artifact.name} registered")
        except ServiceError as error:
            if refused := refusal_or_flash(request, error):
                return refused
        return redirect("project_artifacts", slug=slug)
    user = request.user
    return render(request, "web/artifacts.html", {
        "project": project, "role": project_role(actor=user, project=project),
        "artifacts": artifacts_for_project(project=project), "kinds": ArtifactKind.choices,
        "is_operator": user.is_operator or user.is_superuser, "roots": [str(r) for r in settings.ARTIFACT_ROOTS],
    })
