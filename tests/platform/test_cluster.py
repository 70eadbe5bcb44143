"""Inventory: hosts register with their devices; re-registering replaces the device list."""

from __future__ import annotations

import pytest

from forgeboard.audit.models import AuditEvent
from forgeboard.cluster.models import Device, Host, HostState
from forgeboard.cluster.services import DeviceReport, host_register, host_set_state
from forgeboard.errors import ValidationFailed

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
    Host.objects.create(hostname="gpu-002", state=HostState.DOWN)
    host = host_register(actor=team.operator, hostname="gpu-002")
    assert host.state == HostState.UP


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
    with pytest.raises(ValidationFailed, match="down is set by missed heartbeats"):
        host_set_state(actor=team.operator, host=host, state=HostState.DOWN)
    drained = host_set_state(actor=team.operator, host=host, state="draining", reason="maintenance")
    assert Host.objects.get(pk=drained.pk).state == HostState.DRAINING
    entry = AuditEvent.objects.get(action="host.set_state")
    assert entry.payload == {"from": "up", "to": "draining", "reason": "maintenance"}
