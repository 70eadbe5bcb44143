"""`@idempotent` for /api/v1 operations that create something: a copy of a request sent with the same
Idempotency-Key gets the first one's answer (idempotency/services.py says how keys work)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest

from forgeboard.api.auth import actor_of
from forgeboard.idempotency.services import replay_or_claim

IDEMPOTENCY_NOTE = ("Send `Idempotency-Key: <a new UUID>` to make a retry safe: a copy of this request with the same "
                    "key (within 24 hours, from the same token or session) gets the first answer again, marked "
                    "`Idempotent-Replayed: true`, and creates nothing; the same key with another body is a 422.")


def idempotent(view: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(view)
    def keyed(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        replayed = replay_or_claim(request, actor=actor_of(request), path=kwargs)
        return view(request, *args, **kwargs) if replayed is None else replayed

    keyed.__doc__ = f"{inspect.cleandoc(view.__doc__)}\n\n{IDEMPOTENCY_NOTE}" if view.__doc__ else IDEMPOTENCY_NOTE
    return keyed
