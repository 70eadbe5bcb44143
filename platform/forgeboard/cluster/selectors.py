from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Max, Prefetch, Q, QuerySet

from forgeboard.accounts.models import User
from forgeboard.accounts.selectors import projects_for_user
from forgeboard.cluster.models import AgentToken, Device, Host
from forgeboard.errors import NotFound, is_db_text
from forgeboard.runs.models import Run
from forgeboard.runs.states import ACTIVE_STATES
from forgeboard.telemetry.models import EventKind, RunEvent
from workers.engine.config import PLACED_ROLES


def hosts_with_devices() -> QuerySet[Host]:
    return Host.objects.prefetch_related(Prefetch("devices", queryset=Device.objects.order_by("kind", "index")))


def active_run_ids_on_host(*, hostname: str) -> list[int]:
    """Ids of the runs placed on this host that are launching, running, paused or cancelling."""
    return list(Run.objects.filter(host=hostname, state__in=ACTIVE_STATES).order_by("pk").values_list("pk", flat=True))


def agent_tokens() -> QuerySet[AgentToken]:
    return AgentToken.objects.select_related("created_by").order_by("name")


PLACEMENT_EVENT_KINDS = (EventKind.PLACEMENT_APPLIED, EventKind.PLACEMENT_CHANGED)
LOCAL_HOST_NAMES = ("", "local", "localhost", "127.0.0.1")


def placement_actors(*, payload: Mapping[str, Any], default_host: str) -> list[tuple[str, str]]:
    """(host, actor) pairs from a placement: a placement event's payload or a run's launch plan.

    Understood forms: `{"actors": [{"role", "replica" or "rank", "host"}, ...]}`; a plan
    `{role: {"hosts": [...], "procs_per_host": n}}` (no hosts: the run's own host); `{role: host}` or
    `{role: [host, ...]}` (one replica per host), for the roles of PLACED_ROLES; and a change
    `{"action": "move"|"add", "role", "replica", "host"}` (a removal places nothing). A host named "local"
    (or none) is the run's own host. Anything else is skipped, not guessed at.
    """
    def where(host: Any) -> str:
        name = host if isinstance(host, str) else ""
        return default_host if name in LOCAL_HOST_NAMES else name

    def actor(role: Any, replica: Any = None) -> str:
        return f"{role}[{replica}]" if isinstance(replica, int) and not isinstance(replica, bool) else str(role)

    placed: list[tuple[str, str]] = []
    if isinstance(payload.get("actors"), list):
        for item in payload["actors"]:
            if isinstance(item, Mapping) and isinstance(item.get("role"), str):
                placed.append((where(item.get("host")), actor(item["role"], item.get("replica", item.get("rank")))))
    elif "action" in payload:
        if payload["action"] in ("move", "add") and isinstance(payload.get("host"), str):
            placed.append((where(payload["host"]), actor(payload.get("role", "generator"), payload.get("replica"))))
    else:
        for role, spec in payload.items():
            if role not in PLACED_ROLES:
                continue
            if isinstance(spec, Mapping) and isinstance(spec.get("hosts"), list):
                hosts = spec["hosts"] or [default_host]
                procs = spec.get("procs_per_host", 1)
                suffix = f" ×{procs}" if isinstance(procs, int) and procs > 1 else ""
                placed.extend((where(host), f"{role}{suffix}") for host in hosts)
            elif isinstance(spec, str):
                placed.append((where(spec), role))
            elif isinstance(spec, list):
                placed.extend((where(host), actor(role, i)) for i, host in enumerate(spec) if isinstance(host, str))
    return [(host, name) for host, name in placed if host]


ELSEWHERE_HOSTS_PER_RUN = 32  # hosts outside the inventory one run may add to the page (its engine names them)
ACTORS_SHOWN = 64  # a run's actors listed on one host


@dataclass
class RunOnHost:
    """A run with something on a host. `visible`: False for runs of projects the viewer is not in (shown
    as "another project", without name, number or link)."""

    run_id: int
    visible: bool
    label: str
    project_slug: str
    state: str
    gpus: int | None = None
    slots: int | None = None
    actors: list[str] = field(default_factory=list)
    actors_more: int = 0  # past ACTORS_SHOWN
    placement_source: str = ""


@dataclass
class HostOverview:
    host: Host
    devices: list[Device]
    stale: bool
    heartbeat_age_s: float | None
    runs: list[RunOnHost]


def _latest_placements(*, run_ids: list[int]) -> dict[int, RunEvent]:
    latest = (RunEvent.objects.filter(run_id__in=run_ids, kind__in=PLACEMENT_EVENT_KINDS)
              .values("run_id").annotate(seq=Max("seq")))
    match = Q(pk__in=[])
    for row in latest:
        match |= Q(run_id=row["run_id"], seq=row["seq"])
    return {event.run_id: event for event in RunEvent.objects.filter(match)} if latest else {}


