"""The password backend behind every login form (the dashboard's and the admin's), with the failed-login brake."""

from __future__ import annotations

from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.signals import user_login_failed
from django.core.exceptions import PermissionDenied
from django.dispatch import receiver
from django.http import HttpRequest

from forgeboard.api.ratelimit import login_refusal, record_login_failure


class ThrottledModelBackend(ModelBackend):
    """Past the brake (api/ratelimit.py) a password is not even checked: right or wrong, the login fails."""

    def authenticate(self, request: HttpRequest | None, username: str | None = None, password: str | None = None,
                     **kwargs: object):  # noqa: ANN201
        if request is not None and login_refusal(request, username=username or ""):
            raise PermissionDenied("too many failed logins")  # stops every backend; user_login_failed still fires
        return super().authenticate(request, username=username, password=password, **kwargs)


@receiver(user_login_failed)
def _count_failed_login(sender: object, credentials: dict, request: HttpRequest | None = None, **_: object) -> None:
    if request is not None:
        record_login_failure(request, username=str(credentials.get("username") or ""))
