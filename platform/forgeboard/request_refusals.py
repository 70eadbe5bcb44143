"""What is refused about a request before any view sees it, with a 400 that says what and where: text a database
cannot store (a NUL, a lone surrogate) in the URL path, a query parameter or a form field, and a form body that
cannot be read. Postgres refuses a NUL in a query's text parameter: a path segment, a filter or a form field that
reached a lookup with one was a 500."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.http.multipartparser import MultiPartParserError

from forgeboard.api_errors import error_response, is_api_path
from workers.engine.wire_limits import unstorable_reason

FORMS = ("application/x-www-form-urlencoded", "multipart/form-data")


def _texts(request: HttpRequest) -> Iterator[tuple[str, str]]:
    """(where, text) for the path, each query parameter's name and values, and each form field's."""
    yield "path", request.path
    parts = [("query", request.GET)]
    if request.method == "POST" and request.content_type in FORMS:
        # Read whole first (BodyLimitMiddleware has bounded it), so the form is parsed from memory and the body is
        # still there for the API's JSON parser after a browser session's CSRF check has read the form.
        request.body  # noqa: B018
        parts.append(("form", request.POST))
    for part, data in parts:
        for name, values in data.lists():
            where = f"{part} field {name!r}" if unstorable_reason(name) is None else f"a {part} field's name"
            yield where, name
            for value in values:
                yield where, value


def request_problem(request: HttpRequest) -> tuple[str, str] | None:
    """(where, why) for the first part of the request that is refused, or None."""
    try:
        for where, text in _texts(request):
            reason = unstorable_reason(text)
            if reason:
                return where, reason
    except MultiPartParserError as exc:  # a body labelled multipart that is not
        return "form body", f"is not a readable multipart body ({exc})"
    return None


class RequestRefusalMiddleware:
    """After BodyLimitMiddleware in MIDDLEWARE: a body is read here only once its size is known to be within it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        problem = request_problem(request)
        if problem is None:
            return self.get_response(request)
        where, reason = problem
        if is_api_path(request.path):
            return error_response(400, message=f"the {where} {reason}", errors=[{"field": where, "message": reason}])
        return HttpResponseBadRequest(f"Bad request: the {where} {reason}.", content_type="text/plain")
