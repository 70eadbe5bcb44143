"""The two settings a shared platform needs, as a person uses them: an operator registers a model under the
artifact roots and sees it listed (and a path outside them refused at its field); a member creates an API
token, sees its secret once, and it is gone on reload while the token stays listed until revoked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.conf import settings

from forgeboard.accounts.models import ApiToken, Role
from forgeboard.accounts.services import membership_set
from forgeboard.artifacts.models import Artifact
from tests.e2e.conftest import login, screenshot
from tests.support.processes import free_port, kill_processes_in, web_server


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifact-root")


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker, tmp_path_factory, roots):
    """The web server with one artifact root of its own (the test settings' roots are wide open)."""
    tmp = tmp_path_factory.mktemp("e2e-artifacts-server")
    port = free_port()
    with django_db_blocker.unblock():
        try:
            with web_server(tmp / "web.log", port=port, FORGEBOARD_ARTIFACT_ROOTS=str(roots)):
                yield {"url": f"http://127.0.0.1:{port}", "tmp": tmp}
        finally:
            kill_processes_in(Path(settings.DATA_DIR) / "runs")


def test_an_operator_registers_a_model_and_sees_it_listed(page, server, team, roots):
    membership_set(actor=team.owner, project=team.project, user=team.operator, role=Role.MEMBER)
    model = roots / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    login(page, server, "opal")
    page.goto(f"{server['url']}/p/alpha/artifacts/")
    form = page.locator("form", has=page.get_by_role("button", name="Register"))
    form.get_by_label("Name").fill("outside")
    (outside := roots.parent / "elsewhere").mkdir(exist_ok=True)
    (outside / "config.json").write_text("{}")
    form.get_by_label("Path").fill(str(outside))
    form.get_by_role("button", name="Register").click()
    page.wait_for_load_state("networkidle")
    assert "outside the artifact roots" in page.locator("main").inner_text()
    assert not Artifact.objects.filter(name="outside").exists()

    form = page.locator("form", has=page.get_by_role("button", name="Register"))
    form.get_by_label("Name").fill("tiny-qwen3")
    form.get_by_label("Path").fill(str(model))
    form.get_by_role("button", name="Register").click()
    page.wait_for_load_state("networkidle")
    row = page.locator("tr", has_text="tiny-qwen3")
    assert row.is_visible() and str(model) in row.inner_text() and "model" in row.inner_text()
    box = row.bounding_box()
    assert box is not None and box["width"] > 600, "the row spans the table"
    assert Artifact.objects.get(project=team.project, name="tiny-qwen3").path == str(model.resolve())
    screenshot(page, "artifacts_registered")


def test_a_member_creates_a_token_sees_it_once_and_revokes_it(page, server, team):
    login(page, server, "mateo")
    page.goto(f"{server['url']}/settings/tokens/")
    form = page.locator("form", has=page.get_by_role("button", name="Create"))
    form.get_by_label("Name").fill("github-ci")
    form.get_by_label("Scope").select_option("write")
    form.get_by_role("button", name="Create").click()
    page.wait_for_load_state("networkidle")
    secret = page.locator("#new-token").input_value()
    token = ApiToken.objects.get(project=team.project, name="github-ci")
    assert secret.startswith(f"fb_{token.prefix}_") and len(secret) > 40
    assert page.locator("#new-token").is_visible()
    screenshot(page, "token_created")

    page.reload()
    page.wait_for_load_state("networkidle")
    assert page.locator("#new-token").count() == 0 and secret not in page.content(), "the secret is shown once"
    row = page.locator("tr", has_text="github-ci")
    assert "active" in row.inner_text() and f"fb_{token.prefix}_" in row.inner_text()

    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Revoke").click()
    page.wait_for_load_state("networkidle")
    assert "revoked" in page.locator("tr", has_text="github-ci").inner_text()
    token.refresh_from_db()
    assert token.revoked_at is not None


