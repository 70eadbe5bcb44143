"""Who is calling /api/v1: a project API token, or a logged-in browser session (with CSRF for writes)."""

from __future__ import annotations

from django.http import HttpRequest

from forgeboard.accounts.models import TokenScope
from forgeboard.accounts.permissions import Actor
from forgeboard.api.base import ApiTokenAuth, BrowserSessionAuth
from forgeboard.errors import PermissionDenied

USER_AUTH = [ApiTokenAuth(), BrowserSessionAuth()]


def actor_of(request: HttpRequest) -> Actor:
    return request.auth


def require_write_scope(request: HttpRequest) -> None:
    token = request.auth
    if getattr(token, "scope", TokenScope.WRITE) != TokenScope.WRITE:
        raise PermissionDenied("this API token is read-only")
