"""A second copy of a write (a retried launch, a double-clicked form) creates nothing and gets the first answer."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import httpx
import pytest
from django.db import connections
from django.utils import timezone

from forgeboard.accounts.models import ApiToken, Role
from forgeboard.accounts.services import (
    api_token_create,
    api_token_revoke,
    membership_remove,
    membership_set,
    project_create,
)
from forgeboard.audit.models import AuditEvent
from forgeboard.experiments.models import Experiment
from forgeboard.idempotency.models import IdempotentRequest
from forgeboard.regressions.models import SuiteRun
from forgeboard.regressions.services import suite_create
from forgeboard.runs.models import Command, Run

KEY = "0b6f3c1e-3f7e-4f0e-9a55-5a1c2d3e4f50"


@pytest.fixture
def tokens(team):
    _, write = api_token_create(actor=team.member, project=team.project, name="ci-write", scope="write")
    _, second = api_token_create(actor=team.member, project=team.project, name="ci-second", scope="write")
    _, read = api_token_create(actor=team.member, project=team.project, name="ci-read", scope="read")
    other = project_create(actor=team.outsider, slug="beta", name="Beta")
    _, foreign = api_token_create(actor=team.outsider, project=other, name="beta-ci", scope="write")
    return {"write": write, "second": second, "read": read, "foreign": foreign}


def post(client, path: str, token: str, body: dict | str | None = None, key: str | None = KEY):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} | ({"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {})
    data = body if isinstance(body, str) else json.dumps(body or {})
    return client.post(f"/api/v1{path}", data=data, content_type="application/json", **headers)


def launch(client, team, token, body=None, key=KEY):
    return post(client, f"/experiments/{team.experiment.pk}/runs", token, body, key)


def test_a_retried_launch_creates_one_run_and_gets_the_first_answer(client, team, tokens, grpo_yaml):
    body = {"config_yaml": grpo_yaml, "overrides": ["trainer.steps=9"], "priority": 5}
    first = launch(client, team, tokens["write"], body)
    again = launch(client, team, tokens["write"], body)
    assert first.status_code == again.status_code == 201, again.content
    assert "Idempotent-Replayed" not in first and again["Idempotent-Replayed"] == "true"
    assert again.json() == first.json() and again["Content-Type"] == first["Content-Type"]
    assert Run.objects.count() == 1
    assert AuditEvent.objects.filter(action="run.launch").count() == 1
    # The same body written another way (key order, spacing) is the same request.
    reordered = '{"priority": 5,  "overrides": ["trainer.steps=9"], "config_yaml": ' + json.dumps(grpo_yaml) + "}"
    assert launch(client, team, tokens["write"], reordered)["Idempotent-Replayed"] == "true"
    # Without a key, or with a new one, a launch is a new run.
    assert launch(client, team, tokens["write"], body, key=None).json()["number"] == 2
    assert launch(client, team, tokens["write"], body, key="another-key").json()["number"] == 3


def test_the_key_with_another_body_is_refused_and_creates_nothing(client, team, tokens, grpo_yaml):
    assert launch(client, team, tokens["write"], {"config_yaml": grpo_yaml}).status_code == 201
    other = launch(client, team, tokens["write"], {"config_yaml": grpo_yaml, "priority": 3})
    assert other.status_code == 422, other.content
    assert other.json()["code"] == "idempotency_key_reused"
    assert [e["field"] for e in other.json()["errors"]] == ["Idempotency-Key"]
    elsewhere = post(client, "/projects/alpha/experiments", tokens["write"], {"name": "x", "recipe": "sft"})
    assert elsewhere.status_code == 422
    assert Run.objects.count() == 1 and not Experiment.objects.filter(name="x").exists()


def test_a_refused_request_keeps_nothing_so_the_key_can_be_sent_again_fixed(client, team, tokens, grpo_yaml):
    bad = launch(client, team, tokens["write"], {"config_yaml": grpo_yaml.replace("steps: 5", "steps: 0")})
    assert bad.status_code == 400 and "config.trainer.steps" in [e["field"] for e in bad.json()["errors"]]
    assert not IdempotentRequest.objects.exists()
    fixed = launch(client, team, tokens["write"], {"config_yaml": grpo_yaml})
    assert fixed.status_code == 201 and "Idempotent-Replayed" not in fixed
    assert Run.objects.count() == 1 and IdempotentRequest.objects.count() == 1
    # A read-only token's refused write claims nothing either.
    assert launch(client, team, tokens["read"], {"config_yaml": grpo_yaml}, key="read-key").status_code == 403
    assert not IdempotentRequest.objects.filter(key="read-key").exists()


def test_keys_belong_to_their_credential(client, team, tokens, grpo_yaml):
    """Another token never gets this token's answer: with the same key it is its own request."""
    body = {"config_yaml": grpo_yaml}
    mine = launch(client, team, tokens["write"], body)
    theirs = launch(client, team, tokens["second"], body)
    assert theirs.status_code == 201 and "Idempotent-Replayed" not in theirs
    assert theirs.json()["id"] != mine.json()["id"]
    foreign = launch(client, team, tokens["foreign"], body)
    assert foreign.status_code == 404 and foreign.json()["code"] == "not_found" and "Idempotent-Replayed" not in foreign
    # A browser session is its own key space too.
    client.force_login(team.member)
    session = client.post(f"/api/v1/experiments/{team.experiment.pk}/runs", data=json.dumps(body),
                          content_type="application/json", HTTP_IDEMPOTENCY_KEY=KEY)
    assert session.status_code == 201 and "Idempotent-Replayed" not in session
    assert Run.objects.count() == 3
    # A revoked token's copy is refused like any request of it, not answered from what it once got.
    api_token_revoke(actor=team.member, token=ApiToken.objects.get(name="ci-write"))
    revoked = launch(client, team, tokens["write"], body)
    assert revoked.status_code == 401 and "Idempotent-Replayed" not in revoked


