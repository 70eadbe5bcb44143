"""`@idempotent_form` for pages whose form creates something (the launch form): a double-click or a resubmitted
page sends its hidden `idempotency_key` again and lands where the first submission did; a page brought back and
changed is a new submission."""

from __future__ import annotations

import functools
from collections.abc import Callable

from django.contrib import messages
from django.http import HttpRequest, HttpResponse

from forgeboard.errors import ServiceError
from forgeboard.idempotency.services import replay_or_claim
from forgeboard.web.errors import error_page


def idempotent_form(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    @functools.wraps(view)
    def keyed(request: HttpRequest, *args: object, **kwargs: object) -> HttpResponse:
        try:
            replayed = replay_or_claim(request, actor=request.user, path=kwargs, form=True)
        except ServiceError as exc:
            return error_page(request, exc)
        if replayed is not None:
            messages.info(request, "This form was already sent: here is what it did the first time.")
            return replayed
        return view(request, *args, **kwargs)

    return keyed
