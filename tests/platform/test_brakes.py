"""Brakes that stop guessing without locking out the innocent: failed logins per account and per address, bad
bearer tokens per token prefix, and X-Forwarded-For trusted only from configured proxies."""

from __future__ import annotations

import ipaddress

import httpx
import pytest
from django.core.cache import cache
from django.test import Client, RequestFactory

from forgeboard.accounts.services import api_token_create
from forgeboard.api.ratelimit import client_address
from tests.support.processes import free_port, web_server


@pytest.fixture(autouse=True)
def fresh_counters(db):
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def brakes(settings):
    settings.LOGIN_FAILURES_PER_ACCOUNT = 10
    settings.LOGIN_FAILURES_PER_ADDRESS = 50
    settings.API_AUTH_FAILURES_PER_MINUTE = 5
    settings.TRUSTED_PROXIES = []
    return settings


def log_in(client: Client, username: str, password: str, **headers: str):
    return client.post("/login/", {"username": username, "password": password}, **headers)


def test_an_account_under_attack_is_refused_but_others_from_the_same_address_log_in(team, brakes):
    codes = [log_in(Client(), "olivia", f"guess-{i}").status_code for i in range(30)]
    assert codes == [200] * 10 + [429] * 20
    victim = Client()
    refused = log_in(victim, "olivia", "pw-olivia-1")
    assert refused.status_code == 429 and "Too many failed logins for this account" in refused.content.decode()
    assert victim.get("/").status_code == 302, "the right password does not get through the brake"
    assert log_in(Client(), "OLIVIA ", "pw-olivia-1").status_code == 429, "one count per account, however spelt"

    colleague = Client()
    assert log_in(colleague, "mateo", "pw-mateo-1").status_code == 302
    assert colleague.get("/").status_code == 200

    cache.clear()  # the window ends
    assert log_in(victim, "olivia", "pw-olivia-1").status_code == 302


def test_one_address_failing_on_many_accounts_is_refused(team, brakes):
    brakes.LOGIN_FAILURES_PER_ADDRESS = 12
    codes = [log_in(Client(), f"nobody-{i}", "x").status_code for i in range(14)]
    assert codes == [200] * 12 + [429] * 2
    refused = log_in(Client(), "mateo", "pw-mateo-1")
    assert refused.status_code == 429 and "from your address" in refused.content.decode()
    elsewhere = log_in(Client(REMOTE_ADDR="192.0.2.7"), "mateo", "pw-mateo-1")
    assert elsewhere.status_code == 302


def test_bad_tokens_never_block_a_valid_api_token_or_run_token(client, team, running_run, brakes):
    run, run_token = running_run
    _, valid = api_token_create(actor=team.member, project=team.project, name="ci", scope="read")
    prefix = valid.split("_")[1]
    attempts = ["garbage", "Bearer x", f"fb_{prefix}_wrong-secret", "fbr_123_nope", f"fbr_{'a' * 12}_nope"]
    codes = []
    for i in range(30):
        bad = attempts[i % len(attempts)]
        codes.append(client.get("/api/v1/projects", HTTP_AUTHORIZATION=f"Bearer {bad}").status_code)
        codes.append(client.get(f"/api/v1/controller/runs/{run.pk}/commands",
                                HTTP_AUTHORIZATION=f"Bearer {bad}").status_code)
    assert 429 in codes and set(codes) == {401, 429}
    ok = client.get("/api/v1/projects", HTTP_AUTHORIZATION=f"Bearer {valid}")
    assert ok.status_code == 200 and [p["slug"] for p in ok.json()["items"]] == ["alpha"]
    commands = client.get(f"/api/v1/controller/runs/{run.pk}/commands", HTTP_AUTHORIZATION=f"Bearer {run_token}")
    assert commands.status_code == 200, commands.content

    limited = client.get("/api/v1/projects", HTTP_AUTHORIZATION=f"Bearer fb_{prefix}_wrong-secret")
    assert limited.status_code == 429 and limited.json()["code"] == "rate_limited"
    other = client.get("/api/v1/projects", HTTP_AUTHORIZATION=f"Bearer fb_{'0' * 12}_wrong")
    assert other.status_code == 401, "another token's failures are counted apart"


