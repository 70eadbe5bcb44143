"""One error shape for every /api/ answer: `{code, message, errors: [{field, message}]}`.

The API's own handlers (api/base.py, cluster/api.py) already answer in it; what reaches the client from
elsewhere (Django's 404 for an unknown URL, ninja's bare 405, a CSRF failure, the 500 of an unexpected
exception) is rewritten here, for /api/ paths only. Pages keep Django's pages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.csrf import csrf_failure as django_csrf_failure

logger = logging.getLogger(__name__)

CODES = {400: "bad_request", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
         405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type",
         429: "rate_limited", 500: "internal_error"}
MESSAGES = {404: "no such API URL", 405: "method not allowed here", 500: "internal error: the server logged it"}


def is_api_path(path: str) -> bool:
    return path.startswith("/api/")


def error_response(status: int, *, code: str | None = None, message: str | None = None,
                   errors: list[dict[str, str]] | None = None) -> JsonResponse:
    return JsonResponse({"code": code or CODES.get(status, "error"),
                         "message": message or MESSAGES.get(status, f"HTTP {status}"), "errors": errors or []},
                        status=status)


class ApiErrorShapeMiddleware:
    """Turn a non-JSON error answer on an /api/ path into the API's JSON error body (same status)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if response.status_code < 400 or not is_api_path(request.path):
            return response
        if response.get("Content-Type", "").startswith("application/json"):
            return response
        shaped = error_response(response.status_code)
        for header in ("Allow", "Retry-After", "WWW-Authenticate"):
            if header in response:
                shaped[header] = response[header]
        return shaped


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """settings.CSRF_FAILURE_VIEW: JSON for the API, Django's page for the dashboard."""
    if is_api_path(request.path):
        return error_response(403, code="csrf_failed", message=f"CSRF verification failed: {reason}",
                              errors=[{"field": "X-CSRFToken", "message": reason or "missing or wrong"}])
    return django_csrf_failure(request, reason=reason)


def api_internal_error(request: HttpRequest, exc: Exception) -> JsonResponse:
    """An unexpected exception in an API view: logged with its traceback, answered without it."""
    logger.exception("unhandled error on %s %s", request.method, request.path, exc_info=exc)
    return error_response(500)