def test_a_copy_is_answered_only_while_its_sender_may_still_send_it(client, team, grpo_yaml):
    """A member removed since (or made a viewer) gets the refusal the request would get now, not the answer they
    once had: the replay would show them a run of a project they no longer belong to."""
    client.force_login(team.member)
    body = json.dumps({"config_yaml": grpo_yaml})
    path = f"/api/v1/experiments/{team.experiment.pk}/runs"
    assert client.post(path, data=body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=KEY).status_code == 201
    form = client.post("/p/alpha/launch/", _form(team, grpo_yaml))
    assert form.status_code == 302

    membership_set(actor=team.owner, project=team.project, user=team.member, role=Role.VIEWER)
    demoted = client.post(path, data=body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=KEY)
    assert demoted.status_code == 403 and "Idempotent-Replayed" not in demoted, demoted.content
    assert "needs the member role; you are a viewer" in demoted.json()["message"]

    membership_remove(actor=team.owner, project=team.project, user=team.member)
    removed = client.post(path, data=body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=KEY)
    assert removed.status_code == 404 and removed.json() == {"code": "not_found", "message": (
        f"no experiment {team.experiment.pk}"), "errors": []}, removed.content
    again = client.post("/p/alpha/launch/", _form(team, grpo_yaml))
    assert again.status_code == 404 and "Idempotent-Replayed" not in again
    assert Run.objects.count() == 2 and IdempotentRequest.objects.count() == 2  # kept, answered to nobody

    membership_set(actor=team.owner, project=team.project, user=team.member, role=Role.MEMBER)
    back = client.post(path, data=body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=KEY)
    assert back.status_code == 201 and back["Idempotent-Replayed"] == "true" and Run.objects.count() == 2


