"""The runs list (filters, key metrics), the run page for each role, and its form fallbacks and members page."""

from __future__ import annotations

import json

import pytest

from forgeboard.accounts.models import Membership
from forgeboard.errors import ValidationFailed
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Command, Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import MetricSeries
from forgeboard.web.views.runs import form_payload


@pytest.fixture
def runs(team, grpo_yaml):
    tagged = experiment_create(actor=team.owner, project=team.project, name="long-context", recipe="grpo", tags=["nightly"])
    first = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    second = run_launch(actor=team.owner, experiment=tagged, config_yaml=grpo_yaml)
    Run.objects.filter(pk=second.pk).update(state=RunState.FAILED)
    MetricSeries.objects.create(run=first, key="reward/mean", point_count=1, first_step=1, last_step=1, last_value=0.625)
    return first, second


def _run_ids(response) -> list[int]:
    return [row["run"].pk for row in response.context["rows"]]


@pytest.mark.parametrize(("query", "expected"), [
    ("", {0, 1}), ("?state=failed", {1}), ("?tag=nightly", {1}), ("?q=long", {1}), ("?q=mateo", {0}),
    ("?q=%232", set()), ("?user=olivia", {1}), ("?state=bogus", {0, 1}), ("?experiment=99999999999999999999", {0, 1}),
])
def test_the_runs_list_filters(client, team, runs, query, expected):
    client.force_login(team.viewer)
    response = client.get(f"/p/alpha/{query}")
    assert response.status_code == 200
    assert set(_run_ids(response)) == {runs[i].pk for i in expected}


def test_the_runs_list_shows_key_metrics_and_compare_boxes(client, team, runs):
    client.force_login(team.viewer)
    page = client.get("/p/alpha/").content.decode()
    assert "0.625" in page and f'name="runs" value="{runs[0].pk}"' in page
    assert "Launch a run" not in page  # viewers cannot launch


def test_the_run_page_for_a_member_has_controls_and_for_a_viewer_none(client, team, runs):
    run = runs[0]
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    client.force_login(team.member)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="controls"' in page and "Cancel run" in page and "recipe: grpo" in page
    client.force_login(team.viewer)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="controls"' not in page and "Cancel run" not in page and "recipe: grpo" in page


def _shown(page: str, element_id: str) -> str | None:
    """Whether the element with this id is on the page and shown, or put away (rendered hidden); None if absent."""
    start = page.find(f'id="{element_id}"')
    if start < 0:
        return None
    return "put away" if " hidden" in page[start:page.index(">", start)] else "shown"


@pytest.mark.parametrize(("state", "cancel", "commands"), [
    ("queued", "shown", "put away"), ("running", "shown", "shown"), ("cancelling", "put away", "put away"),
    ("lost", "put away", "put away"), ("failed", None, None), ("succeeded", None, None)])
def test_the_run_page_offers_the_actions_its_state_allows(client, team, runs, state, cancel, commands):
    """A run that has not ended has its actions on the page, put away in the states that refuse them (the page's
    script shows and hides them as the state changes); an ended run has none, and its rollouts stop polling."""
    run = runs[0]
    Run.objects.filter(pk=run.pk).update(state=state, exit_reason="engine exited with code 1" if state == "failed" else "")
    client.force_login(team.member)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert (_shown(page, "cancel-run"), _shown(page, "controls-forms")) == (cancel, commands)
    assert _shown(page, "exit-reason") == ("shown" if state == "failed" else "put away")
    rollouts = client.get(f"/runs/{run.pk}/rollouts/")
    assert rollouts.status_code == (286 if state in ("failed", "succeeded") else 200), "htmx stops polling at 286"


@pytest.mark.parametrize(("state", "reason", "label"), [
    ("queued", "restart 1 of 2: engine killed by signal 9", "Last restart"),
    ("running", "restart 1 of 2: engine killed by signal 9", "Last restart"),
    ("lost", "no heartbeat for 120 s", "Lost"),
    ("failed", "lost (no heartbeat for 120 s) after 2 of 2 restarts", "Exit reason"),
    ("succeeded", "finished", "Exit reason")])
