"""Idempotency keys: a second copy of a write (a retried launch, a double-clicked form) gets the first one's answer.

A client sends `Idempotency-Key: <text>` (a form, a hidden `idempotency_key` field) with a write that creates
something. The first copy is handled as usual and, if it succeeded (an answer under 400), its answer is kept for
KEY_LIFETIME; any copy after that gets the same status and body again, marked `Idempotent-Replayed: true`, and
creates nothing. A refused or failed request keeps nothing, so the same key can be sent again once it is fixed.
The same key with a different method, path or body is refused (422): it names another request.

Keys are per credential (an API token, or a user's session), so one caller can never read another's answers, and a
copy is answered only while its caller may still send it: a member removed since, or made a viewer, gets the refusal
the request would get now, not the answer they once had.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils import timezone

from forgeboard.accounts.models import ApiToken, Project, Role
from forgeboard.accounts.permissions import Actor, require_project_role
from forgeboard.accounts.selectors import project_get
from forgeboard.errors import Conflict, FieldProblem, ServiceError, ValidationFailed
from forgeboard.experiments.selectors import experiment_get
from forgeboard.idempotency.models import IdempotentRequest
from forgeboard.request_refusals import FORMS
from forgeboard.runs.selectors import run_get
from workers.engine.wire_limits import loads_bounded

HEADER = "Idempotency-Key"
FORM_FIELD = "idempotency_key"
REPLAYED_HEADER = "Idempotent-Replayed"
KEY_LIFETIME = timedelta(hours=24)
MAX_KEY_CHARS = 200  # and a form's key takes 33 more (replay_or_claim): the column holds 255
_KEY = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_CHARS}}}")  # visible ASCII: what a header carries unchanged
_NOT_THE_REQUEST = ("csrfmiddlewaretoken", FORM_FIELD)  # form fields that differ between copies of one submission


class KeyReused(ServiceError):
    status = 422
    code = "idempotency_key_reused"


def requested_key(request: HttpRequest) -> str | None:
    """The key a write was sent with (the header, else a form's field), unchecked; None for a read or no key."""
    if request.method not in ("POST", "PUT", "PATCH", "DELETE"):
        return None
    if HEADER in request.headers:
        return request.headers[HEADER]
    if request.content_type in FORMS and FORM_FIELD in request.POST:
        return request.POST[FORM_FIELD]
    return None


def checked_key(text: str) -> str:
    if not _KEY.fullmatch(text):
        raise ValidationFailed.on(HEADER, f"must be 1 to {MAX_KEY_CHARS} visible ASCII characters (a UUID is one)")
    return text


def owner_of(actor: Actor) -> str:
    """Whose key space a request is in: its API token's, or its user's."""
    if isinstance(actor, ApiToken):
        return f"token:{actor.pk}"
    return f"user:{actor.pk}"


def request_fingerprint(request: HttpRequest, *, form: bool = False) -> str:
    """What makes two requests copies of one: method, path with query, and the body as its view reads it (a form's
    by its fields; else JSON compared by value, whatever the body is labelled)."""
    digest = hashlib.sha256(f"{request.method} {request.get_full_path()}\n".encode())
    digest.update(_canonical_body(request, form=form))
    return digest.hexdigest()


def _canonical_body(request: HttpRequest, *, form: bool) -> bytes:
    if form:
        fields = sorted((name, value) for name, values in request.POST.lists() if name not in _NOT_THE_REQUEST
                        for value in values)
        return json.dumps(fields).encode()
    try:
        return json.dumps(loads_bounded(request.body), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        return request.body


def idempotency_keys_purge(*, now: datetime) -> int:
    """Forget the answers kept longer than KEY_LIFETIME: how many were forgotten."""
    return _expired(now).delete()[0]


def _expired(now: datetime) -> QuerySet[IdempotentRequest]:
    return IdempotentRequest.objects.filter(created_at__lt=now - KEY_LIFETIME)


def idempotent_claim(*, owner: str, key: str, fingerprint: str) -> IdempotentRequest:
    """Claim the key for this request (a new row, answer None) or find the answer its first copy got.

    Call inside the transaction that records the answer: the claim is committed with it, or not at all. The key's
    expired answer goes first, so a key past its lifetime is new again at once. The hourly purge forgets the others:
    deleted here, they stayed locked until this request was done, and the owner's other keyed requests waited."""
    _expired(timezone.now()).filter(owner=owner, key=key).delete()
    try:
        with transaction.atomic():
            return IdempotentRequest.objects.create(owner=owner, key=key, fingerprint=fingerprint)
    except IntegrityError:  # a copy committed first (this insert waited for it)
        stored = IdempotentRequest.objects.filter(owner=owner, key=key).first()
    if stored is None or stored.status_code is None:  # forgotten meanwhile, or unfinished: a retry settles it
        raise Conflict(f"the first request with {HEADER} {key!r} has not finished: send it again shortly")
    if stored.fingerprint != fingerprint:
        raise KeyReused(f"{HEADER} {key!r} was already used for a different request (method, path or body): "
                        "use a new key for a new request",
                        problems=[FieldProblem(HEADER, "already used for a different request")])
    return stored


def idempotent_refused(request: HttpRequest) -> None:
    """For a view whose refusal is not a 4xx (an error flashed on the page it came from, and a redirect): keep no
    answer, so the key can be sent again."""
    request.idempotency_refused = True


def idempotent_record(*, claim: IdempotentRequest, response: HttpResponse) -> None:
    claim.status_code = response.status_code
    claim.content_type = response.get("Content-Type", "")
    claim.location = response.get("Location", "")
    claim.body = bytes(response.content)
    claim.save(update_fields=["status_code", "content_type", "location", "body"])


def replayed_answer(stored: IdempotentRequest) -> HttpResponse:
    if stored.location:
        response: HttpResponse = HttpResponseRedirect(stored.location, content_type=stored.content_type or None)
        response.status_code = stored.status_code
    else:
        response = HttpResponse(status=stored.status_code, content_type=stored.content_type or None)
    response.content = bytes(stored.body)
    response[REPLAYED_HEADER] = "true"
    return response


def project_in_path(*, actor: Actor, path: Mapping[str, object]) -> Project:
    """The project a keyed request's URL names (by its slug, an experiment or a run), as the actor may see it."""
    if "slug" in path:
        return project_get(actor=actor, slug=str(path["slug"]))
    if "experiment_id" in path:
        return experiment_get(actor=actor, experiment_id=path["experiment_id"]).project  # type: ignore[arg-type]
    if "run_id" in path:
        return run_get(actor=actor, run_id=path["run_id"]).experiment.project  # type: ignore[arg-type]
    raise LookupError(f"a keyed view's URL names no project: {sorted(path)}")


def _require_may_send_again(*, actor: Actor, path: Mapping[str, object]) -> None:
    """Every keyed request creates something in its project, which takes the member role."""
    require_project_role(actor=actor, project=project_in_path(actor=actor, path=path), minimum=Role.MEMBER,
                         action="sending this request")


def replay_or_claim(request: HttpRequest, *, actor: Actor, path: Mapping[str, object],
                    form: bool = False) -> HttpResponse | None:
    """For a view's `idempotent` decorator: the stored answer when this request is a copy, else None with the key
    claimed in a transaction that holds the rest of the view (IdempotencyMiddleware records the view's answer in it
    and closes it). None too when no key was sent. `path` is the view's URL parameters: a copy is answered only
    while the actor may still write to the project they name.

    `form` is for a form's hidden key: the request is the form's fields, and a page brought back and changed before
    it is sent again is a new submission, not a reused key, so the key stands for this key and these fields together.
    """
    key = getattr(request, "idempotency_key", None)  # set by IdempotencyMiddleware
    if key is None:
        return None
    fingerprint = request_fingerprint(request, form=form)
    key = checked_key(key) + (f":{fingerprint[:32]}" if form else "")
    request.idempotency_transaction.enter_context(transaction.atomic())
    claim = idempotent_claim(owner=owner_of(actor), key=key, fingerprint=fingerprint)
    if claim.status_code is not None:
        _require_may_send_again(actor=actor, path=path)
        return replayed_answer(claim)
    request.idempotency_claim = claim
    return None
