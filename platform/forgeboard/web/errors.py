"""How pages show service errors: a flash message, or a 4xx page, never a stack trace."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from forgeboard.errors import ServiceError


def error_page(request: HttpRequest, error: ServiceError) -> HttpResponse:
    return render(request, "web/error.html", {"error": error}, status=error.status)


def flash_error(request: HttpRequest, error: ServiceError) -> None:
    details = "; ".join(f"{p.field}: {p.message}" for p in error.problems if p.field)
    messages.error(request, details or error.message)
