"""Inventory writes: hosts register and report; operators drain, cordon and restore them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from forgeboard.accounts.permissions import Actor, require_operator
from forgeboard.audit.services import audit_record
from forgeboard.cluster.models import Device, DeviceKind, Health, Host, HostState
from forgeboard.errors import ValidationFailed


@dataclass(frozen=True)
class DeviceReport:
    kind: str
    index: int
    model: str
    memory_bytes: int = 0
    uuid: str = ""
    health: str = Health.HEALTHY
    utilization: float | None = None
    memory_used_bytes: int | None = None


def _check_report(*, hostname: str, labels: Mapping[str, str], devices: Sequence[DeviceReport]) -> None:
    if not hostname or len(hostname) > 255 or any(c.isspace() for c in hostname):
        raise ValidationFailed.on("hostname", "must be 1-255 characters without spaces")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ValidationFailed.on("labels", "must map text to text")
    seen = set()
    for i, device in enumerate(devices):
        if device.kind not in DeviceKind.values:
            raise ValidationFailed.on(f"devices[{i}].kind", f"unknown device kind {device.kind!r}")
        if device.health not in Health.values:
            raise ValidationFailed.on(f"devices[{i}].health", f"unknown health {device.health!r}")
        if (device.kind, device.index) in seen:
            raise ValidationFailed.on(f"devices[{i}].index", f"{device.kind}{device.index} reported twice")
        seen.add((device.kind, device.index))


@transaction.atomic
def host_register(
    *,
    actor: Actor,
    hostname: str,
    pool: str = "default",
    labels: Mapping[str, str] | None = None,
    cpu_count: int = 0,
    memory_bytes: int = 0,
    devices: Sequence[DeviceReport] = (),
) -> Host:
    """Add or update a host and replace its device list."""
    require_operator(actor=actor, action="registering hosts")
    labels = dict(labels or {})
    _check_report(hostname=hostname, labels=labels, devices=devices)
    host, created = Host.objects.update_or_create(
        hostname=hostname,
        defaults={"pool": pool, "labels": labels, "cpu_count": cpu_count, "memory_bytes": memory_bytes,
                  "last_heartbeat_at": timezone.now(), "health": Health.HEALTHY},
    )
    if not created and host.state == HostState.DOWN:
        host.state = HostState.UP
        host.save(update_fields=["state"])
    reported = {(r.kind, r.index) for r in devices}
    host.devices.exclude(pk__in=[d.pk for d in host.devices.all() if (d.kind, d.index) in reported]).delete()
    for report in devices:
        Device.objects.update_or_create(
            host=host, kind=report.kind, index=report.index,
            defaults={"model": report.model, "memory_bytes": report.memory_bytes, "uuid": report.uuid,
                      "health": report.health, "utilization": report.utilization,
                      "memory_used_bytes": report.memory_used_bytes},
        )
    audit_record(actor=actor, action="host.register" if created else "host.update", target=host,
                 payload={"devices": len(devices), "pool": pool})
    return host


def host_set_state(*, actor: Actor, host: Host, state: HostState | str, reason: str = "") -> Host:
    """Drain (no new work), cordon, or bring a host back up."""
    require_operator(actor=actor, action="changing a host's state")
    if state not in HostState.values or state == HostState.DOWN:
        raise ValidationFailed.on("state", "choose up, draining or cordoned (down is set by missed heartbeats)")
    previous = host.state
    with transaction.atomic():
        host.state = state
        host.save(update_fields=["state"])
        audit_record(actor=actor, action="host.set_state", target=host,
                     payload={"from": previous, "to": state, "reason": reason})
    return host
