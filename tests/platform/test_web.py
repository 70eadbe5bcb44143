"""Pages: login, the project list, and a project page only its members can see."""

from __future__ import annotations

import pytest


def test_login_page_renders(client, db):
    response = client.get("/login/")
    assert response.status_code == 200
    assert b"Log in" in response.content and b'name="password"' in response.content


def test_pages_need_login(client, db):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_login_then_see_own_projects(client, team):
    response = client.post("/login/", {"username": "vera", "password": "pw-vera-1"})
    assert response.status_code == 302
    home = client.get("/")
    assert b"Alpha" in home.content
    page = client.get("/p/alpha/")
    assert page.status_code == 200 and b"you are viewer" in page.content and b"math" in page.content


def test_wrong_password_shows_an_error(client, team):
    response = client.post("/login/", {"username": "vera", "password": "wrong"})
    assert response.status_code == 200 and b"didn't match" in response.content


@pytest.mark.parametrize("slug", ["alpha", "no-such-project"])
def test_outsider_gets_not_found(client, team, slug):
    client.force_login(team.outsider)
    assert client.get(f"/p/{slug}/").status_code == 404


def test_seed_demo_is_idempotent(db):
    from django.core.management import call_command

    from forgeboard.accounts.models import Project, User
    from forgeboard.experiments.models import Experiment

    call_command("seed_demo")
    call_command("seed_demo")
    assert User.objects.filter(username="demo").count() == 1
    assert Project.objects.get(slug="demo").experiments.count() == 2
    assert set(Experiment.objects.values_list("recipe", flat=True)) == {"sft", "grpo"}


def test_the_home_page_is_only_read(client, team):
    client.force_login(team.member)
    assert client.post("/").status_code == 405
    assert client.get("/").status_code == 200
