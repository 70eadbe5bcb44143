"""The run controller's channel: telemetry in, commands out. Authenticated by the run's own token."""

from __future__ import annotations

import json

from django.http import HttpRequest
from ninja import Router, Schema
from pydantic import ValidationError

from forgeboard.errors import FieldProblem, PermissionDenied, ServiceError, ValidationFailed
from forgeboard.runs.models import Run, RunToken
from forgeboard.runs.selectors import commands_pending
from forgeboard.runs.services import command_acknowledge, command_finish, run_reported_in
from forgeboard.telemetry.ingest import telemetry_ingest
from workers.engine.telemetry_wire import MAX_REQUEST_BYTES, TelemetryRequest, TelemetryResponse

from forgeboard.api.base import RunTokenAuth
from forgeboard.api.schemas import ERRORS, ErrorOut

CONTROLLER_ERRORS = ERRORS | {413: ErrorOut}

router = Router(tags=["controller"], auth=RunTokenAuth())


class PayloadTooLarge(ServiceError):
    status = 413
    code = "payload_too_large"


def _run_of(request: HttpRequest, run_id: int) -> Run:
    token: RunToken = request.auth
    if token.run_id != run_id:
        raise PermissionDenied("this token belongs to another run")
    return token.run


def _parse_body(request: HttpRequest, model: type) -> object:
    length = int(request.headers.get("Content-Length") or 0)
    if length > MAX_REQUEST_BYTES:
        raise PayloadTooLarge(f"request body is {length} bytes, over the limit of {MAX_REQUEST_BYTES}")
    try:
        data = json.loads(request.body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValidationFailed.on("body", f"not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [FieldProblem(".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors()[:50]]
        raise ValidationFailed("; ".join(f"{p.field}: {p.message}" for p in problems[:5]), problems=problems) from None


@router.post("/controller/runs/{run_id}/telemetry", response={200: TelemetryResponse, **CONTROLLER_ERRORS}, summary="Report telemetry batches")
def post_telemetry(request: HttpRequest, run_id: int):  # noqa: ANN201
    """Batches are applied in order, each exactly once; an empty list is a heartbeat."""
    run = _run_of(request, run_id)
    body = _parse_body(request, TelemetryRequest)
    run_reported_in(run=run)
    result = telemetry_ingest(run=run, batches=body.batches)
    pending = list(commands_pending(run=run).values_list("pk", flat=True)[:100])
    return TelemetryResponse(applied_seq=result.applied_seq, duplicates=result.duplicates, pending_commands=pending)


class CommandOut(Schema):
    id: int
    kind: str
    payload: dict
    state: str


@router.get("/controller/runs/{run_id}/commands", response={200: list[CommandOut], **CONTROLLER_ERRORS}, summary="Commands not yet finished")
def get_commands(request: HttpRequest, run_id: int, after: int = 0):  # noqa: ANN201
    run = _run_of(request, run_id)
    return list(commands_pending(run=run, after_id=after)[:100])


@router.post("/controller/runs/{run_id}/commands/{command_id}/ack", response={200: CommandOut, **CONTROLLER_ERRORS}, summary="Acknowledge a command")
def ack_command(request: HttpRequest, run_id: int, command_id: int):  # noqa: ANN201
    return command_acknowledge(run=_run_of(request, run_id), command_id=command_id)


class CommandResultIn(Schema):
    ok: bool
    result: dict = {}


@router.post("/controller/runs/{run_id}/commands/{command_id}/result", response={200: CommandOut, **CONTROLLER_ERRORS}, summary="Report a result")
def finish_command(request: HttpRequest, run_id: int, command_id: int, body: CommandResultIn):  # noqa: ANN201
    run = _run_of(request, run_id)
    return command_finish(run=run, command_id=command_id, ok=body.ok, result=body.result)