def test_the_run_page_says_what_its_reason_is_in_each_state(client, team, runs, state, reason, label):
    """A restarted run keeps its restart's reason while it runs again: that is no exit reason until it ends."""
    run = runs[0]
    Run.objects.filter(pk=run.pk).update(state=state, exit_reason=reason)
    client.force_login(team.member)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert f'<strong id="exit-reason-label">{label}:</strong> <span id="exit-reason-text">{reason}</span>' in page


def test_the_commands_table_shows_payloads_and_results_as_json_text(client, team, runs):
    """As the page's script writes the rows it adds live: compact JSON, escaped, an empty result as nothing."""
    run = runs[0]
    done = Command.objects.create(run=run, kind="checkpoint", state="failed", created_by=team.owner,
                                  payload={"note": "<script>alert(1)</script>"}, result={"error": "a \"quoted\" <b>"})
    pending = Command.objects.create(run=run, kind="pause", created_by=None)
    client.force_login(team.viewer)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert "<script>alert(1)" not in page
    assert (f'<tr data-command="{done.pk}" data-state="failed"><td class="num">{done.pk}</td><td>Checkpoint now</td>'
            '<td>olivia</td><td data-field="state">Failed</td>'
            '<td data-field="payload"><code>{&quot;note&quot;:&quot;&lt;script&gt;alert(1)&lt;/script&gt;&quot;}</code></td>'
            '<td data-field="result"><code>{&quot;error&quot;:&quot;a \\&quot;quoted\\&quot; &lt;b&gt;&quot;}</code></td>'
            '</tr>') in page
    assert (f'<tr data-command="{pending.pk}" data-state="pending"><td class="num">{pending.pk}</td><td>Pause</td>'
            '<td>—</td><td data-field="state">Pending</td><td data-field="payload"><code>{}</code></td>'
            '<td data-field="result"><code></code></td></tr>') in page


def test_outsiders_get_404_for_runs_and_rollouts(client, team, runs):
    client.force_login(team.outsider)
    assert client.get(f"/runs/{runs[0].pk}/").status_code == 404
    assert client.get(f"/runs/{runs[0].pk}/rollouts/").status_code == 404
    assert client.get("/runs/99999999999999999999/").status_code == 404


def test_form_payload_nests_and_types_fields():
    fields = {"kind": "fault_drill", "payload.kind": "hang", "payload.replica": "1", "payload.duration_s": "2.5",
              "payload.schedule.at_step": "7", "payload.latency_ms": ""}
    assert form_payload(fields) == {"kind": "hang", "replica": 1, "duration_s": 2.5, "schedule": {"at_step": 7}}
    assert form_payload({"payload.replica": "1" + "0" * 5000}) == {"replica": "1" + "0" * 5000}, "text, not int()"


@pytest.mark.parametrize("fields", [{"payload.role": "generator", "payload.role.x": "1"},
                                    {"payload.role.x": "1", "payload.role": "generator"}])
def test_form_payload_refuses_a_field_that_is_both_a_value_and_a_section(fields):
    with pytest.raises(ValidationFailed) as caught:
        form_payload(fields)
    assert caught.value.problems[0].field == list(fields)[1] and "conflicts with" in caught.value.message


def test_the_command_form_answers_hostile_fields_with_their_reason(client, team, runs):
    run = runs[0]
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    client.force_login(team.member)
    for fields, reason in (({"payload.replica": "9" * 5000}, "payload.replica: Unable to parse input string"),
                           ({"payload.role": "generator", "payload.role.x": "1"},
                            "payload.role.x: conflicts with payload.role, which holds a value")):
        response = client.post(f"/runs/{run.pk}/commands/", {"kind": "fault_drill", "payload.kind": "kill", **fields},
                               follow=True)
        shown = [str(message) for message in response.context["messages"]]
        assert response.status_code == 200 and any(reason in message for message in shown), shown
        assert run.commands.count() == 0, fields


