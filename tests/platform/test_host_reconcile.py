"""Host liveness: hosts that stop heartbeating are marked down, with the active runs placed on them; what an
operator wants of a host (drained, cordoned) is left as it is."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from forgeboard.audit.models import AuditEvent
from forgeboard.cluster.models import Health, Host, HostIntent, HostLiveness, HostState
from forgeboard.cluster.services import host_heartbeat, host_register, host_set_intent, hosts_mark_down
from forgeboard.errors import ValidationFailed
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState

TIMEOUT_S = 60


def _host(team, hostname: str, *, seconds_ago: float, liveness: HostLiveness = HostLiveness.UP,
          intent: HostIntent = HostIntent.SCHEDULABLE) -> Host:
    host = host_register(actor=team.operator, hostname=hostname)
    Host.objects.filter(pk=host.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=seconds_ago),
                                           liveness=liveness, intent=intent)
    return Host.objects.get(pk=host.pk)


def _run_on(team, grpo_yaml: str, hostname: str, state: RunState) -> Run:
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(host=hostname, state=state)
    return run


def test_silent_hosts_go_down_with_their_active_runs(team, grpo_yaml):
    _host(team, "gpu-fresh", seconds_ago=5)
    _host(team, "gpu-silent", seconds_ago=TIMEOUT_S + 30)
    active = [_run_on(team, grpo_yaml, "gpu-silent", state) for state in
              (RunState.LAUNCHING, RunState.RUNNING, RunState.PAUSED, RunState.CANCELLING)]
    for state in (RunState.QUEUED, RunState.SUCCEEDED, RunState.FAILED, RunState.LOST):
        _run_on(team, grpo_yaml, "gpu-silent", state)
    _run_on(team, grpo_yaml, "gpu-fresh", RunState.RUNNING)

    marked = hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S)

    assert [m.host.hostname for m in marked] == ["gpu-silent"]
    assert marked[0].run_ids == [run.pk for run in active]
    silent, fresh = Host.objects.get(hostname="gpu-silent"), Host.objects.get(hostname="gpu-fresh")
    assert (silent.liveness, silent.health) == (HostLiveness.DOWN, Health.UNHEALTHY)
    assert (fresh.liveness, fresh.health) == (HostLiveness.UP, Health.HEALTHY)
    assert silent.state == HostState.DOWN and fresh.state == HostState.UP
    # The reconciler decides what happens to the runs; marking a host down leaves them as they were.
    assert sorted(Run.objects.filter(pk__in=marked[0].run_ids).values_list("state", flat=True)) == sorted(
        ["launching", "running", "paused", "cancelling"])
    entry = AuditEvent.objects.get(action="host.down")
    assert entry.actor_label == "system" and entry.target_id == str(silent.pk)
    assert entry.payload["run_ids"] == marked[0].run_ids and entry.payload["from"] == "up"
    assert entry.payload["timeout_s"] == TIMEOUT_S


def test_marking_down_is_idempotent_and_covers_drained_hosts(team):
    _host(team, "gpu-a", seconds_ago=600, intent=HostIntent.DRAINING)
    _host(team, "gpu-b", seconds_ago=600, liveness=HostLiveness.DOWN)
    first = hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S)
    assert [m.host.hostname for m in first] == ["gpu-a"] and first[0].run_ids == []
    assert AuditEvent.objects.get(action="host.down").payload["from"] == "draining"
    drained = Host.objects.get(hostname="gpu-a")
    assert (drained.liveness, drained.intent) == (HostLiveness.DOWN, HostIntent.DRAINING), "down, and still drained"
    assert hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S) == []
    assert AuditEvent.objects.filter(action="host.down").count() == 1


def test_the_timeout_is_measured_from_now(team):
    _host(team, "gpu-c", seconds_ago=90)
    assert hosts_mark_down(now=timezone.now() - timedelta(seconds=60), timeout_s=TIMEOUT_S) == []
    assert hosts_mark_down(now=timezone.now(), timeout_s=120) == []
    assert [m.host.hostname for m in hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S)] == ["gpu-c"]


def test_a_host_that_never_heartbeat_goes_down_after_the_timeout(team):
    host = Host.objects.create(hostname="gpu-never")
    Host.objects.filter(pk=host.pk).update(registered_at=timezone.now() - timedelta(hours=1))
    Host.objects.create(hostname="gpu-new")
    marked = hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S)
    assert [m.host.hostname for m in marked] == ["gpu-never"]


def test_a_heartbeat_brings_a_down_host_back(team):
    _host(team, "gpu-d", seconds_ago=600)
    hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S)
    host = host_heartbeat(actor=team.operator, hostname="gpu-d", cpu_utilization=3.0, memory_utilization=4.0)
    assert (host.liveness, host.health) == (HostLiveness.UP, Health.HEALTHY)
    assert hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S) == []


def test_a_host_cordoned_while_down_stays_down_and_comes_back_cordoned(team):
    """A host's one state held both the operator's word and its liveness: a cordon set on a down host replaced
    "down", so the next reconcile marked it down again (a second host.down, the cordon gone) and a heartbeat then
    brought it back "up", schedulable. Now the cordon is its intent and down its liveness: neither writes the other."""
    from forgeboard.runs.demand import inventory

    _host(team, "gpu-e", seconds_ago=600)
    hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S)
    cordoned = host_set_intent(actor=team.operator, host=Host.objects.get(hostname="gpu-e"),
                               intent=HostIntent.CORDONED, reason="bad fan")
    assert (cordoned.liveness, cordoned.intent, cordoned.state) == (HostLiveness.DOWN, HostIntent.CORDONED,
                                                                    HostState.DOWN)
    assert hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S) == []
    assert AuditEvent.objects.filter(action="host.down").count() == 1
    back = host_heartbeat(actor=team.operator, hostname="gpu-e", cpu_utilization=1.0, memory_utilization=1.0)
    assert (back.liveness, back.intent, back.state) == (HostLiveness.UP, HostIntent.CORDONED, HostState.CORDONED)
    assert "gpu-e" not in inventory(usable_only=True), "a cordoned host gets no new work"


def test_an_operator_cannot_bring_a_dead_host_up(team):
    """Setting a down host "up" showed a dead host as up (on the cluster page, in the API) until the next reconcile
    marked it down again, with a second host.down. Now the operator makes it schedulable and it stays down, to the
    reconcile too, until its heartbeats resume; then it is up and takes work."""
    from forgeboard.runs.demand import inventory

    _host(team, "gpu-f", seconds_ago=600, intent=HostIntent.DRAINING)
    _host(team, "gpu-g", seconds_ago=5)
    hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S)
    restored = host_set_intent(actor=team.operator, host=Host.objects.get(hostname="gpu-f"),
                               intent=HostIntent.SCHEDULABLE)
    assert (restored.liveness, restored.intent, restored.state) == (HostLiveness.DOWN, HostIntent.SCHEDULABLE,
                                                                    HostState.DOWN)
    assert hosts_mark_down(now=timezone.now(), timeout_s=TIMEOUT_S) == []
    assert AuditEvent.objects.filter(action="host.down").count() == 1
    assert sorted(inventory(usable_only=True)) == ["gpu-g"]
    host_heartbeat(actor=team.operator, hostname="gpu-f", cpu_utilization=1.0, memory_utilization=1.0)
    assert Host.objects.get(hostname="gpu-f").state == HostState.UP
    assert sorted(inventory(usable_only=True)) == ["gpu-f", "gpu-g"]


@pytest.mark.parametrize("timeout_s", [0, -5])
def test_the_timeout_must_be_positive(team, timeout_s):
    with pytest.raises(ValidationFailed) as caught:
        hosts_mark_down(now=timezone.now(), timeout_s=timeout_s)
    assert caught.value.problems[0].field == "timeout_s"