def test_x_forwarded_for_is_used_only_from_a_trusted_proxy(settings):
    factory = RequestFactory()
    settings.TRUSTED_PROXIES = []
    spoofed = factory.get("/", REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="198.51.100.9")
    assert client_address(spoofed) == "127.0.0.1"
    settings.TRUSTED_PROXIES = [ipaddress.ip_network("10.0.0.0/8")]
    assert client_address(factory.get("/", REMOTE_ADDR="203.0.113.4", HTTP_X_FORWARDED_FOR="198.51.100.9")) \
        == "203.0.113.4", "an untrusted peer's header is ignored"
    via_two = factory.get("/", REMOTE_ADDR="10.1.2.3", HTTP_X_FORWARDED_FOR="6.6.6.6, 198.51.100.9, 10.0.0.5")
    assert client_address(via_two) == "198.51.100.9", "the nearest hop that is not a trusted proxy"
    assert client_address(factory.get("/", REMOTE_ADDR="10.1.2.3")) == "10.1.2.3"
    junk = factory.get("/", REMOTE_ADDR="10.1.2.3", HTTP_X_FORWARDED_FOR="not-an-address")
    assert client_address(junk) == "10.1.2.3"


def test_login_brake_counts_the_forwarded_address_only_behind_a_trusted_proxy(team, brakes):
    brakes.LOGIN_FAILURES_PER_ADDRESS = 3
    for i in range(3):
        log_in(Client(), f"nobody-{i}", "x", HTTP_X_FORWARDED_FOR=f"198.51.100.{i}")
    assert log_in(Client(), "mateo", "pw-mateo-1", HTTP_X_FORWARDED_FOR="198.51.100.200").status_code == 429, \
        "a header from an untrusted peer does not dodge the brake"

    cache.clear()
    brakes.TRUSTED_PROXIES = [ipaddress.ip_network("127.0.0.1/32")]
    for i in range(3):
        log_in(Client(), f"nobody-{i}", "x", HTTP_X_FORWARDED_FOR="198.51.100.1")
    assert log_in(Client(), "mateo", "pw-mateo-1", HTTP_X_FORWARDED_FOR="198.51.100.1").status_code == 429
    assert log_in(Client(), "mateo", "pw-mateo-1", HTTP_X_FORWARDED_FOR="198.51.100.2").status_code == 302, \
        "behind a trusted proxy each client is counted apart"


@pytest.mark.slow
def test_the_web_server_does_not_take_x_forwarded_for_from_localhost(transactional_db, tmp_path):
    """uvicorn (`forgeboard serve`'s argv) leaves the header to the settings: spoofing it from 127.0.0.1 is ignored."""
    port = free_port()
    with web_server(tmp_path / "web.log", port=port, FORGEBOARD_LOGIN_FAILURES_PER_ADDRESS="3",
                    FORGEBOARD_LOGIN_FAILURES_PER_ACCOUNT="100"):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            http.get("/login/")
            codes = []
            for i in range(5):
                codes.append(http.post("/login/", data={
                    "username": f"nobody-{i}", "password": "x", "csrfmiddlewaretoken": http.cookies["csrftoken"]},
                    headers={"X-Forwarded-For": f"198.51.100.{i}"}).status_code)
    assert codes == [200, 200, 200, 429, 429]


def test_the_admin_login_is_braked_too(team, brakes):
    from forgeboard.accounts.models import User

    User.objects.create_superuser("root", password="pw-root-1")
    for i in range(10):
        assert Client().post("/admin/login/", {"username": "root", "password": f"guess-{i}"}).status_code == 200
    admin = Client()
    admin.post("/admin/login/", {"username": "root", "password": "pw-root-1"})
    assert admin.get("/admin/").status_code == 302, "the right password does not get through the brake"
    assert log_in(Client(), "root", "pw-root-1").status_code == 429, "one count for both forms"


def test_hostile_credentials_get_a_refusal_not_a_500(client, team, running_run):
    run, _ = running_run
    for bad in ["fb_\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00_x", "fb_ééééééééééé é_x", "fbr_\x00" + "a" * 11 + "_x"]:
        assert client.get("/api/v1/projects", HTTP_AUTHORIZATION=f"Bearer {bad}").status_code == 401
        assert client.get(f"/api/v1/controller/runs/{run.pk}/commands",
                          HTTP_AUTHORIZATION=f"Bearer {bad}").status_code == 401
    assert log_in(Client(), "oli\x00via", "pw").status_code == 200
    assert log_in(Client(), "olivia", "pw\x00").status_code == 200
