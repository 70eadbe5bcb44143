"""The /api/v1 NinjaAPI: one error format for every failure, and the authentication schemes."""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError
from ninja.errors import ValidationError as NinjaValidationError
from ninja.parser import Parser
from ninja.security import HttpBearer, SessionAuth

from forgeboard.accounts.services import api_token_authenticate
from forgeboard.api.ratelimit import count_token_request, refuse_failed_authentication
from forgeboard.api_errors import CODES, api_internal_error, csrf_failure
from forgeboard.db_busy import busy_error, is_database_busy, with_retry_after
from forgeboard.errors import ServiceError
from forgeboard.runs.tokens import run_token_authenticate
from workers.engine.wire_limits import MAX_JSON_DEPTH, MAX_REQUEST_BYTES, JsonBodyProblem, loads_bounded

logger = logging.getLogger(__name__)


class BoundedJsonParser(Parser):
    """JSON bodies nested at most MAX_JSON_DEPTH deep (a deeper one would exhaust the parser's stack), and JSON's
    numbers only: a NaN or an Infinity is refused at `body` (no database's JSON column takes one)."""

    def parse_body(self, request: HttpRequest):  # noqa: ANN201
        return loads_bounded(request.body, allow_nan=False)


class ForgeboardAPI(NinjaAPI):
    def get_openapi_schema(self, *, path_prefix: str | None = None, path_params: dict | None = None):  # noqa: ANN201
        """The generated document, with the 413 that every operation taking a body answers (body_limits.py); built
        once per process (the routes are fixed once the URLconf is loaded; building it took ~0.1 s a request)."""
        key = (path_prefix, tuple(sorted((path_params or {}).items())))
        built = self.__dict__.setdefault("_schemas", {})
        if key not in built:
            built[key] = self._schema_with_limits(path_prefix=path_prefix, path_params=path_params)
        return built[key]

    def _schema_with_limits(self, *, path_prefix: str | None, path_params: dict | None):  # noqa: ANN202
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        too_large = {"description": f"the body is over {MAX_REQUEST_BYTES} bytes", "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}}
        for item in schema.get("paths", {}).values():
            for operation in item.values():
                if isinstance(operation, dict) and "requestBody" in operation:
                    responses = operation.setdefault("responses", {})
                    if 413 not in responses and "413" not in responses:  # ninja's own keys are ints
                        responses["413"] = too_large
        return schema


api = ForgeboardAPI(
    title="Forgeboard API",
    version="1",
    description=(
        "Projects, experiments, runs, metrics, events, inventory, and the run controller's channel.\n\n"
        f"Every request body is at most {MAX_REQUEST_BYTES} bytes (a larger one, with or without Content-Length, "
        f"is answered 413 `payload_too_large` before it is read) and its JSON nests at most {MAX_JSON_DEPTH} "
        "levels. Text must not contain NUL characters or lone surrogates. Every error is "
        "`{code, message, errors: [{field, message}]}`.\n\n"
        "The operations that launch runs, send commands, or create experiments and suites take an `Idempotency-Key` "
        "header: a retry with the same key gets the first answer (`Idempotent-Replayed: true`) and creates nothing."
    ),
    urls_namespace="api-v1",
    parser=BoundedJsonParser(),
    docs_decorator=require_safe,  # the document and its page are read: any other method is a 405
)


def error_body(code: str, message: str, errors: list[dict] | None = None) -> dict:
    return {"code": code, "message": message, "errors": errors or []}


@api.exception_handler(ServiceError)
def _service_error(request: HttpRequest, exc: ServiceError) -> HttpResponse:
    return api.create_response(request, exc.as_dict(), status=exc.status)


@api.exception_handler(NinjaValidationError)
def _validation_error(request: HttpRequest, exc: NinjaValidationError) -> HttpResponse:
    errors = []
    for err in exc.errors:
        loc = [str(p) for p in err.get("loc", ())]
        if loc[:1] and loc[0] in ("body", "query", "path", "header", "cookie", "form"):  # where, then the
            loc = loc[2:] if loc[0] == "body" and len(loc) > 2 else loc[1:]  # view's parameter: not fields
        errors.append({"field": ".".join(loc), "message": err.get("msg", "invalid")})
    message = "; ".join(f"{e['field']}: {e['message']}" for e in errors) or "invalid request"
    return api.create_response(request, error_body("validation_failed", message, errors), status=400)


@api.exception_handler(AuthenticationError)
def _auth_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return api.create_response(
        request, error_body("unauthenticated", "a valid bearer token is required"), status=401
    )


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if isinstance(exc.__cause__, ValueError):  # the body could not be parsed (not JSON, or nested too deep)
        reason = exc.__cause__.message if isinstance(exc.__cause__, JsonBodyProblem) else "not valid JSON"
        body = error_body("validation_failed", f"body: {reason}", [{"field": "body", "message": reason}])
        return api.create_response(request, body, status=400)
    if exc.status_code == 403 and str(exc).startswith("CSRF"):  # ninja's session check: same body as Django's
        return csrf_failure(request, reason=str(exc))
    code = CODES.get(exc.status_code, "error")
    return api.create_response(request, error_body(code, str(exc)), status=exc.status_code)


@api.exception_handler(Exception)
def _unexpected_error(request: HttpRequest, exc: Exception) -> HttpResponse:
    if is_database_busy(exc):
        return with_retry_after(_service_error(request, busy_error()))
    return api_internal_error(request, exc)


class RunTokenAuth(HttpBearer):
    """A run controller's token (`fbr_…`); the view checks that it belongs to the run in the path."""

    def authenticate(self, request: HttpRequest, token: str):  # noqa: ANN201
        found = run_token_authenticate(raw=token)
        if found is None:
            refuse_failed_authentication(request, raw=token, kind="fbr")
        return found


class BrowserSessionAuth(SessionAuth):
    """A logged-in browser session (CSRF-checked for writes). A request that presents a bearer token is judged by
    the token alone, so a bad token gets 401, not a CSRF refusal."""

    def __call__(self, request: HttpRequest):  # noqa: ANN204
        if request.headers.get("Authorization", "").lower().startswith("bearer "):
            return None
        return super().__call__(request)


class ApiTokenAuth(HttpBearer):
    """A project API token (`fb_…`), read-only or read-write, limited in requests per minute."""

    def authenticate(self, request: HttpRequest, token: str):  # noqa: ANN201
        found = api_token_authenticate(raw=token)
        if found is None:
            refuse_failed_authentication(request, raw=token, kind="fb")
            return None
        count_token_request(found.prefix)
        return found
