"""The one request-size limit (`wire_limits.MAX_REQUEST_BYTES`), enforced with a 413 before a body is buffered.

Two layers: `BodyLimitASGI` wraps the ASGI app (uvicorn) and counts the bytes of `http.request` messages as
they arrive, refusing as soon as Content-Length or the running total is over, without reading the rest;
`BodyLimitMiddleware` is the same check inside Django (WSGI servers, the test client), including a body
sent without Content-Length. /api/ paths get the API's JSON error body; pages get a plain 413.
"""

from __future__ import annotations

import io
import json
from collections.abc import Awaitable, Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from workers.engine.wire_limits import MAX_REQUEST_BYTES

READ_CHUNK = 64 * 1024


def too_large_body(*, size: int | None = None) -> dict[str, Any]:
    """The API's error body for a request over the limit (`size`: its length when known)."""
    told = f"{size} bytes" if size is not None else "more than that"
    message = f"the request body is over the limit of {MAX_REQUEST_BYTES} bytes ({told})"
    return {"code": "payload_too_large", "message": message,
            "errors": [{"field": "body", "message": f"must be at most {MAX_REQUEST_BYTES} bytes"}]}


def _is_api(path: str) -> bool:
    return path.startswith("/api/")


def _declared_length(value: str | None) -> int | None:
    """The Content-Length as a number, or None when absent or not one (Django then reads no body)."""
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def _read_at_most(stream: Any, limit: int) -> bytes:
    """Up to `limit` bytes of a stream that has no declared length (never more than it has)."""
    parts, total = [], 0
    while total < limit:
        size = min(READ_CHUNK, limit - total)
        if hasattr(stream, "__len__"):  # the test client's payload refuses reads past its end
            size = min(size, len(stream))
            if size == 0:
                break
        part = stream.read(size)
        if not part:
            break
        parts.append(part)
        total += len(part)
    return b"".join(parts)


class BodyLimitMiddleware:
    """413 for a request whose body is over the limit, declared or not; early in MIDDLEWARE."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        length = _declared_length(request.META.get("CONTENT_LENGTH"))
        if length is not None and length > MAX_REQUEST_BYTES:
            return self._refuse(request, size=length)
        if length is None and self._may_have_undeclared_body(request):
            data = _read_at_most(self._raw_stream(request), MAX_REQUEST_BYTES + 1)
            if len(data) > MAX_REQUEST_BYTES:
                return self._refuse(request, size=None)
            request._stream = io.BytesIO(data)  # what Django reads request.body from
            request.META["CONTENT_LENGTH"] = str(len(data))
        return self.get_response(request)

    @staticmethod
    def _may_have_undeclared_body(request: HttpRequest) -> bool:
        """Whether a body may come without Content-Length: chunked under WSGI (a server that de-chunks says so
        with wsgi.input_terminated); always under ASGI, which hands Django the body it received."""
        meta = request.META
        if "wsgi.input" not in meta:
            return True
        return bool(meta.get("wsgi.input_terminated")) or "chunked" in meta.get("HTTP_TRANSFER_ENCODING", "").lower()

    @staticmethod
    def _raw_stream(request: HttpRequest) -> Any:
        """WSGI: the server's input (Django's own stream stops at the missing Content-Length); ASGI: the body."""
        return request.META.get("wsgi.input", request._stream)

    @staticmethod
    def _refuse(request: HttpRequest, *, size: int | None) -> HttpResponse:
        if _is_api(request.path):
            return JsonResponse(too_large_body(size=size), status=413)
        return HttpResponse("Request body too large.", status=413, content_type="text/plain")


Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimitASGI:
    """ASGI middleware: refuse an HTTP request body over the limit as its bytes arrive."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, limit: int = MAX_REQUEST_BYTES):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = _declared_length((headers.get(b"content-length") or b"").decode("latin-1") or None)
        if length is not None and length > self.limit:
            await self._refuse(scope, send, size=length)
            return
        received = 0
        over = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    over = True  # the app sees the client go away; the rest of the body is never read
                    return {"type": "http.disconnect"}
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counting_receive, watching_send)
        if over and not started:
            await self._refuse(scope, send, size=None)

    async def _refuse(self, scope: Scope, send: Send, *, size: int | None) -> None:
        if _is_api(scope.get("path", "")):
            body, kind = json.dumps(too_large_body(size=size)).encode(), b"application/json"
        else:
            body, kind = b"Request body too large.", b"text/plain; charset=utf-8"
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", kind), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
