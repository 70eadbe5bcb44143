"""Run tokens: one live credential per run, handed to its controller at launch."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from forgeboard.bearer import mint_token, token_matches, token_prefix
from forgeboard.runs.models import Run, RunToken
from forgeboard.runs.states import TERMINAL_STATES


@transaction.atomic
def run_token_issue(*, run: Run) -> str:
    """A new token for the run (older ones are revoked: a restarted controller gets a fresh one)."""
    run_tokens_revoke(run=run)
    minted = mint_token("fbr")
    RunToken.objects.create(run=run, prefix=minted.prefix, token_hash=minted.token_hash)
    return minted.raw


def run_tokens_revoke(*, run: Run) -> int:
    """Revoke the run's live tokens (its lost controller's, before a restart); how many."""
    return RunToken.objects.filter(run=run, revoked_at__isnull=True).update(revoked_at=timezone.now())


def run_token_authenticate(*, raw: str) -> RunToken | None:
    prefix = token_prefix(raw, "fbr")
    if prefix is None:
        return None
    token = RunToken.objects.select_related("run__experiment__project").filter(prefix=prefix).first()
    if token is None or token.revoked_at is not None or not token_matches(raw, token.token_hash):
        return None
    if token.run.state in TERMINAL_STATES:
        return None
    return token
