"""Structured logs that say which request and which run they belong to."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

from django.http import HttpRequest, HttpResponse

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
run_id_var: contextvars.ContextVar[int | None] = contextvars.ContextVar("run_id", default=None)

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        if not hasattr(record, "run_id"):
            record.run_id = run_id_var.get()
        return True


SECRET_QUERY_PARAMETER = re.compile(r"([?&]token=)[^&\s\"']*")


def redacted(text: str) -> str:
    """A path with its query string, the value of any `token` parameter replaced."""
    return SECRET_QUERY_PARAMETER.sub(r"\1[redacted]", text)


class RedactTokens(logging.Filter):
    """uvicorn logs each websocket handshake with its path and query string, where a client may pass its API token
    (`/ws/runs/7/?token=fb_...`, the streams' documented alternative to a session): the token never reaches a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redacted(arg) if isinstance(arg, str) else arg for arg in record.args)
        record.msg = redacted(record.msg) if isinstance(record.msg, str) else record.msg
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
            "run_id": getattr(record, "run_id", None),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


@contextlib.contextmanager
def run_log_context(run_id: int) -> Iterator[None]:
    token = run_id_var.set(run_id)
    try:
        yield
    finally:
        run_id_var.reset(token)


class RequestContextMiddleware:
    """Tags every log line of a request with its id (taken from X-Request-ID when well formed)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        incoming = request.headers.get("X-Request-ID", "")
        request_id = incoming if _REQUEST_ID_RE.match(incoming) else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        try:
            response = self.get_response(request)
        finally:
            request_id_var.reset(token)
        response["X-Request-ID"] = request_id
        return response
