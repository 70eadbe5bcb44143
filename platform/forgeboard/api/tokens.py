"""/api/v1 API tokens: a logged-in user creates, lists and revokes a project's tokens. A token cannot mint tokens."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Literal

from django.http import HttpRequest
from django.utils import timezone
from ninja import Router, Schema, Status
from pydantic import Field

from forgeboard.accounts.models import ApiToken
from forgeboard.accounts.selectors import api_token_get, api_tokens_for_project, project_get
from forgeboard.accounts.services import MAX_TOKEN_LIFETIME, api_token_create, api_token_revoke
from forgeboard.api.base import BrowserSessionAuth
from forgeboard.api.schemas import ERRORS
from forgeboard.errors import PermissionDenied



class PersonAuth(BrowserSessionAuth):
    """Only a logged-in person: a request presenting a bearer token is refused outright, with the reason."""

    def __call__(self, request: HttpRequest):  # noqa: ANN204
        if request.headers.get("Authorization", "").lower().startswith("bearer "):
            raise PermissionDenied("API tokens are managed by a logged-in user (the dashboard or `forgeboard token`), "
                                   "not by another token")
        return super().__call__(request)


router = Router(auth=PersonAuth(), tags=["tokens"])

# Text with something besides whitespace, and no NUL (PostgreSQL cannot store it).
NAME_PATTERN = r"^[^\x00]*[^\x00\s][^\x00]*$"


class TokenIn(Schema):
    name: Annotated[str, Field(min_length=1, max_length=100, pattern=NAME_PATTERN)]
    scope: Literal["read", "write"]
    expires_in_days: Annotated[int, Field(ge=1, le=MAX_TOKEN_LIFETIME.days)] | None = Field(
        default=None, description="days until the token stops working; empty: it does not expire")


class TokenOut(Schema):
    id: int
    project: str = Field(description="the project's slug")
    name: str
    prefix: str = Field(description="the token's visible part: it starts fb_<prefix>_")
    scope: Literal["read", "write"]
    created_by: str | None
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    active: bool

    @staticmethod
    def resolve_project(token: ApiToken) -> str:
        return token.project.slug

    @staticmethod
    def resolve_created_by(token: ApiToken) -> str | None:
        return token.created_by.username if token.created_by else None

    @staticmethod
    def resolve_active(token: ApiToken) -> bool:
        return token.revoked_at is None and (token.expires_at is None or token.expires_at > timezone.now())


class TokenCreatedOut(TokenOut):
    secret: str = Field(description="the whole token, shown this once and never again")


@router.get("/projects/{slug}/tokens", response={200: list[TokenOut], **ERRORS})
def list_tokens(request: HttpRequest, slug: str):  # noqa: ANN201
    actor = request.auth
    return list(api_tokens_for_project(actor=actor, project=project_get(actor=actor, slug=slug)))


@router.post("/projects/{slug}/tokens", response={201: TokenCreatedOut, **ERRORS})
def create_token(request: HttpRequest, slug: str, body: TokenIn):  # noqa: ANN201
    actor = request.auth
    project = project_get(actor=actor, slug=slug)
    expires_at = timezone.now() + timedelta(days=body.expires_in_days) if body.expires_in_days else None
    token, raw = api_token_create(actor=actor, project=project, name=body.name, scope=body.scope,
                                  expires_at=expires_at)
    token.secret = raw
    return Status(201, token)


@router.post("/tokens/{token_id}/revoke", response={200: TokenOut, **ERRORS})
def revoke_token(request: HttpRequest, token_id: int):  # noqa: ANN201
    actor = request.auth
    return api_token_revoke(actor=actor, token=api_token_get(actor=actor, token_id=token_id))