def test_every_keyed_url_names_the_project_a_replay_is_checked_against(client):
    from django.urls import get_resolver

    from forgeboard.api.idempotent import IDEMPOTENCY_NOTE
    from forgeboard.idempotency.services import project_in_path
    from forgeboard.web.idempotent import idempotent_form

    def wraps_a_keyed_form(view) -> bool:  # functools.wraps copies the name: the code object keeps its own
        while view is not None and getattr(view, "__code__", None) is not keyed_form_code:
            view = getattr(view, "__wrapped__", None)
        return view is not None

    keyed_form_code = idempotent_form(lambda request: None).__code__

    names = {"slug", "experiment_id", "run_id"}
    pages = [p for p in _url_patterns(get_resolver()) if wraps_a_keyed_form(p.callback)]
    assert len(pages) == 4 and all(names & set(p.pattern.regex.groupindex) for p in pages), pages
    schema = client.get("/api/v1/openapi.json").json()
    keyed = {path: {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
             for path, ops in schema["paths"].items() for op in ops.values()
             if IDEMPOTENCY_NOTE in op.get("description", "")}
    assert len(keyed) == 6 and all(names & params for params in keyed.values()), keyed
    with pytest.raises(LookupError):
        project_in_path(actor=None, path={"step": 3})


def _url_patterns(resolver):
    for pattern in resolver.url_patterns:
        if hasattr(pattern, "url_patterns"):
            yield from _url_patterns(pattern)
        else:
            yield pattern


def test_a_json_body_labelled_as_a_form_is_compared_as_the_api_reads_it(client, team, tokens, grpo_yaml):
    """`curl -d` labels its body a form; the API reads it as JSON all the same, and so does the key's comparison. Read
    as form fields, `+` and a space were one character: another config with the same key got the first one's run."""
    def send(config_yaml: str):
        return client.post(f"/api/v1/experiments/{team.experiment.pk}/runs",
                           data=json.dumps({"config_yaml": config_yaml}),
                           content_type="application/x-www-form-urlencoded", HTTP_IDEMPOTENCY_KEY=KEY,
                           HTTP_AUTHORIZATION=f"Bearer {tokens['write']}")

    assert send(grpo_yaml + "# lr 1e+3\n").status_code == 201
    other = send(grpo_yaml + "# lr 1e 3\n")
    assert other.status_code == 422 and other.json()["code"] == "idempotency_key_reused", other.content
    assert send(grpo_yaml + "# lr 1e+3\n")["Idempotent-Replayed"] == "true"
    assert Run.objects.count() == 1


@pytest.mark.parametrize("key", ["", " ", "k" * 201, "ключ", "a b", "tab\there", "nul\x00"])
def test_a_malformed_key_is_refused_at_its_field(client, team, tokens, grpo_yaml, key):
    response = launch(client, team, tokens["write"], {"config_yaml": grpo_yaml}, key=key)
    assert response.status_code == 400, response.content
    assert [e["field"] for e in response.json()["errors"]] == ["Idempotency-Key"]
    assert not Run.objects.exists() and not IdempotentRequest.objects.exists()


def test_a_key_older_than_a_day_is_forgotten(client, team, tokens, grpo_yaml):
    assert launch(client, team, tokens["write"], {"config_yaml": grpo_yaml}).status_code == 201
    IdempotentRequest.objects.update(created_at=IdempotentRequest.objects.get().created_at - timedelta(hours=25))
    later = launch(client, team, tokens["write"], {"config_yaml": grpo_yaml})
    assert later.status_code == 201 and "Idempotent-Replayed" not in later
    assert Run.objects.count() == 2 and IdempotentRequest.objects.count() == 1


def test_the_hourly_purge_forgets_every_owners_expired_keys(client, team, tokens, grpo_yaml, settings):
    from workers.tasks import purge_idempotency_keys

    for token in ("write", "second"):
        assert launch(client, team, tokens[token], {"config_yaml": grpo_yaml}).status_code == 201
    assert launch(client, team, tokens["write"], {"config_yaml": grpo_yaml}, key="fresh").status_code == 201
    IdempotentRequest.objects.exclude(key="fresh").update(created_at=timezone.now() - timedelta(hours=25))
    assert purge_idempotency_keys.apply().get() == 2
    assert list(IdempotentRequest.objects.values_list("key", flat=True)) == ["fresh"]
    assert settings.CELERY_BEAT_SCHEDULE["purge-idempotency-keys"]["task"] == purge_idempotency_keys.name


def test_commands_experiments_and_suites_are_created_once(client, team, tokens, grpo_yaml, running_run):
    run, _ = running_run
    for _ in range(2):
        assert post(client, f"/runs/{run.pk}/commands", tokens["write"], {"kind": "pause"}).status_code == 201
        made = post(client, "/projects/alpha/experiments", tokens["write"], {"name": "again", "recipe": "sft"},
                    key="experiment-key")
        assert made.status_code == 201
    assert Command.objects.filter(run=run, kind="pause").count() == 1
    assert Experiment.objects.filter(name="again").count() == 1
    spec = {"stages": [{"name": "one", "experiment_id": team.experiment.pk, "config_yaml": grpo_yaml,
                        "checks": [{"name": "r", "metric": "eval/reward_mean", "direction": "higher_is_better"}]}]}
    suite_create(actor=team.member, project=team.project, name="smoke", spec=spec)
    answers = [post(client, "/projects/alpha/suites/smoke/runs", tokens["write"], key="suite-key") for _ in range(2)]
    assert [a.status_code for a in answers] == [202, 202] and answers[0].json() == answers[1].json()
    assert SuiteRun.objects.count() == 1


def test_the_openapi_document_says_which_operations_take_a_key(client):
    operations = client.get("/api/v1/openapi.json").json()["paths"]
    launch_op = operations["/api/v1/experiments/{experiment_id}/runs"]["post"]
    assert "Idempotency-Key" in launch_op["description"] and "422" in launch_op["responses"]
    assert "config_yaml" in launch_op["description"]  # the operation's own text is kept
    assert "422" not in operations["/api/v1/runs/{run_id}/cancel"]["post"]["responses"]


# --- the launch form ----------------------------------------------------------------------------------------------

def _form(team, grpo_yaml, **fields) -> dict:
    return {"experiment": str(team.experiment.pk), "config_yaml": grpo_yaml, "overrides": "", "priority": "0",
            "idempotency_key": "form-key-1"} | fields


def test_a_double_submitted_launch_form_launches_once_and_lands_on_the_run(client, team, grpo_yaml):
    client.force_login(team.member)
    page = client.get("/p/alpha/launch/").content.decode()
    assert page.count('name="idempotency_key"') >= 1
    first = client.post("/p/alpha/launch/", _form(team, grpo_yaml))
    again = client.post("/p/alpha/launch/", _form(team, grpo_yaml), follow=True)
    run = Run.objects.get()
    assert first.status_code == 302 and first["Location"] == f"/runs/{run.pk}/"
    assert again.redirect_chain == [(f"/runs/{run.pk}/", 302)]
    assert "already sent" in again.content.decode()
    # The page brought back and changed is a new launch, not a refusal.
    edited = client.post("/p/alpha/launch/", _form(team, grpo_yaml, priority="4"))
    assert edited.status_code == 302 and Run.objects.count() == 2
    # Each render of the page has keys of its own.
    field = re.compile(r'name="idempotency_key" value="([0-9a-f]{32})"')
    keys = [field.findall(client.get("/p/alpha/launch/").content.decode()) for _ in range(2)]
    assert len(keys[0]) == 2 and not set(keys[0]) & set(keys[1]), keys


def test_a_refused_form_keeps_nothing(client, team, grpo_yaml):
    client.force_login(team.member)
    refused = client.post("/p/alpha/launch/", _form(team, grpo_yaml, config_yaml="recipe: [unclosed"))
    assert refused.status_code == 400 and not IdempotentRequest.objects.exists()
    malformed = client.post("/p/alpha/launch/", _form(team, grpo_yaml, idempotency_key="ключ"))
    assert malformed.status_code == 400
    assert "Idempotency-Key: must be 1 to 200 visible ASCII" in malformed.content.decode()
    client.force_login(team.viewer)
    assert client.post("/p/alpha/launch/", _form(team, grpo_yaml)).status_code == 403
    assert not IdempotentRequest.objects.exists() and not Run.objects.exists()


# --- two copies at once --------------------------------------------------------------------------------------------

def _sent_in_background(name: str, token: str, path: str, body: dict, answers: dict[str, httpx.Response], *,
                        key: str | None = None) -> threading.Thread:
    """POST through WSGI in a thread of its own (a connection of its own); its answer lands in answers[name]."""
    from forgeboard.wsgi import application

    def send() -> None:
        with httpx.Client(transport=httpx.WSGITransport(app=application), base_url="http://testserver") as http:
            headers = {"Authorization": f"Bearer {token}"} | ({"Idempotency-Key": key} if key else {})
            answers[name] = http.post(path, json=body, headers=headers)
        connections.close_all()

    thread = threading.Thread(target=send)
    thread.start()
    return thread


@pytest.mark.django_db(transaction=True)
def test_two_copies_sent_at_once_launch_one_run(team, tokens, grpo_yaml, monkeypatch, wsgi_in_process):
    """The second copy waits for the first to commit (on the claim's unique key; on SQLite, for the one writer's
    lock), then gets its answer."""
    from forgeboard.api import public

    original = public.run_launch

    def slow_launch(**kwargs):
        run = original(**kwargs)
        time.sleep(0.5)  # the first copy holds its claim while the second arrives
        return run

    monkeypatch.setattr(public, "run_launch", slow_launch)
    answered: dict[str, httpx.Response] = {}
    threads = []
    for copy in ("first", "second"):
        threads.append(_sent_in_background(copy, tokens["write"], f"/api/v1/experiments/{team.experiment.pk}/runs",
                                           {"config_yaml": grpo_yaml}, answered, key=KEY))
        time.sleep(0.1)
    for thread in threads:
        thread.join(timeout=30)
    answers = list(answered.values())
    assert [a.status_code for a in answers] == [201, 201], [a.text for a in answers]
    assert answers[0].json()["id"] == answers[1].json()["id"]
    assert sorted(a.headers.get("Idempotent-Replayed", "no") for a in answers) == ["no", "true"]
    assert Run.objects.count() == 1


def test_a_refused_keyed_request_still_counts_against_the_tokens_budget(client, team, tokens, settings):
    """What a refusal rolls back is what its key claimed: the embedded default counts requests in the database,
    and a key with a bad body was never counted there, so it was never slowed either."""
    from django.core.cache import cache

    cache.clear()
    settings.API_RATE_PER_MINUTE = 3
    codes = [launch(client, team, tokens["write"], {"config_yaml": "recipe: [unclosed"}, key=f"k{i}").status_code
             for i in range(5)]
    assert codes == [400, 400, 400, 429, 429]
    assert not IdempotentRequest.objects.exists()
    cache.clear()


def _answered_while_the_first_waits(monkeypatch, paused: tuple[object, str], first: Callable[[], threading.Thread],
                                    second: Callable[[], threading.Thread]) -> bool:
    """Whether `second`'s request is answered while `first`'s waits in `paused` (a module, and the function of it that
    its view calls)."""
    called, release = threading.Event(), threading.Event()
    module, name = paused
    original = getattr(module, name)

    def waiting(**kwargs):
        if not called.is_set():
            called.set()
            release.wait(timeout=30)
        return original(**kwargs)

    monkeypatch.setattr(module, name, waiting)
    threads = [first()]
    assert called.wait(timeout=10)
    threads.append(second())
    threads[1].join(timeout=8)
    answered = not threads[1].is_alive()
    release.set()
    for thread in threads:
        thread.join(timeout=30)
    return answered


@pytest.mark.django_db(transaction=True)
def test_a_key_on_an_operation_that_takes_none_holds_nothing_while_it_runs(team, tokens, grpo_yaml, monkeypatch,
                                                                           wsgi_in_process):
    """/configs/validate takes no key: sent with one, a slow check runs as it would without, and the token's next
    request does not wait for it (a transaction around it held the token's row on Postgres and the database's
    write lock on SQLite until the check was done)."""
    from forgeboard.api import configs

    answers: dict[str, httpx.Response] = {}
    check, runs = "/api/v1/configs/validate", f"/api/v1/experiments/{team.experiment.pk}/runs"
    assert _answered_while_the_first_waits(
        monkeypatch, (configs, "config_problems"),
        lambda: _sent_in_background(check, tokens["write"], check, {"recipe": "grpo", "yaml": grpo_yaml}, answers,
                                    key=KEY),
        lambda: _sent_in_background(runs, tokens["write"], runs, {"config_yaml": grpo_yaml}, answers))
    assert answers[runs].status_code == 201 and answers[check].json() == {"ok": True, "errors": []}
    assert not IdempotentRequest.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_tokens_expired_key_does_not_make_its_launches_wait_for_each_other(team, tokens, grpo_yaml, monkeypatch,
                                                                             wsgi_in_process):
    """Each claim forgot every expired key of its token, so until the hourly purge every keyed launch of the token
    waited on the first one's lock of those rows, for its whole launch; now a claim forgets only its own key's."""
    from forgeboard.api import public

    if connections["default"].vendor != "postgresql":
        pytest.skip("SQLite has one writer: a claim holds the database's write lock until its answer is recorded")
    token = ApiToken.objects.get(name="ci-write")
    IdempotentRequest.objects.create(owner=f"token:{token.pk}", key="yesterday", fingerprint="0" * 64, status_code=201)
    IdempotentRequest.objects.update(created_at=timezone.now() - timedelta(hours=25))
    answers: dict[str, httpx.Response] = {}
    runs = f"/api/v1/experiments/{team.experiment.pk}/runs"
    assert _answered_while_the_first_waits(
        monkeypatch, (public, "run_launch"),
        lambda: _sent_in_background("first", tokens["write"], runs, {"config_yaml": grpo_yaml}, answers, key="first"),
        lambda: _sent_in_background("second", tokens["write"], runs, {"config_yaml": grpo_yaml, "priority": 1},
                                    answers, key="second"))
    assert Run.objects.count() == 2


# --- the client ---------------------------------------------------------------------------------------------------

def test_the_client_retries_a_lost_launch_with_the_same_key(team, tokens, grpo_yaml, wsgi_in_process, monkeypatch):
    """The answer to the first try is lost on the way back: the retry gets it, and one run exists."""
    from forgeboard.wsgi import application
    from forgeboard_client import client as client_module

    monkeypatch.setattr(client_module, "RETRY_PAUSES_S", (0.0, 0.0))
    server = httpx.WSGITransport(app=application)
    seen: list[str] = []

    class LosesTheFirstAnswer(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(request.headers.get("Idempotency-Key", ""))
            response = server.handle_request(request)
            if len(seen) == 1:
                raise httpx.ReadError("connection reset", request=request)
            return response

    api = client_module.ForgeboardClient("http://testserver", tokens["write"], transport=LosesTheFirstAnswer())
    run = api.launch_run(team.experiment.pk, grpo_yaml)
    assert len(seen) == 2 and seen[0] == seen[1] and len(seen[0]) == 36
    assert Run.objects.count() == 1 and run["id"] == Run.objects.get().pk
    api.launch_run(team.experiment.pk, grpo_yaml)  # a new call is a new key: a new run
    assert len(set(seen)) == 2 and Run.objects.count() == 2


def test_a_claim_that_loses_to_a_copy_forgotten_meanwhile_is_asked_to_retry(db, monkeypatch):
    """The copy whose claim this one collided with is gone by the time it looks (the hourly purge): a 409 that a
    retry settles, not a 500."""
    from django.db import IntegrityError

    from forgeboard.errors import Conflict
    from forgeboard.idempotency import services

    def collide(**_):
        raise IntegrityError("duplicate key value violates unique constraint")

    monkeypatch.setattr(services.IdempotentRequest.objects, "create", collide)
    with pytest.raises(Conflict, match="send it again shortly"):
        services.idempotent_claim(owner="token:1", key=KEY, fingerprint="f" * 64)


def test_the_client_sends_a_write_again_after_a_gateways_503_and_a_read_once(team, tokens, grpo_yaml,
                                                                              wsgi_in_process, monkeypatch):
    """A proxy that lost the server answers 503: the launch may or may not have happened, so it is sent again with
    its key; a read carries no key and is not sent again."""
    from forgeboard.wsgi import application
    from forgeboard_client import client as client_module

    monkeypatch.setattr(client_module, "RETRY_PAUSES_S", (0.0, 0.0))
    server = httpx.WSGITransport(app=application)
    seen: list[tuple[str, str]] = []

    class GatewayFailsFirst(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            seen.append((request.method, request.headers.get("Idempotency-Key", "")))
            answer = server.handle_request(request)
            return httpx.Response(503, text="upstream lost") if len(seen) in (1, 3) else answer

    api = client_module.ForgeboardClient("http://testserver", tokens["write"], transport=GatewayFailsFirst())
    run = api.launch_run(team.experiment.pk, grpo_yaml)
    assert [method for method, _ in seen] == ["POST", "POST"] and seen[0][1] == seen[1][1] != ""
    assert Run.objects.count() == 1 and run["id"] == Run.objects.get().pk
    with pytest.raises(client_module.ApiError) as failed:
        api.run(run["id"])
    assert failed.value.status == 503 and seen[2] == ("GET", "") and len(seen) == 3
