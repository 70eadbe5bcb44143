"""How pages show service errors: a flash message, or a 4xx page, never a stack trace."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from forgeboard.accounts.models import Project
from forgeboard.accounts.selectors import project_get
from forgeboard.db_busy import busy_error, is_database_busy, with_retry_after
from forgeboard.errors import NotFound, ServiceError
from forgeboard.runs.models import Run
from forgeboard.runs.selectors import run_get


def project_or_404(request: HttpRequest, slug: str) -> Project:
    """The project the user may see, else 404 (outsiders learn nothing about it)."""
    try:
        return project_get(actor=request.user, slug=slug)
    except NotFound:
        raise Http404("no such project") from None


def run_or_404(request: HttpRequest, run_id: int) -> Run:
    try:
        return run_get(actor=request.user, run_id=run_id)
    except NotFound:
        raise Http404("no such run") from None


def error_page(request: HttpRequest, error: ServiceError) -> HttpResponse:
    return render(request, "web/error.html", {"error": error}, status=error.status)


def flash_error(request: HttpRequest, error: ServiceError) -> None:
    details = "; ".join(f"{p.field}: {p.message}" for p in error.problems if p.field)
    messages.error(request, details or error.message)


def refusal_or_flash(request: HttpRequest, error: ServiceError) -> HttpResponse | None:
    """A refused action (403) gets its own page; any other error becomes a message on the page it came from."""
    if error.status == 403:
        return error_page(request, error)
    flash_error(request, error)
    return None


class DatabaseBusyMiddleware:
    """For the dashboard's pages (the API's handler in api/base.py answers its own): a busy database's error page."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        return with_retry_after(error_page(request, busy_error())) if is_database_busy(exc) else None
