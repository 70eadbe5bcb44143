"""Strict readers for environment variables.

A bad value is an ImproperlyConfigured error that names the variable; a secret
may come from `NAME_FILE`, a path to a file holding it.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Env:
    def __init__(self, environ: Mapping[str, str] | None = None):
        self._environ = os.environ if environ is None else environ

    def _raw(self, name: str) -> str | None:
        value = self._environ.get(name)
        return value if value not in (None, "") else None

    def str(self, name: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self._raw(name)
        if value is None:
            if required:
                raise ImproperlyConfigured(f"{name} is required but not set")
            return default
        return value

    def secret(self, name: str, default: str | None = None, *, required: bool = False) -> str | None:
        file_name = f"{name}_FILE"
        direct, path = self._raw(name), self._raw(file_name)
        if direct is not None and path is not None:
            raise ImproperlyConfigured(f"{name} and {file_name} are both set: set only one")
        if path is not None:
            try:
                with open(path, encoding="utf-8") as handle:
                    value = handle.read().strip()
            except OSError as exc:
                raise ImproperlyConfigured(f"{file_name}: cannot read {path!r} ({exc.strerror})") from None
            if not value:
                raise ImproperlyConfigured(f"{file_name}: file {path!r} is empty")
            return value
        return self.str(name, default, required=required)

    def bool(self, name: str, default: bool) -> bool:
        value = self._raw(name)
        if value is None:
            return default
        lowered = value.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ImproperlyConfigured(f"{name}: expected true or false, got {value!r}")

    def int(self, name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
        value = self._raw(name)
        if value is None:
            return default
        try:
            number = int(value.strip())
        except ValueError:
            raise ImproperlyConfigured(f"{name}: expected an integer, got {value!r}") from None
        if minimum is not None and number < minimum:
            raise ImproperlyConfigured(f"{name}: must be at least {minimum}, got {number}")
        if maximum is not None and number > maximum:
            raise ImproperlyConfigured(f"{name}: must be at most {maximum}, got {number}")
        return number

    def list(self, name: str, default: list[str] | None = None) -> list[str]:
        value = self._raw(name)
        if value is None:
            return list(default or [])
        return [item.strip() for item in value.split(",") if item.strip()]

    def networks(self, name: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """A comma-separated list of addresses or CIDRs (`10.0.0.0/8, ::1`)."""
        networks = []
        for item in self.list(name):
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ImproperlyConfigured(f"{name}: expected IP addresses or CIDRs, got {item!r}") from None
        return networks

    def choice(self, name: str, choices: tuple[str, ...], default: str) -> str:
        value = self._raw(name)
        if value is None:
            return default
        if value not in choices:
            raise ImproperlyConfigured(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
        return value

    def url(self, name: str, schemes: tuple[str, ...], *, secret: bool = False) -> str | None:
        value = self.secret(name) if secret else self.str(name)
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in schemes or not (parts.hostname or parts.path):
            raise ImproperlyConfigured(
                f"{name}: expected a URL with scheme {' or '.join(schemes)}, got one with scheme {parts.scheme!r}"
            )
        return value


def database_from_url(url: str, *, conn_max_age: int, pool_size: int = 0) -> dict:
    """Django DATABASES entry for a postgres:// URL (psycopg 3); pool_size > 0 pools connections."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    if not name:
        raise ImproperlyConfigured("DATABASE_URL: the URL names no database")
    try:
        port = parts.port
    except ValueError:
        raise ImproperlyConfigured("DATABASE_URL: the port is not a number") from None
    pooled = {"OPTIONS": {"pool": {"min_size": 1, "max_size": pool_size, "timeout": 30}}} if pool_size else {}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": parts.username or "",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "",
        "PORT": str(port or ""),
        "CONN_MAX_AGE": 0 if pool_size else conn_max_age,  # Django refuses persistent connections with a pool
        "CONN_HEALTH_CHECKS": True,
    } | pooled
