"""The node agent API: hosts register and heartbeat with an agent token. Thin callers of cluster services.

Every answer is JSON. Errors have the shape {"code", "message", "errors": [{"field", "message"}]}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel, ValidationError

from forgeboard.cluster.agent_schemas import HeartbeatIn, RegisterIn
from forgeboard.cluster.models import AgentToken, Host
from forgeboard.cluster.services import (
    DeviceReport,
    DeviceSample,
    agent_token_authenticate,
    host_heartbeat,
    host_register,
)
from forgeboard.errors import ServiceError
from workers.engine.wire_limits import MAX_JSON_DEPTH, json_depth

MAX_BODY_BYTES = 256 * 1024

Body = TypeVar("Body", bound=BaseModel)


class _Refused(Exception):
    def __init__(self, status: int, code: str, message: str, errors: list[dict[str, str]] | None = None):
        super().__init__(message)
        self.response = JsonResponse({"code": code, "message": message, "errors": errors or []}, status=status)


def _authenticate(request: HttpRequest) -> AgentToken:
    header = request.headers.get("Authorization", "")
    scheme, _, raw = header.partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise _Refused(401, "unauthenticated", "send an agent token: Authorization: Bearer fba_...")
    token = agent_token_authenticate(raw=raw.strip())
    if token is None:
        raise _Refused(401, "unauthenticated", "the agent token is unknown or revoked")
    return token


def _field_name(loc: tuple[int | str, ...]) -> str:
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def _parse(request: HttpRequest, schema: type[Body]) -> Body:
    if request.content_type != "application/json":
        raise _Refused(415, "unsupported_media_type", "send the body as application/json")
    try:
        length = int(request.headers.get("Content-Length") or 0)
    except ValueError:
        raise _Refused(400, "validation_failed", "Content-Length is not a number") from None
    if length > MAX_BODY_BYTES:
        raise _Refused(413, "payload_too_large", f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
    body = request.body
    if len(body) > MAX_BODY_BYTES:
        raise _Refused(413, "payload_too_large", f"the body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}")
    if json_depth(body) > MAX_JSON_DEPTH:
        message = f"nested deeper than {MAX_JSON_DEPTH} levels"
        raise _Refused(400, "validation_failed", f"body: {message}", [{"field": "body", "message": message}])
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        errors = [{"field": _field_name(e["loc"]), "message": e["msg"]} for e in exc.errors(include_url=False)]
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            errors = [{"field": "body", "message": "is not valid JSON"}]
        summary = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5])
        raise _Refused(400, "validation_failed", summary, errors) from None


def _agent_view(handler: Callable[[HttpRequest, AgentToken], JsonResponse]) -> Callable[[HttpRequest], JsonResponse]:
    @csrf_exempt
    def view(request: HttpRequest) -> JsonResponse:
        if request.method != "POST":
            response = JsonResponse({"code": "method_not_allowed", "message": "use POST", "errors": []}, status=405)
            response["Allow"] = "POST"
            return response
        try:
            return handler(request, _authenticate(request))
        except _Refused as refused:
            return refused.response
        except ServiceError as exc:
            return JsonResponse(exc.as_dict(), status=exc.status)

    view.__name__ = handler.__name__
    view.__doc__ = handler.__doc__
    return view


def _host_answer(host: Host) -> dict[str, str]:
    """`state` (up, draining, cordoned or down) is down when `liveness` is, else the operator's `intent` (up when
    schedulable)."""
    return {"hostname": host.hostname, "state": host.state, "liveness": host.liveness, "intent": host.intent,
            "health": host.health}


@_agent_view
def register(request: HttpRequest, token: AgentToken) -> JsonResponse:
    """POST /api/agent/v1/hosts/register: add or update a host and its devices; answers the host (`_host_answer`)
    and its device count."""
    body = _parse(request, RegisterIn)
    host = host_register(
        actor=token, hostname=body.hostname, pool=body.pool, labels=body.labels, cpu_count=body.cpu_count,
        memory_bytes=body.memory_bytes, agent_version=body.agent_version,
        cpu_utilization=body.cpu_utilization, memory_utilization=body.memory_utilization,
        devices=[DeviceReport(**device.model_dump()) for device in body.devices],
    )
    return JsonResponse(_host_answer(host) | {"devices": len(body.devices)})


@_agent_view
def heartbeat(request: HttpRequest, token: AgentToken) -> JsonResponse:
    """POST /api/agent/v1/hosts/heartbeat: utilization and health; answers the host (`_host_answer`). 404 or 409
    means register again."""
    body = _parse(request, HeartbeatIn)
    host = host_heartbeat(
        actor=token, hostname=body.hostname, cpu_utilization=body.cpu_utilization,
        memory_utilization=body.memory_utilization,
        devices=[DeviceSample(**device.model_dump()) for device in body.devices],
    )
    return JsonResponse(_host_answer(host))
