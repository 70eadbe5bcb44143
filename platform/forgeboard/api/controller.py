"""The run controller's channel: telemetry in, commands out. Authenticated by the run's own token."""

from __future__ import annotations

from django.http import HttpRequest
from ninja import Field, Router, Schema
from pydantic import ValidationError

from forgeboard.errors import FieldProblem, PermissionDenied, ServiceError, ValidationFailed
from forgeboard.runs.models import Command, Run, RunToken
from forgeboard.runs.selectors import commands_pending
from forgeboard.runs.services import command_ack_refusal, command_acknowledge, command_finish, run_reported_in
from forgeboard.telemetry.ingest import telemetry_ingest
from workers.engine.command_channel import COMMANDS_PAGE_SIZE
from workers.engine.telemetry_wire import (
    MAX_BODY_DEPTH,
    MAX_REQUEST_BYTES,
    TelemetryRefusal,
    TelemetryRequest,
    TelemetryResponse,
    inline_schema,
    screen_request,
)
from workers.engine.wire_limits import JsonBodyProblem, loads_bounded

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


def _too_large(size: int | None) -> PayloadTooLarge:
    told = f"{size} bytes" if size is not None else "more than that"
    return PayloadTooLarge(f"request body is over the limit of {MAX_REQUEST_BYTES} bytes ({told})",
                           problems=[FieldProblem("body", f"must be at most {MAX_REQUEST_BYTES} bytes")])


def _read_json(request: HttpRequest) -> object:
    """The decoded body, read at most MAX_REQUEST_BYTES + 1 bytes far (with or without a Content-Length)."""
    declared = (request.headers.get("Content-Length") or "").strip()
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise _too_large(int(declared))
    raw = request.read(MAX_REQUEST_BYTES + 1)
    if len(raw) > MAX_REQUEST_BYTES:
        raise _too_large(None)
    try:
        return loads_bounded(raw or b"{}", max_depth=MAX_BODY_DEPTH)
    except JsonBodyProblem as exc:
        raise ValidationFailed.on("body", exc.message) from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ValidationFailed.on("body", f"not valid JSON: {exc}") from None


def _field_problems(exc: ValidationError) -> ValidationFailed:
    problems = [FieldProblem(".".join(str(p) for p in e["loc"]) or "body", e["msg"]) for e in exc.errors()[:50]]
    return ValidationFailed("; ".join(f"{p.field}: {p.message}" for p in problems[:5]), problems=problems)


TELEMETRY_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": inline_schema(TelemetryRequest)}}}}


@router.post("/controller/runs/{run_id}/telemetry",
             response={200: TelemetryResponse, 422: TelemetryRefusal, **CONTROLLER_ERRORS},
             summary="Report telemetry batches", openapi_extra=TELEMETRY_BODY)
def post_telemetry(request: HttpRequest, run_id: int):  # noqa: ANN201
    """Batches are applied in order, each exactly once; an empty list is a heartbeat.

    A bad item (metric, event or log line) refuses the request with 422 `items_refused`, naming each refused
    item by batch seq, section and index; nothing of the request is stored, and the same batches sent again
    without those items are applied. A body that is not JSON or not a list of numbered batches gets a 400; one
    over the request-size limit a 413. Points of the same key and step in one batch: the last one is kept, the
    others are listed in `duplicates_dropped`.
    """
    run = _run_of(request, run_id)
    data = _read_json(request)
    try:
        screened = screen_request(data)
    except ValidationError as exc:
        raise _field_problems(exc) from None
    run_reported_in(run=run)
    result = telemetry_ingest(run=run, batches=screened.request.batches, refused=screened.refused)
    pending = list(commands_pending(run=run).values_list("pk", flat=True)[:100])
    return TelemetryResponse(applied_seq=result.applied_seq, duplicates=result.duplicates,
                             duplicates_dropped=result.duplicates_dropped,
                             duplicates_dropped_total=result.duplicates_dropped_total, pending_commands=pending)


class CommandOut(Schema):
    id: int
    kind: str
    payload: dict
    state: str


@router.get("/controller/runs/{run_id}/commands", response={200: list[CommandOut], **CONTROLLER_ERRORS},
            summary="Commands not yet finished", description=(
                "The open commands (pending, or delivered without a result) after the command id `after`, in id "
                f"order, at most {COMMANDS_PAGE_SIZE}: a shorter page is the last. The controller pages through them "
                "all: a command whose result it gave up reporting stays open."))
def get_commands(request: HttpRequest, run_id: int, after: int = 0):  # noqa: ANN201
    run = _run_of(request, run_id)
    return list(commands_pending(run=run, after_id=after)[:COMMANDS_PAGE_SIZE])


class CommandAckOut(CommandOut):
    reason: str = Field(description="why this controller must not run the command; empty when it is `delivered`")

    @staticmethod
    def resolve_reason(obj: Command) -> str:
        return command_ack_refusal(command=obj)


@router.post("/controller/runs/{run_id}/commands/{command_id}/ack",
             response={200: CommandAckOut, **CONTROLLER_ERRORS}, summary="Acknowledge a command")
def ack_command(request: HttpRequest, run_id: int, command_id: int):  # noqa: ANN201
    """Take a command before running it; the answer says whether to run it.

    200 with `state` `delivered` (and an empty `reason`): the command is this controller's to run (an acknowledgement
    sent again, its first answer lost, gets the same). 200 with `state` `expired` (the run ended or was lost before
    a result came: the operator sends it again if it is still wanted) or `succeeded` / `failed` (it has a result
    already), with the `reason` in words: do not run it; it stays as it was. 404 naming the field `command_id`: the
    run has no such command. 401 once the run has ended or its controller was replaced. A 429 or 5xx says nothing
    of the command: acknowledge it again later, and do not run it meanwhile.
    """
    return command_acknowledge(run=_run_of(request, run_id), command_id=command_id)


class CommandResultIn(Schema):
    ok: bool
    result: dict = {}


@router.post("/controller/runs/{run_id}/commands/{command_id}/result", response={200: CommandOut, **CONTROLLER_ERRORS}, summary="Report a result")
def finish_command(request: HttpRequest, run_id: int, command_id: int, body: CommandResultIn):  # noqa: ANN201
    """Record what running a command did, once: a repeated report changes nothing, and a report of a command that
    expired while it ran is recorded as a late one. 400 for a result that cannot be stored (a number that is not
    finite or not within a float's range, over the size a command's payload may have): sending it again gets the same
    answer. 404 naming the field `command_id`: the run has no such command."""
    run = _run_of(request, run_id)
    return command_finish(run=run, command_id=command_id, ok=body.ok, result=body.result)
