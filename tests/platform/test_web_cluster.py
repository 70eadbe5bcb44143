"""The cluster page: hosts, devices and which runs (and actors) are where; only operators change host states."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from forgeboard.accounts.services import project_create
from forgeboard.audit.models import AuditEvent
from forgeboard.cluster.models import Host, HostIntent, HostLiveness
from forgeboard.cluster.selectors import ELSEWHERE_HOSTS_PER_RUN, placement_actors
from forgeboard.cluster.services import DeviceReport, host_register
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.services import event_append

GIB = 1024**3


@pytest.fixture
def cluster(team, grpo_yaml):
    """Two hosts; an alpha run on gpu-a (moved a generator to gpu-b), a beta run on gpu-a, a finished run."""
    gpu_a = host_register(actor=team.operator, hostname="gpu-a", pool="h200", cpu_count=64, memory_bytes=512 * GIB,
                          cpu_utilization=37.0, memory_utilization=61.0, agent_version="1.2",
                          devices=[DeviceReport(kind="gpu", index=0, model="NVIDIA H200", memory_bytes=141 * GIB,
                                                utilization=88.0, memory_used_bytes=70 * GIB),
                                   DeviceReport(kind="gpu", index=1, model="NVIDIA H200", memory_bytes=141 * GIB,
                                                health="degraded")])
    gpu_b = host_register(actor=team.operator, hostname="gpu-b", pool="spot", cpu_count=8)
    Host.objects.filter(pk=gpu_b.pk).update(last_heartbeat_at=timezone.now() - timedelta(minutes=10))
    ours = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    beta = project_create(actor=team.operator, slug="beta", name="Beta Secret")
    theirs = run_launch(actor=team.operator, config_yaml=grpo_yaml,
                        experiment=experiment_create(actor=team.operator, project=beta, name="hush", recipe="grpo"))
    done = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=ours.pk).update(state=RunState.RUNNING, host="gpu-a",
                                          allocation={"gpu-a": {"gpus": 2, "slots": 1}})
    Run.objects.filter(pk=theirs.pk).update(state=RunState.RUNNING, host="gpu-a",
                                            allocation={"gpu-a": {"gpus": 1, "slots": 1}})
    Run.objects.filter(pk=done.pk).update(state=RunState.SUCCEEDED, host="gpu-a")
    event_append(run=ours, kind="placement_changed",
                 payload={"actors": [{"role": "trainer", "rank": 0, "host": "gpu-a"},
                                     {"role": "generator", "replica": 0, "host": "gpu-a"},
                                     {"role": "generator", "replica": 1, "host": "gpu-b"}]})
    return {"gpu_a": gpu_a, "gpu_b": gpu_b, "ours": ours, "theirs": theirs, "done": done}


def _host_section(html: str, hostname: str) -> str:
    start = html.index(f'data-hostname="{hostname}"')
    end = html.find("</section>", start)
    return html[start:end]


def test_needs_login(client, db):
    response = client.get("/cluster/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_hosts_devices_and_heartbeats_are_shown(client, team, cluster):
    client.force_login(team.viewer)
    html = client.get("/cluster/").content.decode()
    a, b = _host_section(html, "gpu-a"), _host_section(html, "gpu-b")
    assert 'data-stale="false"' in a and "stale heartbeat" not in a
    assert 'data-stale="true"' in b and "stale heartbeat" in b and re.search(r"10m 0\ds ago", b)
    assert "pool h200" in a and "pool spot" in b and "64 cores" in a and "512.0 GiB" in a
    assert "37%" in a and "61% used" in a
    assert 'data-device="gpu0"' in a and "NVIDIA H200" in a and "70.0 GiB / 141.0 GiB" in a and "88%" in a
    assert "Degraded" in a  # the device's health, and the host's (the worst of its devices)
    assert "No devices reported." in b


def test_runs_are_placed_by_host_allocation_and_latest_placement_event(client, team, cluster):
    client.force_login(team.viewer)
    html = client.get("/cluster/").content.decode()
    a, b = _host_section(html, "gpu-a"), _host_section(html, "gpu-b")
    ours = cluster["ours"]
    assert f'href="/runs/{ours.pk}/"' in a and f"math #{ours.number}" in a
    assert "trainer[0]" in a and "generator[0]" in a and "generator[1]" not in a
    assert f'href="/runs/{ours.pk}/"' in b and "generator[1]" in b and "placement changed #" in b
    assert f'data-run="{cluster["done"].pk}"' not in html  # finished runs hold nothing


def test_runs_of_projects_the_viewer_cannot_see_are_anonymous(client, team, cluster):
    client.force_login(team.viewer)
    html = client.get("/cluster/").content.decode()
    a = _host_section(html, "gpu-a")
    assert a.count('data-run="hidden"') == 1 and "another project" in a
    assert "hush" not in html and "Beta Secret" not in html and f'href="/runs/{cluster["theirs"].pk}/"' not in html
    client.force_login(team.outsider)  # in no project at all: sees the inventory, every run anonymous
    html = client.get("/cluster/").content.decode()
    assert html.count('data-run="hidden"') == 3 and "math #" not in html and "NVIDIA H200" in html


def test_only_operators_see_the_state_controls(client, team, cluster):
    for user in (team.owner, team.member, team.viewer, team.outsider):
        client.force_login(user)
        html = client.get("/cluster/").content.decode()
        assert "host-state-form" not in html and 'name="intent"' not in html
    client.force_login(team.operator)
    html = client.get("/cluster/").content.decode()
    form = _host_section(html, "gpu-a")
    assert 'class="toolbar host-state-form" data-confirm=' in form and 'value="draining"' in form
    assert 'value="down"' not in form  # down comes from missed heartbeats, not from a person


@pytest.mark.parametrize("role", ["owner", "member", "viewer", "outsider"])
def test_a_forged_state_change_from_a_non_operator_is_forbidden(client, team, cluster, role):
    client.force_login(team.by_role(role))
    response = client.post("/cluster/", {"hostname": "gpu-a", "intent": "draining", "reason": "sneaky"})
    assert response.status_code == 403 and "platform operator role" in response.content.decode()
    assert Host.objects.get(hostname="gpu-a").intent == HostIntent.SCHEDULABLE
    assert not AuditEvent.objects.filter(action="host.set_intent").exists()


def test_an_operator_drains_and_restores_a_host_with_an_audit_entry(client, team, cluster):
    client.force_login(team.operator)
    response = client.post("/cluster/", {"hostname": "gpu-a", "intent": "draining", "reason": "kernel update"})
    assert response.status_code == 302 and response["Location"] == "/cluster/"
    assert Host.objects.get(hostname="gpu-a").intent == HostIntent.DRAINING
    entry = AuditEvent.objects.get(action="host.set_intent")
    assert entry.actor == team.operator and entry.payload == {"from": "schedulable", "to": "draining",
                                                              "reason": "kernel update"}
    page = client.get("/cluster/").content.decode()
    assert "gpu-a is now draining." in page and 'data-state="draining"' in _host_section(page, "gpu-a")
    client.post("/cluster/", {"hostname": "gpu-a", "intent": "schedulable"})
    assert Host.objects.get(hostname="gpu-a").intent == HostIntent.SCHEDULABLE


def test_the_page_shows_a_hosts_liveness_apart_from_what_an_operator_wants(client, team, cluster):
    """A host cordoned while down shows both: down (its heartbeats) and cordoned (the operator's word, kept for
    when it comes back); the form shows the intent to change."""
    Host.objects.filter(hostname="gpu-b").update(liveness=HostLiveness.DOWN)
    client.force_login(team.operator)
    response = client.post("/cluster/", {"hostname": "gpu-b", "intent": "cordoned", "reason": "bad fan"})
    page = client.get(response["Location"]).content.decode()
    assert "gpu-b is now cordoned. It is down: nothing is placed there before its heartbeats resume." in page
    section = _host_section(page, "gpu-b")
    assert 'data-state="down" data-liveness="down" data-intent="cordoned"' in section
    assert '<span class="state host-liveness-down" title="from its heartbeats">Down</span>' in section
    assert '<span class="state host-intent-cordoned" title="set by an operator">Cordoned</span>' in section
    assert '<option value="cordoned" selected>Cordoned</option>' in section


@pytest.mark.parametrize("form, status, reason", [
    ({"hostname": "gpu-a", "intent": "down"}, 400, "choose schedulable, draining or cordoned"),
    ({"hostname": "gpu-a", "intent": "up"}, 400, "choose schedulable, draining or cordoned"),
    ({"hostname": "gpu-a", "intent": "sideways"}, 400, "choose schedulable, draining or cordoned"),
    ({"hostname": "gpu-a"}, 400, "choose schedulable, draining or cordoned"),
    ({"hostname": "gpu-z", "intent": "draining"}, 404, "no host &#x27;gpu-z&#x27;"),
    ({"intent": "draining"}, 404, "no host"),
    ({"hostname": "gpu-a", "intent": "draining", "reason": "x" * 501}, 400, "at most 500 characters"),
])
def test_bad_state_changes_get_a_clear_error(client, team, cluster, form, status, reason):
    client.force_login(team.operator)
    response = client.post("/cluster/", form)
    assert response.status_code == status and reason in response.content.decode()
    assert Host.objects.get(hostname="gpu-a").intent == HostIntent.SCHEDULABLE


def test_other_methods_are_refused(client, team, cluster):
    client.force_login(team.operator)
    assert client.put("/cluster/").status_code == 405


@pytest.mark.parametrize("payload, expected", [
    ({"actors": [{"role": "trainer", "rank": 1, "host": "h1"}, {"role": "generator", "host": "local"}, "junk"]},
     [("h1", "trainer[1]"), ("run-host", "generator")]),
    ({"backend": "monarch", "trainer": {"hosts": [], "procs_per_host": 1},
      "generator": {"hosts": ["h1", "h2"], "procs_per_host": 2}},
     [("run-host", "trainer"), ("h1", "generator ×2"), ("h2", "generator ×2")]),
    ({"trainer": "h1", "generator": ["h2", "h3"]}, [("h1", "trainer"), ("h2", "generator[0]"), ("h3", "generator[1]")]),
    ({"action": "move", "role": "generator", "replica": 2, "host": "h4"}, [("h4", "generator[2]")]),
    ({"action": "remove", "replica": 2}, []),
    ({"trainer": 5, "actors": "nope"}, []),
])
def test_placement_payloads_are_read_in_every_known_form(payload, expected):
    assert placement_actors(payload=payload, default_host="run-host") == expected


def test_without_a_placement_event_the_launch_plan_puts_enabled_roles_on_the_runs_host(client, team, cluster):
    theirs = cluster["theirs"]
    Run.objects.filter(pk=theirs.pk).update(host="")  # the beta run no longer claims gpu-a by host
    client.force_login(team.operator)  # operator launched it: a member of beta
    html = client.get("/cluster/").content.decode()
    a = _host_section(html, "gpu-a")
    row = a[a.index(f'data-run="{theirs.pk}"'):]
    row = row[:row.index("</tr>")]
    assert "launch plan" not in row  # plan hosts are empty and the run has no host of its own: nothing placed
    assert "hush #" in row  # still on gpu-a through its allocation
    Run.objects.filter(pk=theirs.pk).update(host="gpu-a")
    html = client.get("/cluster/").content.decode()
    row = _host_section(html, "gpu-a")
    row = row[row.index(f'data-run="{theirs.pk}"'):]
    row = row[:row.index("</tr>")]
    assert "trainer" in row and "generator" in row and "reward" in row and "reference" not in row
    assert "launch plan" in row


def test_host_names_only_another_projects_run_gives_are_not_shown(client, team, cluster):
    """Beta's engine reports an actor on "beta-codename-7", a host no agent registered: alpha's viewer does not see that
    name on the cluster page (beta's own people do), while beta's run still shows as "another project" on gpu-a."""
    event_append(run=cluster["theirs"], kind="placement_applied",
                 payload={"actors": [{"role": "generator", "replica": 0, "host": "beta-codename-7"},
                                     {"role": "trainer", "rank": 0, "host": "gpu-b"}]})
    client.force_login(team.viewer)
    html = client.get("/cluster/").content.decode()
    assert "beta-codename-7" not in html
    assert 'data-run="hidden"' in _host_section(html, "gpu-a") and 'data-run="hidden"' in _host_section(html, "gpu-b")
    client.force_login(team.operator)  # beta's owner
    assert 'data-hostname="beta-codename-7"' in client.get("/cluster/").content.decode()


def test_runs_on_unregistered_hosts_and_unplaced_runs_are_listed_too(client, team, cluster, grpo_yaml):
    local = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    launching = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=local.pk).update(state=RunState.RUNNING, host="laptop")
    Run.objects.filter(pk=launching.pk).update(state=RunState.LAUNCHING)
    client.force_login(team.viewer)
    html = client.get("/cluster/").content.decode()
    laptop = _host_section(html, "laptop")
    assert "not in the inventory" in laptop and f'data-run="{local.pk}"' in laptop and "trainer" in laptop
    unplaced = html[html.index('id="unplaced"'):]
    assert f'data-run="{launching.pk}"' in unplaced and f"math #{launching.number}" in unplaced
    assert f'data-run="{launching.pk}"' not in html[:html.index('id="unplaced"')]
    assert "not in the inventory" not in _host_section(html, "gpu-a")


def test_a_placement_of_any_size_leaves_the_cluster_page_small(client, team, cluster):
    """An engine reporting 20,000 actors, each on a host no agent registered and 2,000 on one of them, puts at most
    ELSEWHERE_HOSTS_PER_RUN cards on the page and a bounded list of actors on each, saying how many more there are."""
    actors = [{"role": "generator", "replica": i, "host": f"ghost-{i:05d}"} for i in range(18_000)]
    actors += [{"role": "trainer", "rank": i, "host": "gpu-a"} for i in range(2_000)]
    event_append(run=cluster["ours"], kind="placement_applied", payload={"actors": actors})
    client.force_login(team.member)
    html = client.get("/cluster/").content.decode()
    assert len(html) < 200_000, len(html)
    assert html.count('class="card host-card unregistered"') == ELSEWHERE_HOSTS_PER_RUN
    assert "and 17968 more hosts outside the inventory" in html
    assert "and 1936 more" in _host_section(html, "gpu-a")
