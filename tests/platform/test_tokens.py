"""API tokens: shown once, stored hashed with a visible prefix, and refused once revoked or expired."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from forgeboard.accounts.models import ApiToken
from forgeboard.accounts.services import api_token_authenticate, api_token_create, api_token_revoke
from forgeboard.errors import AlreadyExists, ValidationFailed


def test_token_is_stored_hashed_and_authenticates(team):
    token, raw = api_token_create(actor=team.member, project=team.project, name="ci", scope="write")
    assert raw.startswith(f"fb_{token.prefix}_")
    stored = ApiToken.objects.get(pk=token.pk)
    assert raw not in (stored.token_hash, stored.prefix, stored.name)
    assert len(stored.token_hash) == 64
    found = api_token_authenticate(raw=raw)
    assert found == token and found.last_used_at is not None


@pytest.mark.parametrize("tamper", ["secret", "prefix", "garbage", "empty"])
def test_wrong_tokens_do_not_authenticate(team, tamper):
    token, raw = api_token_create(actor=team.member, project=team.project, name="ci", scope="read")
    bad = {
        "secret": raw[:-2] + ("AA" if not raw.endswith("AA") else "BB"),
        "prefix": f"fb_{'0' * 12}_{raw.split('_', 2)[2]}",
        "garbage": "Bearer nonsense",
        "empty": "",
    }[tamper]
    assert api_token_authenticate(raw=bad) is None


def test_revoked_and_expired_tokens_stop_working(team):
    token, raw = api_token_create(actor=team.member, project=team.project, name="ci", scope="read")
    api_token_revoke(actor=team.member, token=token)
    assert api_token_authenticate(raw=raw) is None
    soon, raw2 = api_token_create(actor=team.member, project=team.project, name="short", scope="read",
                                  expires_at=timezone.now() + timedelta(seconds=30))
    assert api_token_authenticate(raw=raw2) == soon
    ApiToken.objects.filter(pk=soon.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert api_token_authenticate(raw=raw2) is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"scope": "admin"}, "scope"), ({"name": ""}, "name"),
     ({"expires_at": timezone.now() - timedelta(days=1)}, "expires_at")],
)
def test_bad_token_requests_are_refused(team, kwargs, field):
    args = {"name": "ci", "scope": "read"} | kwargs
    with pytest.raises(ValidationFailed) as caught:
        api_token_create(actor=team.member, project=team.project, **args)
    assert caught.value.problems[0].field == field
    assert ApiToken.objects.count() == 0


def test_duplicate_token_name_is_refused(team):
    api_token_create(actor=team.member, project=team.project, name="ci", scope="read")
    with pytest.raises(AlreadyExists, match="already exists"):
        api_token_create(actor=team.owner, project=team.project, name="ci", scope="write")
    assert ApiToken.objects.count() == 1
