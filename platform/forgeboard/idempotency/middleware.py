"""Keeps the answer of a write sent with an idempotency key, if its view claimed the key.

The view's `idempotent` decorator (api/idempotent.py, web/idempotent.py) opens a transaction and claims the key in
it, or answers with the stored answer; this middleware, around the view, records a successful answer in that
transaction, with what the view made, and rolls back a refused one (from the claim on), so a key is never left
claimed by a request that changed nothing. A view that takes no key runs as it would without one. The views that
take one answer whole (JSON, a page, a redirect), never streamed: an answer is kept as its bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

from django.db import transaction
from django.http import HttpRequest, HttpResponse

from forgeboard.idempotency.services import idempotent_record, requested_key


class IdempotencyMiddleware:
    """Last in MIDDLEWARE: the transaction it closes holds only the view, from the claim on."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        key = requested_key(request)
        if key is None:
            return self.get_response(request)
        request.idempotency_key = key
        request.idempotency_transaction = ExitStack()  # replay_or_claim opens it
        with request.idempotency_transaction:
            response = self.get_response(request)
            claim = getattr(request, "idempotency_claim", None)
            if claim is not None and (response.status_code >= 400 or getattr(request, "idempotency_refused", False)):
                transaction.set_rollback(True)
            elif claim is not None:
                idempotent_record(claim=claim, response=response)
        return response
