"""What is refused about a request before any view sees it, each answer saying where:

- a URL path with text no database can store (a NUL, a lone surrogate) names nothing that can exist: 404;
- a query parameter with such text: 400 naming the parameter. Postgres refuses a NUL in a query's text parameter,
  and a path segment or a filter that reached a lookup with one was a 500;
- a form body that is not what its Content-Type says: 400. A form body is read whole first (BodyLimitMiddleware has
  bounded it), so a browser session's CSRF check, which reads it as a form, leaves it there for the API's JSON
  parser (it found an empty stream: a 500).
Form fields themselves are the views' to judge (a login with a NUL is a failed login, braked like any other).
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseNotFound
from django.http.multipartparser import MultiPartParserError

from forgeboard.api_errors import error_response, is_api_path
from workers.engine.wire_limits import unstorable_reason

FORMS = ("application/x-www-form-urlencoded", "multipart/form-data")


def query_problem(request: HttpRequest) -> tuple[str, str] | None:
    """(parameter, why) for the first query parameter whose name or value cannot be stored, or None."""
    for name, values in request.GET.lists():
        if reason := unstorable_reason(name):
            return "query", reason
        if reason := next(filter(None, map(unstorable_reason, values)), None):
            return name, reason
    return None


def unreadable_form(request: HttpRequest) -> str | None:
    """Why a POST's form body cannot be read, or None (also when it is not a form)."""
    if request.method != "POST" or request.content_type not in FORMS:
        return None
    request.body  # noqa: B018 - kept in memory: the form is parsed from it and it stays readable
    try:
        request.POST  # noqa: B018
    except MultiPartParserError as exc:
        return f"is not a readable multipart body ({exc})"
    return None


class RequestRefusalMiddleware:
    """After BodyLimitMiddleware in MIDDLEWARE."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        api = is_api_path(request.path)
        if reason := unstorable_reason(request.path):
            if api:
                return error_response(404, message=f"no such API URL: the path {reason}",
                                      errors=[{"field": "path", "message": reason}])
            return HttpResponseNotFound(f"Not found: the path {reason}.", content_type="text/plain")
        problem = query_problem(request)
        if problem is None and (reason := unreadable_form(request)):
            problem = "body", reason
        if problem is None:
            return self.get_response(request)
        field, reason = problem
        if api:
            return error_response(400, message=f"{field} {reason}", errors=[{"field": field, "message": reason}])
        return HttpResponseBadRequest(f"Bad request: {field} {reason}.", content_type="text/plain")
