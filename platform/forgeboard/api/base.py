"""The /api/v1 NinjaAPI: one error format for every failure, and the authentication schemes."""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError
from ninja.errors import ValidationError as NinjaValidationError
from ninja.security import HttpBearer

from forgeboard.accounts.services import api_token_authenticate
from forgeboard.api.ratelimit import count_token_request, record_auth_failure, refuse_if_failing_too_often
from forgeboard.errors import ServiceError
from forgeboard.runs.tokens import run_token_authenticate

logger = logging.getLogger(__name__)

api = NinjaAPI(
    title="Forgeboard API",
    version="1",
    description="Projects, experiments, runs, metrics, events, inventory, and the run controller's channel.",
    urls_namespace="api-v1",
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
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "payload")]
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
    return api.create_response(request, error_body("error", str(exc)), status=exc.status_code)


class RunTokenAuth(HttpBearer):
    """A run controller's token (`fbr_…`); the view checks that it belongs to the run in the path."""

    def authenticate(self, request: HttpRequest, token: str):  # noqa: ANN201
        refuse_if_failing_too_often(request)
        found = run_token_authenticate(raw=token)
        if found is None:
            record_auth_failure(request)
        return found


class ApiTokenAuth(HttpBearer):
    """A project API token (`fb_…`), read-only or read-write, limited in requests per minute."""

    def authenticate(self, request: HttpRequest, token: str):  # noqa: ANN201
        refuse_if_failing_too_often(request)
        found = api_token_authenticate(raw=token)
        if found is None:
            record_auth_failure(request)
            return None
        count_token_request(found.prefix)
        return found
