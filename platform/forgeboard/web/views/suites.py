"""A project's regression suites, and one suite's runs: each stage's verdict, its step predicted by the what-if
model beside the step it measured (runs/planning.py), and the prediction error over the suite's history."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from forgeboard.errors import NotFound
from forgeboard.regressions.selectors import (prediction_history, stages_of, suite_in_project, suite_run_of,
                                              suites_for_project)
from forgeboard.regressions.services import suite_run_refresh
from forgeboard.web.errors import project_or_404


@login_required
@require_GET
def suites(request: HttpRequest, slug: str) -> HttpResponse:
    project = project_or_404(request, slug)
    return render(request, "web/suites.html", {"project": project, "suites": suites_for_project(project=project)})


@login_required
@require_GET
def suite_detail(request: HttpRequest, slug: str, name: str) -> HttpResponse:
    project = project_or_404(request, slug)
    try:
        suite = suite_in_project(project=project, name=name)
        suite_run = suite_run_of(suite=suite, suite_run_id=request.GET.get("run"))
    except NotFound:
        raise Http404("no such suite run") from None
    if suite_run is not None:
        suite_run = suite_run_refresh(suite_run=suite_run)
    stage_names, history = prediction_history(suite=suite)
    return render(request, "web/suite.html", {
        "project": project, "suite": suite, "suite_run": suite_run,
        "stages": stages_of(suite_run=suite_run) if suite_run else [],
        "stage_names": stage_names, "history": history,
    })