def _run_actors(run: Run, placement: RunEvent | None) -> list[tuple[str, str]]:
    if placement is not None and isinstance(placement.payload, Mapping):
        return placement_actors(payload=placement.payload, default_host=run.host)
    plan = run.placement_plan if isinstance(run.placement_plan, Mapping) else {}
    reference = run.config.run_config.reference.enabled
    enabled = {role for role in PLACED_ROLES if role != "reference" or reference}
    return placement_actors(payload={k: v for k, v in plan.items() if k in enabled}, default_host=run.host)


@dataclass
class ClusterOverview:
    hosts: list[HostOverview]
    elsewhere: dict[str, list[RunOnHost]]  # runs on hosts no agent has registered, by host name
    unplaced: list[RunOnHost]  # active runs not on any host yet (launching)
    elsewhere_more: int = 0  # hosts outside the inventory past each run's ELSEWHERE_HOSTS_PER_RUN


def cluster_overview(*, viewer: User, now: datetime, stale_after_s: float) -> ClusterOverview:
    """Every host with its devices, heartbeat age, and the active runs placed on it.

    A run is on a host when the host is its `host`, a key of its `allocation`, or where its latest placement
    event (else its launch plan) puts an actor. Runs of projects the viewer cannot see are included with
    `visible=False` and no identifying detail, and their actors count only on inventory hosts: a host name that only
    their engine or config gives is that project's text. Runs on hosts missing from the inventory (a local run with
    no node agent) are listed under `elsewhere`, runs with no host at all under `unplaced`.
    """
    hosts = list(hosts_with_devices())
    inventory = {host.hostname for host in hosts}
    visible_projects = set(projects_for_user(user=viewer).values_list("pk", flat=True))
    runs = list(Run.objects.filter(state__in=ACTIVE_STATES).select_related("experiment__project", "config")
                .order_by("pk"))
    placements = _latest_placements(run_ids=[run.pk for run in runs])
    by_host: dict[str, list[RunOnHost]] = {}
    unplaced: list[RunOnHost] = []
    elsewhere_more = 0
    for run in runs:
        visible = run.experiment.project_id in visible_projects
        allocation = run.allocation if isinstance(run.allocation, Mapping) else {}
        actors: dict[str, list[str]] = {}
        for hostname, name in _run_actors(run, placements.get(run.pk)):
            actors.setdefault(hostname, []).append(name)
        placement = placements.get(run.pk)
        source = f"{placement.get_kind_display().lower()} #{placement.seq}" if placement else "launch plan"
        placed_on = [name for name in actors if visible or name in inventory]
        hostnames = [name for name in dict.fromkeys([run.host, *allocation, *placed_on]) if name]
        dropped = set([name for name in hostnames if name not in inventory][ELSEWHERE_HOSTS_PER_RUN:])
        elsewhere_more += len(dropped)
        hostnames = [name for name in hostnames if name not in dropped]
        for hostname in hostnames or [""]:
            reserved = allocation.get(hostname) if isinstance(allocation.get(hostname), Mapping) else {}
            placed = RunOnHost(
                run_id=run.pk, visible=visible, state=run.state,
                label=f"{run.experiment.name} #{run.number}" if visible else "another project",
                project_slug=run.experiment.project.slug if visible else "",
                gpus=reserved.get("gpus"), slots=reserved.get("slots"),
                actors=actors.get(hostname, [])[:ACTORS_SHOWN] if visible else [],
                actors_more=max(len(actors.get(hostname, [])) - ACTORS_SHOWN, 0) if visible else 0,
                placement_source=source if visible else "",
            )
            if hostname:
                by_host.setdefault(hostname, []).append(placed)
            else:
                unplaced.append(placed)
    overview = []
    for host in hosts:
        age = (now - host.last_heartbeat_at).total_seconds() if host.last_heartbeat_at else None
        overview.append(HostOverview(
            host=host, devices=list(host.devices.all()), heartbeat_age_s=age,
            stale=age is None or age > stale_after_s, runs=by_host.pop(host.hostname, []),
        ))
    return ClusterOverview(hosts=overview, elsewhere=dict(sorted(by_host.items())), unplaced=unplaced,
                           elsewhere_more=elsewhere_more)

def host_get(*, hostname: str) -> Host:
    host = Host.objects.filter(hostname=hostname).first() if hostname and is_db_text(hostname) else None
    if host is None:
        raise NotFound(f"no host {hostname[:255]!r}")
    return host