def test_the_command_form_fallback_stores_a_command_or_shows_the_reason(client, team, runs):
    run = runs[0]
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    client.force_login(team.member)
    response = client.post(f"/runs/{run.pk}/commands/", {"kind": "pause"}, follow=True)
    assert Command.objects.get(run=run).kind == "pause"
    assert "pause sent" in response.content.decode().lower()
    response = client.post(f"/runs/{run.pk}/commands/", {"kind": "fault_drill", "payload.kind": "kill",
                                                         "payload.role": "generator"}, follow=True)
    assert "needs placement.backend monarch" in response.content.decode()
    assert Command.objects.filter(run=run).count() == 1
    client.force_login(team.viewer)
    response = client.post(f"/runs/{run.pk}/commands/", {"kind": "pause"})
    assert response.status_code == 403 and Command.objects.filter(run=run).count() == 1


def test_cancel_from_the_page(client, team, runs):
    run = runs[0]
    client.force_login(team.viewer)
    assert client.post(f"/runs/{run.pk}/cancel/").status_code == 403
    client.force_login(team.member)
    client.post(f"/runs/{run.pk}/cancel/")
    assert Run.objects.get(pk=run.pk).state == RunState.CANCELLED
    response = client.post(f"/runs/{run.pk}/cancel/", follow=True)
    assert "already ended" in response.content.decode()


def test_starting_from_a_missing_checkpoint_explains(client, team, runs):
    client.force_login(team.member)
    response = client.post(f"/runs/{runs[0].pk}/checkpoints/40/launch/", follow=True)
    assert "no checkpoint at step 40" in response.content.decode()
    assert Run.objects.count() == 2


def test_owners_manage_members_and_others_cannot(client, team):
    client.force_login(team.owner)
    client.post("/p/alpha/members/", {"username": "oscar", "role": "viewer", "action": "set"})
    assert Membership.objects.get(project=team.project, user=team.outsider).role == "viewer"
    response = client.post("/p/alpha/members/", {"username": "nobody", "role": "viewer", "action": "set"}, follow=True)
    assert "no active user named" in response.content.decode()
    response = client.post("/p/alpha/members/", {"username": "olivia", "role": "viewer", "action": "set"}, follow=True)
    assert "at least one owner" in response.content.decode()
    client.post("/p/alpha/members/", {"username": "oscar", "action": "remove"})
    assert not Membership.objects.filter(project=team.project, user=team.outsider).exists()
    client.force_login(team.member)
    assert client.post("/p/alpha/members/", {"username": "oscar", "role": "owner", "action": "set"}).status_code == 403
    assert not Membership.objects.filter(project=team.project, user=team.outsider).exists()
    page = client.get("/p/alpha/members/").content.decode()
    assert "Add a member" not in page and "olivia" in page


def test_only_owners_learn_whether_an_account_exists_from_the_members_form(client, team):
    """A viewer or member who posts the members form gets the same refusal page whether the name is an account
    (oscar) or not: they cannot probe the platform for usernames. An owner is told which names are not accounts."""
    for who in (team.viewer, team.member):
        client.force_login(who)
        answers = [client.post("/p/alpha/members/", {"username": name, "role": "viewer", "action": action})
                   for name in ("oscar", "nobody-by-this-name") for action in ("set", "remove")]
        assert [a.status_code for a in answers] == [403] * 4, who.username
        role = "viewer" if who == team.viewer else "member"
        assert all(f"changing members needs the owner role; you are a {role}" in a.content.decode() for a in answers)
        assert all("no active user" not in a.content.decode() for a in answers)
    client.force_login(team.owner)
    told = client.post("/p/alpha/members/", {"username": "nobody-by-this-name", "role": "viewer"}, follow=True)
    assert "no active user named &#x27;nobody-by-this-name&#x27;" in told.content.decode()


