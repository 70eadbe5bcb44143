"""Per-token request limits and brakes on repeated bad tokens and failed logins, counted in the shared cache.

The cache is Redis when REDIS_URL is set, else the database: either way every web process counts
into the same fixed windows. Only failures are counted and only failures are refused: a valid
credential is checked before any brake and always gets through.
"""

from __future__ import annotations

import hashlib
import ipaddress
import time

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest

from forgeboard.bearer import token_prefix
from forgeboard.errors import ServiceError

WINDOW_S = 60


class RateLimited(ServiceError):
    status = 429
    code = "rate_limited"


def _bucket(key: str, window_s: int) -> str:
    return f"ratelimit:{key}:{window_s}:{int(time.time() // window_s)}"


def _count(key: str, window_s: int = WINDOW_S) -> int:
    bucket = _bucket(key, window_s)
    cache.add(bucket, 0, timeout=2 * window_s)
    try:
        return cache.incr(bucket)
    except ValueError:  # gone between add and incr (expired, evicted, or the add lost to a locked database)
        cache.set(bucket, 1, timeout=2 * window_s)
        return 1


def _peek(key: str, window_s: int = WINDOW_S) -> int:
    return cache.get(_bucket(key, window_s), 0)


def _trusted(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in settings.TRUSTED_PROXIES)


def client_address(request: HttpRequest) -> str:
    """The peer's address; behind a configured proxy, the nearest untrusted address in its X-Forwarded-For."""
    peer = request.META.get("REMOTE_ADDR") or "unknown"
    if not _trusted(peer):
        return peer
    forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if part.strip()]
    for hop in reversed(forwarded):
        if not _trusted(hop):
            try:
                return str(ipaddress.ip_address(hop))
            except ValueError:
                return peer  # a proxy passed on garbage: count it against the proxy's own address
    return forwarded[0] if forwarded else peer


def _failure_key(request: HttpRequest, raw: str, kind: str) -> str:
    """A well-formed token's failures count against its prefix, a malformed one's against the address."""
    prefix = token_prefix(raw, kind)
    return f"authfail:{kind}:{prefix}" if prefix else f"authfail:addr:{client_address(request)}"


def refuse_failed_authentication(request: HttpRequest, *, raw: str, kind: str) -> None:
    """Count a bearer token that did not authenticate; past the limit, answer 429 instead of 401."""
    if _count(_failure_key(request, raw, kind)) > settings.API_AUTH_FAILURES_PER_MINUTE:
        raise RateLimited("too many requests with this invalid token; wait a minute")


def count_token_request(prefix: str) -> None:
    if _count(f"token:{prefix}") > settings.API_RATE_PER_MINUTE:
        raise RateLimited(f"this token is over {settings.API_RATE_PER_MINUTE} requests a minute; slow down")


def _account_key(username: str) -> str:
    digest = hashlib.sha256(username.strip().lower().encode("utf-8", "replace")).hexdigest()[:32]
    return f"loginfail:user:{digest}"


def login_refusal(request: HttpRequest, *, username: str) -> str | None:
    """Why a login attempt is refused before its password is checked, or None."""
    window = settings.LOGIN_FAILURE_WINDOW_S
    minutes = max(1, round(window / 60))
    if _peek(_account_key(username), window) >= settings.LOGIN_FAILURES_PER_ACCOUNT:
        return (f"Too many failed logins for this account. Try again in {minutes} minute{'s' * (minutes > 1)} "
                "(an administrator can also reset the password).")
    if _peek(f"loginfail:addr:{client_address(request)}", window) >= settings.LOGIN_FAILURES_PER_ADDRESS:
        return f"Too many failed logins from your address. Try again in {minutes} minute{'s' * (minutes > 1)}."
    return None


def record_login_failure(request: HttpRequest, *, username: str) -> None:
    window = settings.LOGIN_FAILURE_WINDOW_S
    _count(_account_key(username), window)
    _count(f"loginfail:addr:{client_address(request)}", window)
