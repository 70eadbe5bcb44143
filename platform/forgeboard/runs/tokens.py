"""Run tokens: one live credential per run, handed to its controller at launch."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from django.db import transaction
from django.utils import timezone

from forgeboard.runs.models import Run, RunToken
from forgeboard.runs.states import TERMINAL_STATES

RUN_TOKEN_PREFIX_BYTES = 6


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


@transaction.atomic
def run_token_issue(*, run: Run) -> str:
    """A new token for the run (older ones are revoked: a restarted controller gets a fresh one)."""
    RunToken.objects.filter(run=run, revoked_at__isnull=True).update(revoked_at=timezone.now())
    prefix = secrets.token_hex(RUN_TOKEN_PREFIX_BYTES)
    raw = f"fbr_{prefix}_{secrets.token_urlsafe(24)}"
    RunToken.objects.create(run=run, prefix=prefix, token_hash=_hash(raw))
    return raw


def run_token_authenticate(*, raw: str) -> RunToken | None:
    parts = raw.split("_", 2) if isinstance(raw, str) else []
    if len(parts) != 3 or parts[0] != "fbr" or len(parts[1]) != 2 * RUN_TOKEN_PREFIX_BYTES:
        return None
    token = RunToken.objects.select_related("run__experiment__project").filter(prefix=parts[1]).first()
    if token is None or token.revoked_at is not None or not hmac.compare_digest(token.token_hash, _hash(raw)):
        return None
    if token.run.state in TERMINAL_STATES:
        return None
    return token
