"""Inventory: hosts register with their devices; re-registering replaces the device list; operators drain and
cordon hosts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from forgeboard.audit.models import AuditEvent
from forgeboard.cluster.models import Device, Host, HostIntent, HostLiveness
from forgeboard.cluster.services import DeviceReport, host_register, host_set_intent, hosts_mark_down
from forgeboard.errors import ValidationFailed
from tests.support.races import racing_an_open_transaction

H200 = 141 * 2**30


def test_register_then_update_replaces_devices(team):
    gpus = [DeviceReport(kind="gpu", index=i, model="NVIDIA H200", memory_bytes=H200) for i in range(8)]
    host = host_register(actor=team.operator, hostname="gpu-001", pool="h200", labels={"rack": "a1"},
                         cpu_count=192, memory_bytes=2 * 2**40, devices=gpus)
    assert host.devices.count() == 8 and host.pool == "h200"
    host_register(actor=team.operator, hostname="gpu-001", pool="h200", devices=gpus[:6])
    assert sorted(Device.objects.filter(host=host).values_list("index", flat=True)) == [0, 1, 2, 3, 4, 5]
    assert list(AuditEvent.objects.filter(target_type="cluster.host", target_id=str(host.pk)).values_list("action", flat=True)) == [
        "host.update", "host.register"]


def test_down_host_comes_back_up_when_it_registers_again(team):
    Host.objects.create(hostname="gpu-002", liveness=HostLiveness.DOWN)
    host = host_register(actor=team.operator, hostname="gpu-002")
    assert host.liveness == HostLiveness.UP


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hostname": "has space"}, "hostname"),
        ({"hostname": ""}, "hostname"),
        ({"labels": {"rack": 3}}, "labels"),
        ({"devices": [DeviceReport(kind="tpu", index=0, model="v5")]}, "devices[0].kind"),
        ({"devices": [DeviceReport(kind="gpu", index=0, model="a"), DeviceReport(kind="gpu", index=0, model="b")]},
         "devices[1].index"),
    ],
)
def test_bad_reports_are_refused(team, kwargs, field):
    args = {"hostname": "gpu-003"} | kwargs
    with pytest.raises(ValidationFailed) as caught:
        host_register(actor=team.operator, **args)
    assert caught.value.problems[0].field == field
    assert Host.objects.count() == 0


def test_down_is_not_an_operator_choice(team):
    host = host_register(actor=team.operator, hostname="gpu-004")
    for liveness in HostLiveness.values:
        with pytest.raises(ValidationFailed, match="whether a host is up or down comes from its heartbeats"):
            host_set_intent(actor=team.operator, host=host, intent=liveness)
    drained = host_set_intent(actor=team.operator, host=host, intent="draining", reason="maintenance")
    assert Host.objects.get(pk=drained.pk).intent == HostIntent.DRAINING
    entry = AuditEvent.objects.get(action="host.set_intent")
    assert entry.payload == {"from": "schedulable", "to": "draining", "reason": "maintenance"}


@pytest.mark.django_db(transaction=True)
def test_a_cordon_racing_the_reconcile_leaves_the_host_down_and_cordoned(team):
    """The reconcile marks a silent host down while an operator cordons it: the cordon was saved from the row read
    before, over "down", so the host looked alive (cordoned) and the next reconcile marked it down again. Now the
    cordon waits for the row and changes only the intent: the host is down and cordoned, and stays so."""
    host = host_register(actor=team.operator, hostname="gpu-005")
    Host.objects.filter(pk=host.pk).update(last_heartbeat_at=timezone.now() - timedelta(minutes=10))
    seen_before = Host.objects.get(pk=host.pk)
    outcome = racing_an_open_transaction(
        lambda: hosts_mark_down(now=timezone.now(), timeout_s=60),
        lambda: host_set_intent(actor=team.operator, host=seen_before, intent=HostIntent.CORDONED))
    assert isinstance(outcome, Host), outcome
    assert (outcome.liveness, outcome.intent) == (HostLiveness.DOWN, HostIntent.CORDONED)
    assert hosts_mark_down(now=timezone.now(), timeout_s=60) == []


@pytest.mark.django_db(transaction=True)
def test_two_operators_at_once_each_change_the_host_as_the_other_left_it(team):
    """The second of two changes at once was audited from what the host was before either (the first's drain went
    missing from the log); now it waits for the first and says it replaced the drain."""
    host = host_register(actor=team.operator, hostname="gpu-006")
    first_page, second_page = Host.objects.get(pk=host.pk), Host.objects.get(pk=host.pk)  # each operator's view
    outcome = racing_an_open_transaction(
        lambda: host_set_intent(actor=team.operator, host=first_page, intent=HostIntent.DRAINING, reason="kernel"),
        lambda: host_set_intent(actor=team.operator, host=second_page, intent=HostIntent.CORDONED, reason="fan"))
    assert isinstance(outcome, Host) and outcome.intent == HostIntent.CORDONED, outcome
    entries = AuditEvent.objects.filter(action="host.set_intent").order_by("pk")
    assert [(e.payload["from"], e.payload["to"]) for e in entries] == [("schedulable", "draining"),
                                                                       ("draining", "cordoned")]


def test_the_api_shows_a_hosts_state_with_its_liveness_and_intent(client, team):
    """`state` keeps its one word for existing clients (down wins, else the intent, up when schedulable); `liveness`
    and `intent` say each side apart, so a client sees a down host's cordon before it comes back."""
    from forgeboard.accounts.services import api_token_create
    from forgeboard.cluster.services import host_heartbeat

    _, raw = api_token_create(actor=team.member, project=team.project, name="ci-read", scope="read")
    host = host_register(actor=team.operator, hostname="gpu-007")

    def listed() -> tuple[str, str, str]:
        [answer] = client.get("/api/v1/hosts", HTTP_AUTHORIZATION=f"Bearer {raw}").json()
        return answer["state"], answer["liveness"], answer["intent"]

    assert listed() == ("up", "up", "schedulable")
    Host.objects.filter(pk=host.pk).update(liveness=HostLiveness.DOWN)
    host_set_intent(actor=team.operator, host=host, intent=HostIntent.CORDONED)
    assert listed() == ("down", "down", "cordoned")
    host_heartbeat(actor=team.operator, hostname="gpu-007", cpu_utilization=1.0, memory_utilization=1.0)
    assert listed() == ("cordoned", "up", "cordoned")