def test_the_run_page_shows_which_replica_runs_where(client, team, runs):
    from forgeboard.telemetry.services import event_append

    run = runs[0]
    event_append(run=run, kind="placement_applied", payload={"role": "generator", "hosts": ["a", "b"],
                                                            "plan": {"0": "a", "1": "b"}})
    event_append(run=run, kind="placement_changed", payload={"role": "generator", "action": "move",
                                                            "plan": {"0": "b", "1": "b", "10": "a"}})
    client.force_login(team.viewer)
    response = client.get(f"/runs/{run.pk}/")
    assert response.context["placement"]["replicas"] == [("0", "b"), ("1", "b"), ("10", "a")]
    assert "Generator replica" in response.content.decode()


def test_a_runs_rollouts_table_stays_small_whatever_its_engine_reports(client, team, running_run):
    """A run's engine reports rollouts whose step and policy version are huge text, with a huge prompt: the rollouts
    table shows a dash for those fields and a cut prompt, so it stays a few kilobytes, and the good sample is there."""
    run, token = running_run
    huge = "9" * 200_000
    events = [{"kind": "rollout", "time": 1.7e9, "payload": payload} for payload in (
        {"step": huge, "policy_version": huge, "prompt": "p" * 200_000, "completion": "c", "reward": huge,
         "advantage": {"a": huge}},
        {"step": 12, "policy_version": 3, "prompt": "2+2=", "completion": "4", "reward": 1.0, "advantage": 0.5},
    )]
    _report(client, run, token, events)
    client.force_login(team.viewer)
    table = client.get(f"/runs/{run.pk}/rollouts/")
    assert table.status_code == 200
    html = table.content.decode()
    assert len(html) < 10_000, len(html)
    assert "99999999999" not in html and "p" * 200 not in html
    assert '<td class="num">12</td>' in html and "2+2=" in html and '<td class="num">3</td>' in html


def _report(client, run, token: str, events: list[dict]) -> None:
    """The events as the run's engine sends them: one telemetry batch through the controller API."""
    sent = client.post(f"/api/v1/controller/runs/{run.pk}/telemetry", content_type="application/json",
                       data=json.dumps({"batches": [{"seq": 1, "events": events}]}),
                       HTTP_AUTHORIZATION=f"Bearer {token}")
    assert sent.status_code == 200, sent.content


def test_a_placement_event_of_any_size_leaves_the_run_page_small(client, team, monarch_running_run):
    """A run's engine reports a placement of 60,000 replicas under a huge role name: the run page shows the first
    replicas and how many more there are, and a cut plan, instead of megabytes."""
    run, token = monarch_running_run
    plan = {str(i): f"host-{i}" for i in range(60_000)}
    event = {"kind": "placement_applied", "time": 1.7e9, "payload": {"role": "r" * 100_000, "plan": plan}}
    _report(client, run, token, [event])
    client.force_login(team.viewer)
    page = client.get(f"/runs/{run.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert len(html) < 200_000, len(html)
    assert "<td>0</td><td>host-0</td>" in html and "host-59999" not in html
    assert "and 59744 more" in html and "r" * 100 not in html


def test_a_lost_runs_page_says_what_comes_next(client, team, runs):
    """A lost run restarts once its previous attempt is confirmed stopped, fails without restarts left, or ends
    succeeded when that attempt turns out to have finished (runs/reconcile.py): its page says all three."""
    run = runs[0]
    Run.objects.filter(pk=run.pk).update(state="lost", exit_reason="no heartbeat for 120 s")
    client.force_login(team.member)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert "once its previous attempt is confirmed stopped" in page and "else it fails" in page
    assert "it ends succeeded if that attempt turns out to have finished" in page
