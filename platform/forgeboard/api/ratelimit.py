"""Per-token request limits and a brake on repeated bad tokens, counted in the shared cache.

The cache is Redis when REDIS_URL is set, else the database: either way every web process counts
into the same fixed one-minute windows.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest

from forgeboard.errors import ServiceError

WINDOW_S = 60


class RateLimited(ServiceError):
    status = 429
    code = "rate_limited"


def _count(key: str) -> int:
    bucket = f"ratelimit:{key}:{int(time.time() // WINDOW_S)}"
    cache.add(bucket, 0, timeout=2 * WINDOW_S)
    return cache.incr(bucket)


def _peek(key: str) -> int:
    return cache.get(f"ratelimit:{key}:{int(time.time() // WINDOW_S)}", 0)


def client_address(request: HttpRequest) -> str:
    return request.META.get("REMOTE_ADDR", "unknown")


def refuse_if_failing_too_often(request: HttpRequest) -> None:
    if _peek(f"authfail:{client_address(request)}") >= settings.API_AUTH_FAILURES_PER_MINUTE:
        raise RateLimited("too many requests with invalid tokens from this address; wait a minute")


def record_auth_failure(request: HttpRequest) -> None:
    _count(f"authfail:{client_address(request)}")


def count_token_request(prefix: str) -> None:
    if _count(f"token:{prefix}") > settings.API_RATE_PER_MINUTE:
        raise RateLimited(f"this token is over {settings.API_RATE_PER_MINUTE} requests a minute; slow down")
