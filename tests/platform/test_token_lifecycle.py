"""API tokens made, listed and revoked by people: `forgeboard token`, /api/v1 (session only) and Settings → API tokens."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from forgeboard.accounts.models import ApiToken, Role
from forgeboard.accounts.services import api_token_create, membership_remove, membership_set
from forgeboard.audit.models import AuditEvent
from forgeboard.errors import PermissionDenied
from tests.support.processes import REPO_DIR, free_port, platform_env, web_server
from tests.support.races import racing_an_open_transaction


def bearer(client: Client, method: str, path: str, token: str, body: dict | None = None):
    kwargs = {"data": json.dumps(body), "content_type": "application/json"} if body is not None else {}
    return getattr(client, method)(f"/api/v1{path}", HTTP_AUTHORIZATION=f"Bearer {token}", **kwargs)


def session_call(client: Client, method: str, path: str, body: dict | None = None):
    kwargs = {"data": json.dumps(body), "content_type": "application/json"} if body is not None else {}
    return getattr(client, method)(f"/api/v1{path}", **kwargs)


def forgeboard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forgeboard.cli", *args], cwd=REPO_DIR, env=platform_env(),
                          capture_output=True, text=True, timeout=120)


def ci_run(suite: str, *, url: str, token: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forgeboard_client.ci", "run", suite, "--project", "alpha"],
                          cwd=REPO_DIR, capture_output=True, text=True, timeout=120,
                          env=platform_env(FORGEBOARD_URL=url, FORGEBOARD_TOKEN=token))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_token_command_end_to_end(team, tmp_path):
    """A real `forgeboard token` process: the secret printed once works, `list` hides it, `revoke` ends it."""
    made = forgeboard("token", "create", "--user", "mateo", "--project", "alpha", "--name", "github-ci",
                      "--scope", "write", "--expires-days", "30")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    token = ApiToken.objects.get(name="github-ci")
    assert secret.startswith(f"fb_{token.prefix}_") and token.scope == "write" and token.created_by == team.member
    assert timedelta(days=29) < token.expires_at - timezone.now() <= timedelta(days=30)
    client = Client()
    listed = bearer(client, "get", "/projects", secret)
    assert listed.status_code == 200 and [p["slug"] for p in listed.json()["items"]] == ["alpha"]

    shown = forgeboard("token", "list", "--user", "mateo")
    assert shown.returncode == 0, shown.stderr
    assert "github-ci" in shown.stdout and f"fb_{token.prefix}_" in shown.stdout and "active" in shown.stdout
    body = secret.removeprefix(f"fb_{token.prefix}_")
    assert len(body) >= 20 and secret not in shown.stdout and body not in shown.stdout

    out = tmp_path / "token.txt"
    to_file = forgeboard("token", "create", "--user", "mateo", "--project", "alpha", "--name", "read-only",
                         "--scope", "read", "--out", str(out))
    assert to_file.returncode == 0, to_file.stderr
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    read_secret = out.read_text().strip()
    assert read_secret.startswith("fb_") and read_secret not in to_file.stdout
    assert bearer(client, "get", "/projects/alpha", read_secret).status_code == 200

    port = free_port()
    with web_server(tmp_path / "web.log", port=port):
        suite = ci_run("nightly", url=f"http://127.0.0.1:{port}", token=secret)
        assert suite.returncode == 2 and "HTTP 404" in suite.stderr and "nightly" in suite.stderr, \
            "the token got through to the suite lookup"
        revoked = forgeboard("token", "revoke", "--user", "mateo", "--project", "alpha", "--name", "github-ci")
        assert revoked.returncode == 0, revoked.stderr
        refused = ci_run("nightly", url=f"http://127.0.0.1:{port}", token=secret)
        assert refused.returncode == 2 and "HTTP 401" in refused.stderr
    assert bearer(client, "get", "/projects", secret).status_code == 401
    assert "revoked" in forgeboard("token", "list", "--user", "mateo", "--project", "alpha").stdout
    assert list(AuditEvent.objects.filter(action__startswith="api_token.").order_by("pk")
                .values_list("action", flat=True)) == ["api_token.create", "api_token.create", "api_token.revoke"]

    refused = forgeboard("token", "create", "--user", "vera", "--project", "alpha", "--name", "x")
    assert refused.returncode != 0 and "member role" in refused.stderr
    outsider = forgeboard("token", "create", "--user", "oscar", "--project", "alpha", "--name", "x")
    assert outsider.returncode != 0 and "no project 'alpha'" in outsider.stderr
    assert ApiToken.objects.count() == 2

    ci_help = subprocess.run([sys.executable, "-m", "forgeboard_client.ci", "run", "--help"], cwd=REPO_DIR,
                             env=platform_env(), capture_output=True, text=True, timeout=60)
    assert ci_help.returncode == 0 and "--junit" in ci_help.stdout


def test_api_creates_lists_and_revokes_tokens(client, team):
    client.force_login(team.member)
    made = session_call(client, "post", "/projects/alpha/tokens", {"name": "ci", "scope": "read",
                                                                    "expires_in_days": 7})
    assert made.status_code == 201, made.content
    body = made.json()
    secret = body["secret"]
    assert secret.startswith(f"fb_{body['prefix']}_") and body["scope"] == "read" and body["active"] is True
    assert body["project"] == "alpha" and body["created_by"] == "mateo" and body["expires_at"]
    taken = session_call(client, "post", "/projects/alpha/tokens", {"name": "ci", "scope": "write"})
    assert taken.status_code == 409 and taken.json()["code"] == "conflict" and taken.json()["errors"][0]["field"] == "name"

    listed = session_call(client, "get", "/projects/alpha/tokens")
    assert listed.status_code == 200
    assert [t["name"] for t in listed.json()] == ["ci"] and "secret" not in listed.json()[0]
    assert secret not in listed.content.decode()

    assert bearer(Client(), "get", "/projects/alpha", secret).status_code == 200
    revoked = session_call(client, "post", f"/tokens/{body['id']}/revoke")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] and revoked.json()["active"] is False
    assert bearer(Client(), "get", "/projects/alpha", secret).status_code == 401
    assert AuditEvent.objects.filter(action="api_token.revoke").count() == 1


def test_outsiders_viewers_and_tokens_cannot_manage_tokens(client, team):
    token, raw = api_token_create(actor=team.member, project=team.project, name="ci", scope="write")
    client.force_login(team.outsider)
    assert session_call(client, "get", "/projects/alpha/tokens").status_code == 404
    assert session_call(client, "post", "/projects/alpha/tokens", {"name": "x", "scope": "read"}).status_code == 404
    assert session_call(client, "post", f"/tokens/{token.pk}/revoke").status_code == 404

    client.force_login(team.viewer)
    assert session_call(client, "get", "/projects/alpha/tokens").status_code == 200
    refused = session_call(client, "post", "/projects/alpha/tokens", {"name": "x", "scope": "read"})
    assert refused.status_code == 403 and refused.json()["code"] == "permission_denied"
    assert session_call(client, "post", f"/tokens/{token.pk}/revoke").status_code == 403

    minted = bearer(Client(), "post", "/projects/alpha/tokens", raw, {"name": "child", "scope": "write"})
    assert minted.status_code == 403 and "not by another token" in minted.json()["message"]
    assert bearer(Client(), "post", f"/tokens/{token.pk}/revoke", raw).status_code == 403
    assert bearer(Client(), "get", "/projects/alpha/tokens", raw).status_code == 403
    assert list(ApiToken.objects.values_list("name", "revoked_at")) == [("ci", None)]


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "a\x00b", "scope": "read"}, "name"),
    ({"name": "", "scope": "read"}, "name"),
    ({"name": "   ", "scope": "read"}, "name"),
    ({"name": "x" * 101, "scope": "read"}, "name"),
    ({"name": "ok", "scope": "admin"}, "scope"),
    ({"name": "ok", "scope": "read", "expires_in_days": 0}, "expires_in_days"),
    ({"name": "ok", "scope": "read", "expires_in_days": 100_000}, "expires_in_days"),
])
def test_bad_token_requests_get_a_field_error(client, team, body, field):
    client.force_login(team.member)
    refused = session_call(client, "post", "/projects/alpha/tokens", body)
    assert refused.status_code == 400, refused.content
    assert refused.json()["code"] == "validation_failed" and refused.json()["errors"][0]["field"] == field
    assert ApiToken.objects.count() == 0


def test_read_tokens_cannot_write_and_expired_tokens_are_refused(client, team):
    _, read = api_token_create(actor=team.member, project=team.project, name="r", scope="read")
    made = bearer(client, "post", "/projects/alpha/experiments", read, {"name": "x", "recipe": "sft"})
    assert made.status_code == 403 and made.json()["message"] == "this API token is read-only"
    soon, raw = api_token_create(actor=team.member, project=team.project, name="soon", scope="write",
                                 expires_at=timezone.now() + timedelta(days=1))
    assert bearer(client, "get", "/projects", raw).status_code == 200
    ApiToken.objects.filter(pk=soon.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    expired = bearer(client, "get", "/projects", raw)
    assert expired.status_code == 401 and expired.json()["code"] == "unauthenticated"
    strict = Client(enforce_csrf_checks=True)
    write = bearer(strict, "post", "/projects/alpha/experiments", raw, {"name": "x", "recipe": "sft"})
    assert write.status_code == 401 and write.json()["code"] == "unauthenticated", "a bad token, not a CSRF refusal"


def test_openapi_states_the_token_bounds(client):
    schema = client.get("/api/v1/openapi.json").json()
    token_in = schema["components"]["schemas"]["TokenIn"]["properties"]
    assert token_in["name"]["maxLength"] == 100 and token_in["name"]["minLength"] == 1
    assert "\\x00" in token_in["name"]["pattern"] and schema["paths"]["/api/v1/projects/{slug}/tokens"]["post"][
        "security"] == [{"PersonAuth": []}], "the document says a session, not a token"
    assert token_in["scope"]["enum"] == ["read", "write"]
    days = token_in["expires_in_days"]["anyOf"][0]
    assert days["minimum"] == 1 and days["maximum"] == 3650
    assert "/api/v1/projects/{slug}/tokens" in schema["paths"] and "/api/v1/tokens/{token_id}/revoke" in schema["paths"]


def test_settings_page_creates_shows_the_secret_once_and_revokes(client, team):
    client.force_login(team.member)
    page = client.get("/settings/tokens/")
    assert page.status_code == 200 and b"No tokens yet" in page.content and b'value="alpha"' in page.content
    assert b'href="/settings/tokens/"' in page.content, "the header links to the page"

    made = client.post("/settings/tokens/", {"project": "alpha", "name": "laptop", "scope": "read", "expires": "30"})
    assert made.status_code == 200 and "no-store" in made["Cache-Control"]
    token = ApiToken.objects.get(name="laptop")
    html = made.content.decode()
    start = html.index(f"fb_{token.prefix}_")
    secret = html[start:html.index('"', start)]
    assert "shown this once" in html and token.scope == "read" and token.expires_at is not None
    assert bearer(Client(), "get", "/projects/alpha", secret).status_code == 200

    again = client.get("/settings/tokens/").content.decode()
    assert "laptop" in again and f"fb_{token.prefix}_…" in again and secret not in again

    duplicate = client.post("/settings/tokens/", {"project": "alpha", "name": "laptop", "scope": "read",
                                                  "expires": ""})
    assert duplicate.status_code == 409 and "already exists" in duplicate.content.decode()
    assert ApiToken.objects.count() == 1

    revoked = client.post(f"/settings/tokens/{token.pk}/revoke/", follow=True)
    assert revoked.status_code == 200 and "revoked" in revoked.content.decode()
    assert bearer(Client(), "get", "/projects/alpha", secret).status_code == 401

    client.force_login(team.outsider)
    assert client.post(f"/settings/tokens/{token.pk}/revoke/").status_code == 404
    assert "laptop" not in client.get("/settings/tokens/").content.decode()
    client.force_login(team.viewer)
    refused = client.post("/settings/tokens/", {"project": "alpha", "name": "v", "scope": "read", "expires": ""})
    assert refused.status_code == 403 and ApiToken.objects.count() == 1


def test_admin_cannot_make_broken_tokens_but_can_revoke(client, team):
    from forgeboard.accounts.models import User

    token, raw = api_token_create(actor=team.member, project=team.project, name="ci", scope="write")
    client.force_login(User.objects.create_superuser("admin", password="pw-admin-1"))
    assert client.get("/admin/accounts/apitoken/add/").status_code == 403
    assert client.get("/admin/accounts/apitoken/").status_code == 200
    done = client.post("/admin/accounts/apitoken/", {"action": "revoke", "_selected_action": [token.pk]})
    assert done.status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None and bearer(Client(), "get", "/projects", raw).status_code == 401
    assert AuditEvent.objects.filter(action="api_token.revoke").count() == 1


def test_a_token_acts_no_further_than_its_creator_can_now(client, team):
    """A token acts for the person who made it: removed from the project, deactivated or made a viewer, their tokens
    lose what they lost, at once (not when someone remembers to revoke them)."""
    made = {scope: api_token_create(actor=team.member, project=team.project, name=f"ci-{scope}", scope=scope)[1]
            for scope in ("write", "read")}
    _, owners = api_token_create(actor=team.owner, project=team.project, name="owner-ci", scope="write")
    experiment = {"name": "x", "recipe": "sft"}
    assert bearer(client, "post", "/projects/alpha/experiments", made["write"], experiment).status_code == 201

    membership_set(actor=team.owner, project=team.project, user=team.member, role=Role.VIEWER)
    demoted = bearer(client, "post", "/projects/alpha/experiments", made["write"], experiment | {"name": "y"})
    assert demoted.status_code == 403 and "you are a viewer" in demoted.json()["message"], demoted.content
    assert bearer(client, "get", "/projects/alpha/experiments", made["write"]).status_code == 200

    team.member.is_active = False
    team.member.save(update_fields=["is_active"])
    for raw in made.values():
        refused = bearer(client, "get", "/projects", raw)
        assert refused.status_code == 401 and refused.json()["code"] == "unauthenticated"
    team.member.is_active = True
    team.member.save(update_fields=["is_active"])
    assert bearer(client, "get", "/projects", made["read"]).status_code == 200

    membership_remove(actor=team.owner, project=team.project, user=team.member)
    for raw in made.values():
        assert bearer(client, "get", "/projects/alpha", raw).status_code == 401
    assert set(ApiToken.objects.filter(created_by=team.member).values_list("revoked_at", flat=True)) != {None}
    assert not ApiToken.objects.filter(created_by=team.member, revoked_at__isnull=True).exists()
    revoked = AuditEvent.objects.filter(action="api_token.revoke", payload__reason="mateo was removed from the project")
    assert revoked.count() == 2
    # Added back, they make new tokens: the old ones stay revoked. Other people's tokens never noticed.
    membership_set(actor=team.owner, project=team.project, user=team.member, role=Role.MEMBER)
    assert bearer(client, "get", "/projects/alpha", made["write"]).status_code == 401
    assert bearer(client, "post", "/projects/alpha/experiments", owners, experiment | {"name": "z"}).status_code == 201


def test_a_revoke_stands_when_its_streams_cannot_be_told(team, monkeypatch, caplog, django_capture_on_commit_callbacks):
    """The channel layer down: the token is revoked all the same (its streams find out at their next check)."""
    from forgeboard.accounts.services import api_token_revoke
    from forgeboard.telemetry import streams

    class DownLayer:
        async def group_send(self, group, message):  # noqa: ANN001, ANN202
            raise ConnectionError("channel layer down")

    monkeypatch.setattr(streams, "get_channel_layer", DownLayer)
    token, _ = api_token_create(actor=team.member, project=team.project, name="ci", scope="read")
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        api_token_revoke(actor=team.member, token=token)
    assert len(callbacks) == 1
    assert ApiToken.objects.get(pk=token.pk).revoked_at is not None
    assert f"could not tell token-{token.pk}'s streams to check their access" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_token_made_while_its_creator_is_removed_does_not_outlive_the_removal(team):
    """The member's token request passed its role check while the owner's removal was being stored, then made a live
    token the removal never saw: once added back, the member had a token that should have died with the removal.
    Now the request waits for the removal and is refused."""
    outcome = racing_an_open_transaction(
        lambda: membership_remove(actor=team.owner, project=team.project, user=team.member),
        lambda: api_token_create(actor=team.member, project=team.project, name="made-meanwhile", scope="write"))
    assert isinstance(outcome, PermissionDenied) and "not a member" in str(outcome), outcome
    assert not ApiToken.objects.filter(created_by=team.member, revoked_at__isnull=True).exists()


def test_a_second_revoke_from_a_page_loaded_before_the_first_changes_nothing(team):
    """Two owners revoking one token from pages loaded before either did: the first revoke's time and its one audit
    entry stand (each request held its own copy, revoked_at None, and wrote both again)."""
    from forgeboard.accounts.services import api_token_revoke

    token, _ = api_token_create(actor=team.member, project=team.project, name="ci", scope="read")
    first, second = ApiToken.objects.get(pk=token.pk), ApiToken.objects.get(pk=token.pk)
    api_token_revoke(actor=team.owner, token=first)
    revoked_at = ApiToken.objects.get(pk=token.pk).revoked_at
    assert api_token_revoke(actor=team.member, token=second).revoked_at == revoked_at
    assert ApiToken.objects.get(pk=token.pk).revoked_at == revoked_at
    assert AuditEvent.objects.filter(action="api_token.revoke", target_id=str(token.pk)).count() == 1
