"""Inventory writes: hosts register and report; operators drain, cordon and restore them.

A host has two sides that never write each other: whether it is alive (`liveness`: its registrations and
heartbeats bring it up, `hosts_mark_down` marks it down) and what an operator wants of it (`intent`:
`host_set_intent` only). A cordon set on a down host stays when it comes back; an operator cannot declare a dead
host up.

Node agents act through an `AgentToken`. An agent is not a person: its audit entries are
recorded as "system" with the token's prefix in the payload. A Celery worker reporting its own
host (the `cluster.probe` task, for clusters without agents) acts as a `WorkerProbe`, recorded
as "system" with the worker's name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeAlias

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from forgeboard.accounts.models import User
from forgeboard.accounts.permissions import Actor, require_operator
from forgeboard.audit.services import audit_record
from forgeboard.bearer import mint_token, token_matches, token_prefix
from forgeboard.cluster.models import AgentToken, Device, DeviceKind, Health, Host, HostIntent, HostLiveness
from forgeboard.cluster.selectors import active_run_ids_on_host
from forgeboard.errors import (
    AlreadyExists,
    Conflict,
    FieldProblem,
    NotFound,
    PermissionDenied,
    ValidationFailed,
    clean_text,
)



@dataclass(frozen=True)
class WorkerProbe:
    """A Celery worker reporting the host it runs on: platform code, not a person or a token."""

    worker: str


InventoryActor: TypeAlias = Actor | AgentToken | WorkerProbe
# The agent_version of a host that worker probes report (an agent reports its own version).
PROBE_AGENT_PREFIX = "worker-probe/"

AGENT_TOKEN_LAST_USED_RESOLUTION = timedelta(minutes=1)
POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
MAX_INTENT_REASON_LENGTH = 500

# Worst first: a host is as healthy as its least healthy device.
_HEALTH_ORDER = (Health.UNHEALTHY, Health.DEGRADED, Health.UNKNOWN, Health.HEALTHY)


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


@dataclass(frozen=True)
class DeviceSample:
    """What a heartbeat says about one registered device."""

    kind: str
    index: int
    health: str = Health.HEALTHY
    utilization: float | None = None
    memory_used_bytes: int | None = None


@dataclass(frozen=True)
class HostDown:
    host: Host
    run_ids: list[int]


def _require_inventory_writer(*, actor: InventoryActor, action: str) -> None:
    if isinstance(actor, WorkerProbe):
        return
    if isinstance(actor, AgentToken):
        if actor.revoked_at is not None:
            raise PermissionDenied(f"{action}: this agent token was revoked")
        return
    require_operator(actor=actor, action=action)


def _locked_host(hostname: str) -> Host | None:
    return Host.objects.select_for_update(of=("self",)).select_related("agent_token").filter(hostname=hostname).first()


def _require_host_reporter(*, actor: InventoryActor, host: Host | None, registering: bool) -> None:
    """An agent token reports only for the hosts it registered, as a kubelet may change only its own node: another
    token's register or heartbeat is a 409, so one leaked or misconfigured token cannot take over, empty or move
    every host. A host whose token was revoked is taken over by the next token that registers it; operators and
    worker probes report for any host."""
    if not isinstance(actor, AgentToken) or host is None or host.agent_token_id in (None, actor.pk):
        return
    owner = host.agent_token
    if owner.revoked_at is not None and registering:
        return
    raise Conflict(f"host {host.hostname!r} is reported by agent token {owner.name!r}"
                   + ("; register it with this token to take it over" if owner.revoked_at is not None else
                      "; an operator revokes that token before another may report for this host"),
                   problems=[FieldProblem("hostname", f"reported by agent token {owner.name!r}")])


def _audit(*, actor: InventoryActor, action: str, target: Host, payload: dict[str, Any]) -> None:
    if isinstance(actor, WorkerProbe):
        audit_record(actor=None, action=action, target=target, payload=payload | {"worker": actor.worker})
    elif isinstance(actor, AgentToken):
        audit_record(actor=None, action=action, target=target, payload=payload | {"agent_token": actor.prefix})
    else:
        audit_record(actor=actor, action=action, target=target, payload=payload)


def _worst_health(healths: Sequence[str]) -> str:
    if not healths:
        return Health.HEALTHY
    return min(healths, key=_HEALTH_ORDER.index)


def _check_report(*, hostname: str, pool: str, labels: Mapping[str, str], devices: Sequence[DeviceReport]) -> None:
    if not hostname or len(hostname) > 255 or any(c.isspace() for c in hostname):
        raise ValidationFailed.on("hostname", "must be 1-255 characters without spaces")
    # The pool names a Celery queue (launch.<pool>), so it stays a plain name.
    if not isinstance(pool, str) or not POOL_NAME.fullmatch(pool):
        raise ValidationFailed.on("pool", "must be 1-100 letters, digits, '.', '_' or '-', starting with a letter "
                                          "or digit")
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
    actor: InventoryActor,
    hostname: str,
    pool: str = "default",
    labels: Mapping[str, str] | None = None,
    cpu_count: int = 0,
    memory_bytes: int = 0,
    devices: Sequence[DeviceReport] = (),
    agent_version: str = "",
    cpu_utilization: float | None = None,
    memory_utilization: float | None = None,
) -> Host:
    """Add or update a host and replace its device list. A host that was down comes back up (its intent stays)."""
    _require_inventory_writer(actor=actor, action="registering hosts")
    labels = dict(labels or {})
    _check_report(hostname=hostname, pool=pool, labels=labels, devices=devices)
    owner = {"agent_token": actor} if isinstance(actor, AgentToken) else {}
    fields = {"pool": pool, "labels": labels, "cpu_count": cpu_count, "memory_bytes": memory_bytes,
              "agent_version": agent_version, "cpu_utilization": cpu_utilization,
              "memory_utilization": memory_utilization, "last_heartbeat_at": timezone.now(),
              "health": _worst_health([d.health for d in devices])} | owner
    host, created = _locked_host(hostname), False
    if host is None:
        try:
            with transaction.atomic():
                host, created = Host.objects.create(hostname=hostname, **fields), True
        except IntegrityError:  # another registration of this new host committed first: its owner decides
            host = _locked_host(hostname)
            if host is None:
                raise Conflict(f"host {hostname!r} was removed while it registered: register it again",
                               problems=[FieldProblem("hostname", "removed meanwhile")]) from None
    _require_host_reporter(actor=actor, host=host, registering=True)
    if not created:
        for name, value in fields.items():
            setattr(host, name, value)
        host.liveness = HostLiveness.UP
        host.save(update_fields=[*fields, "liveness"])
    reported = {(r.kind, r.index) for r in devices}
    host.devices.exclude(pk__in=[d.pk for d in host.devices.all() if (d.kind, d.index) in reported]).delete()
    for report in devices:
        Device.objects.update_or_create(
            host=host, kind=report.kind, index=report.index,
            defaults={"model": report.model, "memory_bytes": report.memory_bytes, "uuid": report.uuid,
                      "health": report.health, "utilization": report.utilization,
                      "memory_used_bytes": report.memory_used_bytes},
        )
    _audit(actor=actor, action="host.register" if created else "host.update", target=host,
           payload={"devices": len(devices), "pool": pool})
    return host


@transaction.atomic
def host_heartbeat(
    *,
    actor: InventoryActor,
    hostname: str,
    cpu_utilization: float | None,
    memory_utilization: float | None,
    devices: Sequence[DeviceSample] = (),
) -> Host:
    """Record a heartbeat: utilization and health of the host and its registered devices.

    Heartbeats are not audited (one per host every few seconds); a down host coming back is.
    A heartbeat for an unknown host or device raises NotFound or Conflict: the agent registers again.
    """
    _require_inventory_writer(actor=actor, action="reporting heartbeats")
    host = _locked_host(hostname)
    if host is None:
        raise NotFound(f"host {hostname!r} is not registered; register it first")
    _require_host_reporter(actor=actor, host=host, registering=False)
    registered = {(d.kind, d.index): d for d in host.devices.all()}
    seen = set()
    for i, sample in enumerate(devices):
        key = (sample.kind, sample.index)
        if sample.health not in Health.values:
            raise ValidationFailed.on(f"devices[{i}].health", f"unknown health {sample.health!r}")
        if key in seen:
            raise ValidationFailed.on(f"devices[{i}].index", f"{sample.kind}{sample.index} reported twice")
        if key not in registered:
            raise Conflict(f"{sample.kind}{sample.index} is not registered on {hostname}; register the host again",
                           problems=[])
        seen.add(key)
    for sample in devices:
        device = registered[(sample.kind, sample.index)]
        device.health = sample.health
        device.utilization = sample.utilization
        device.memory_used_bytes = sample.memory_used_bytes
        device.save(update_fields=["health", "utilization", "memory_used_bytes"])
    was_down = host.liveness == HostLiveness.DOWN
    host.cpu_utilization = cpu_utilization
    host.memory_utilization = memory_utilization
    host.health = _worst_health([d.health for d in registered.values()])
    host.last_heartbeat_at = timezone.now()
    host.liveness = HostLiveness.UP
    host.save(update_fields=["cpu_utilization", "memory_utilization", "health", "last_heartbeat_at", "liveness"])
    if was_down:
        _audit(actor=actor, action="host.up", target=host, payload={"reason": "heartbeat resumed"})
    return host


def host_probe_record(
    *,
    probe: WorkerProbe,
    hostname: str,
    pool: str,
    cpu_count: int,
    memory_bytes: int,
    cpu_utilization: float | None,
    memory_utilization: float | None,
    devices: Sequence[DeviceReport] = (),
    version: str,
) -> Host:
    """A worker's reading of its own host: registered when new or changed (CPUs, memory, devices), else a heartbeat.

    The host keeps its labels, and the pool an agent or an operator gave it; the worker's pool is used
    for a host that only probes report. Registrations are audited, heartbeats are not (as for agents).
    """
    host = Host.objects.filter(hostname=hostname).first()
    agent_version = f"{PROBE_AGENT_PREFIX}{version}"
    if host is not None and not host.agent_version.startswith(PROBE_AGENT_PREFIX):
        pool, agent_version = host.pool, host.agent_version  # an agent reports this host too: its word stands
    if host is not None:
        known = {(d.kind, d.index, d.model, d.memory_bytes, d.uuid) for d in host.devices.all()}
        reported = {(d.kind, d.index, d.model, d.memory_bytes, d.uuid) for d in devices}
        if (known == reported and host.pool == pool and host.cpu_count == cpu_count
                and host.memory_bytes == memory_bytes):
            return host_heartbeat(
                actor=probe, hostname=hostname, cpu_utilization=cpu_utilization,
                memory_utilization=memory_utilization,
                devices=[DeviceSample(kind=d.kind, index=d.index, health=d.health, utilization=d.utilization,
                                      memory_used_bytes=d.memory_used_bytes) for d in devices],
            )
    return host_register(
        actor=probe, hostname=hostname, pool=pool, labels=host.labels if host is not None else {},
        cpu_count=cpu_count, memory_bytes=memory_bytes, devices=devices,
        agent_version=agent_version,
        cpu_utilization=cpu_utilization, memory_utilization=memory_utilization,
    )


def host_set_intent(*, actor: Actor, host: Host, intent: HostIntent | str, reason: str = "") -> Host:
    """Drain or cordon a host (no new work placed there), or make it schedulable again; returns it as it now is.

    Only the operator's intent changes, on the locked row: whether the host is up or down is its heartbeats' to say.
    Setting the intent a host already has changes nothing but is audited too (with its reason).
    """
    require_operator(actor=actor, action="changing a host's state")
    if not isinstance(intent, str) or intent not in HostIntent.values:
        raise ValidationFailed.on("intent", "choose schedulable, draining or cordoned (whether a host is up or down "
                                            "comes from its heartbeats)")
    reason = clean_text(field="reason", value=reason, max_length=MAX_INTENT_REASON_LENGTH, required=False)
    with transaction.atomic():
        locked = Host.objects.select_for_update().filter(pk=host.pk).first()
        if locked is None:
            raise NotFound(f"no host {host.hostname!r}: it was removed")
        previous = locked.intent
        locked.intent = intent
        locked.save(update_fields=["intent"])
        audit_record(actor=actor, action="host.set_intent", target=locked,
                     payload={"from": previous, "to": intent, "reason": reason})
    return locked


def hosts_mark_down(*, now: datetime, timeout_s: float) -> list[HostDown]:
    """Mark hosts whose last heartbeat is older than `timeout_s` as down and unhealthy; their intent (drained,
    cordoned) stays as the operator set it.

    Returns each host marked down with the ids of the active runs placed on it, for the
    reconciler to act on; run states are not changed here. Each host is claimed with a
    conditional UPDATE, so a heartbeat that lands meanwhile keeps its host up.
    """
    if timeout_s <= 0:
        raise ValidationFailed.on("timeout_s", "must be positive")
    cutoff = now - timedelta(seconds=timeout_s)
    stale = (Q(last_heartbeat_at__lt=cutoff) | Q(last_heartbeat_at__isnull=True, registered_at__lt=cutoff))
    marked: list[HostDown] = []
    for host in Host.objects.filter(stale, liveness=HostLiveness.UP).order_by("hostname"):
        with transaction.atomic():
            claimed = (Host.objects.filter(stale, pk=host.pk, liveness=HostLiveness.UP)
                       .update(liveness=HostLiveness.DOWN, health=Health.UNHEALTHY))
            if claimed != 1:
                continue
            previous = host.state
            host.refresh_from_db()
            run_ids = active_run_ids_on_host(hostname=host.hostname)
            last = host.last_heartbeat_at.isoformat() if host.last_heartbeat_at else None
            audit_record(actor=None, action="host.down", target=host,
                         payload={"from": previous, "last_heartbeat_at": last, "timeout_s": timeout_s,
                                  "run_ids": run_ids})
        marked.append(HostDown(host=host, run_ids=run_ids))
    return marked


def hosts_record_scheduler_view(*, nodes: Mapping[str, tuple[str, str]], now: datetime) -> int:
    """What a cluster scheduler says of its nodes ({name: (state, reason)}), onto the hosts of those names (registered
    by their agents); the number of hosts updated. Nodes no agent registered are not added to the inventory."""
    hosts = list(Host.objects.filter(hostname__in=list(nodes)))
    for host in hosts:
        state, reason = nodes[host.hostname]
        host.scheduler_state, host.scheduler_reason, host.scheduler_checked_at = state[:64], reason[:255], now
    return Host.objects.bulk_update(hosts, ["scheduler_state", "scheduler_reason", "scheduler_checked_at"])


def agent_token_create(*, actor: User, name: str) -> tuple[AgentToken, str]:
    """Create a node agent token; the plaintext is returned once and never stored."""
    require_operator(actor=actor, action="creating agent tokens")
    name = clean_text(field="name", value=name, max_length=100)
    minted = mint_token("fba")
    prefix, raw = minted.prefix, minted.raw
    try:
        with transaction.atomic():
            token = AgentToken.objects.create(name=name, prefix=prefix, token_hash=minted.token_hash,
                                              created_by=actor)
            audit_record(actor=actor, action="agent_token.create", target=token,
                         payload={"name": name, "prefix": prefix})
    except IntegrityError:
        raise AlreadyExists.on("name", f"an agent token named {name!r} already exists") from None
    return token, raw


def agent_token_revoke(*, actor: User, token: AgentToken) -> AgentToken:
    require_operator(actor=actor, action="revoking agent tokens")
    now = timezone.now()
    if AgentToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now):
        token.revoked_at = now
        audit_record(actor=actor, action="agent_token.revoke", target=token, payload={"prefix": token.prefix})
    else:
        token.refresh_from_db(fields=["revoked_at"])  # revoked before: the first revoke's time and audit stand
    return token


def agent_token_authenticate(*, raw: str) -> AgentToken | None:
    """The live agent token for a bearer string, or None. Constant-time on the secret part."""
    prefix = token_prefix(raw, "fba")
    if prefix is None:
        return None
    token = AgentToken.objects.filter(prefix=prefix).first()
    if token is None or not token_matches(raw, token.token_hash):
        return None
    if token.revoked_at is not None:
        return None
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > AGENT_TOKEN_LAST_USED_RESOLUTION:
        AgentToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token
