"""What a run needs (processes and GPUs per role, from its config) and where that fits in the cluster's inventory,
now or ever; the scheduler (runs/scheduling.py) places queued runs with it, and the validation that launches refuses
with it what could never be scheduled.

A run that asks for GPUs holds healthy GPU devices on hosts that are up and healthy; a CPU-only run holds one of its
host's `LOCAL_RUN_SLOTS` (its controller process). With an empty inventory (one machine, no node agent) the worker's
own machine gives the slots.

Host names (`placement.<role>.hosts`, the rule documented on that field in workers/engine/config.py):
with `placement.local_hosts` they are the run's own simulated hosts, all on the one inventory host it
is given; on the monarch backend a generator's names that are not inventory hosts label procs on the
run's host; every other name is an inventory host the role is pinned to. `config_schedule_problems`
refuses at validation what could never be scheduled, so it is not queued to fail.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from django.conf import settings
from django.db.models import Count, Q

from forgeboard.accounts.models import Project
from forgeboard.cluster.models import DeviceKind, Health, Host, HostIntent, HostLiveness
from forgeboard.errors import FieldProblem
from forgeboard.runs.models import EXTERNAL_BACKENDS, LaunchBackend
from workers.engine.config import RunConfig

LOCAL_HOST = "(local)"
# Processes without a GPU one run may start: they are not counted as capacity (a CPU-only run takes one slot), so
# without a bound one config could start thousands on a shared host.
MAX_CPU_PROCESSES = 64
PROCESS_FIELDS = {"trainer": "trainer.ranks", "generator": "generator.replicas", "reference": "reference.replicas"}

Allocation = dict[str, dict[str, int]]


@dataclass(frozen=True)
class RoleDemand:
    role: str
    procs: int
    procs_per_host: int | None  # None: the trainer's ranks share one host; replicas go anywhere, several to a host
    gpus_per_proc: int
    hosts: tuple[str, ...] = ()
    labels: bool = False  # names that are not inventory hosts label procs on the run's host
    gpus_from: str = ""  # the config field that asks for its GPUs

    def pinned(self, *, known: Collection[str]) -> RoleDemand:
        """This role with only the names that pin it to inventory hosts (`known`): labels dropped."""
        return replace(self, hosts=tuple(h for h in self.hosts if h in known), labels=False) if self.labels else self

    @property
    def gpus(self) -> int:
        return self.procs * self.gpus_per_proc

    @property
    def group(self) -> int:
        """Procs placed together on one host (as the engine does)."""
        if self.procs_per_host is not None:
            return self.procs_per_host
        return self.procs if self.role == "trainer" else 1

    @property
    def distinct_hosts(self) -> bool:
        """Each group on a host of its own: procs_per_host caps the role's procs on one host."""
        return self.procs_per_host is not None

    def describe(self) -> str:
        where = f" on {', '.join(self.hosts)}" if self.hosts else ""
        if self.procs_per_host is not None:
            per_host = f", ≤{self.procs_per_host} per host"
        else:
            per_host = ", on one host" if self.group > 1 else ""
        return f"{self.role} {self.procs}×{self.gpus_per_proc} GPU{per_host}{where}"


@dataclass(frozen=True)
class Demand:
    roles: tuple[RoleDemand, ...]
    one_host: bool = False  # every proc on one inventory host (placement.local_hosts simulates the run's hosts there)

    @property
    def processes(self) -> int:
        return sum(role.procs for role in self.roles)

    @property
    def gpus(self) -> int:
        return sum(role.gpus for role in self.roles)

    @property
    def resource(self) -> str:
        """What the run competes for: "gpus" or, for a CPU-only run, "slots"."""
        return "gpus" if self.gpus else "slots"

    def describe(self) -> str:
        return "; ".join(role.describe() for role in self.roles if role.gpus)

    def pinned(self, *, known: Collection[str]) -> Demand:
        """The demand with host names resolved against the inventory's hosts (`known`): labels dropped."""
        return replace(self, roles=tuple(role.pinned(known=known) for role in self.roles))


def run_demand(config: RunConfig) -> Demand:
    """Processes and GPUs per role, from a validated config (a ConfigSnapshot's `run_config`).

    A trainer on `trainer.device: cuda` holds a GPU per rank even without placement gpus_per_proc. Host names as
    written: `Demand.pinned` resolves them against the inventory.
    """
    placement = config.placement
    simulated = bool(placement.local_hosts)
    labels = placement.backend == LaunchBackend.MONARCH and not simulated
    roles = []
    for role, count in config.role_processes().items():
        spec = getattr(placement, role)
        followed = spec.colocate_with  # its own procs, on the followed role's hosts
        hosts = getattr(placement, followed).hosts if followed else spec.hosts
        gpus_per_proc = spec.gpus_per_proc
        if role == "trainer" and config.trainer.device == "cuda":
            gpus_per_proc = max(gpus_per_proc, 1)
        if count:
            roles.append(RoleDemand(role=role, procs=count, procs_per_host=spec.procs_per_host,
                                    gpus_per_proc=gpus_per_proc, hosts=() if simulated else tuple(hosts),
                                    labels=labels and "generator" in (role, followed),
                                    gpus_from="trainer.device" if role == "trainer" and not spec.gpus_per_proc
                                    else f"placement.{role}.gpus_per_proc"))
    return Demand(roles=tuple(roles), one_host=simulated)


@dataclass
class HostRoom:
    gpus: int
    slots: int


def place(demand: Demand, room: Mapping[str, HostRoom]) -> Allocation | None:
    """Where the demand fits in `room`, or None. Greedy best fit, biggest groups first."""
    free = {name: HostRoom(r.gpus, r.slots) for name, r in room.items()}
    allocation: Allocation = {}
    if not demand.gpus:
        pinned = [set(role.hosts) for role in demand.roles if role.hosts]
        candidates = [name for name in sorted(free) if free[name].slots >= 1 and all(name in p for p in pinned)]
        if not candidates:
            return None
        host = max(candidates, key=lambda name: free[name].slots)
        return {host: {"gpus": 0, "slots": 1}}
    if demand.one_host:
        candidates = [name for name in sorted(free) if free[name].gpus >= demand.gpus]
        if not candidates:
            return None
        host = min(candidates, key=lambda name: free[name].gpus)
        return {host: {"gpus": demand.gpus, "slots": 0}}
    for role in sorted((r for r in demand.roles if r.gpus), key=lambda r: -r.group * r.gpus_per_proc):
        groups = [role.group] * (role.procs // role.group)
        if role.procs % role.group:
            groups.append(role.procs % role.group)
        used_by_role: set[str] = set()
        for procs in groups:
            need = procs * role.gpus_per_proc
            candidates = [name for name in sorted(free) if free[name].gpus >= need
                          and not (role.distinct_hosts and name in used_by_role)
                          and (not role.hosts or name in role.hosts)]
            if not candidates:
                return None
            host = min(candidates, key=lambda name: free[name].gpus)  # best fit keeps big hosts whole
            free[host].gpus -= need
            used_by_role.add(host)
            held = allocation.setdefault(host, {"gpus": 0, "slots": 0})
            held["gpus"] += need
    return allocation


def inventory(*, usable_only: bool) -> dict[str, HostRoom]:
    """Each host's GPUs and slots: usable now (up, schedulable, healthy, healthy GPUs) or in the whole inventory."""
    slots: int = settings.LOCAL_RUN_SLOTS
    if not Host.objects.exists():
        return {LOCAL_HOST: HostRoom(gpus=0, slots=slots)}
    hosts = Host.objects.all()
    gpu_filter = Q(devices__kind=DeviceKind.GPU)
    if usable_only:
        hosts = hosts.filter(liveness=HostLiveness.UP, intent=HostIntent.SCHEDULABLE, health=Health.HEALTHY)
        gpu_filter &= Q(devices__health=Health.HEALTHY)
    counted = hosts.annotate(gpus=Count("devices", filter=gpu_filter)).values_list("hostname", "gpus")
    return {hostname: HostRoom(gpus=gpus, slots=slots) for hostname, gpus in counted}


def _unknown_hosts(demand: Demand, whole: Mapping[str, HostRoom]) -> list[tuple[str, str]]:
    """(field, reason) for each role pinned to names that are not inventory hosts (of a demand `pinned` to it)."""
    problems = []
    for role in demand.roles:
        unknown = [name for name in role.hosts if name not in whole]
        if unknown:
            inventory = ", ".join(name for name in sorted(whole) if name != LOCAL_HOST) or "none"
            problems.append((f"placement.{role.role}.hosts",
                             f"names {', '.join(unknown)}: not in the cluster inventory (hosts: {inventory}); "
                             "simulated hosts are placement.local_hosts' host0, host1, ...; on placement.backend "
                             "monarch other names label generator procs on the run's host"))
    return problems


def never_fits(*, demand: Demand, project: Project | None, whole: Mapping[str, HostRoom]) -> str:
    """Why the run could not start even on an idle cluster, or "" if it could."""
    for where, reason in _never_fits_at(demand=demand, project=project, whole=whole):
        return f"{where} {reason}" if where.endswith(".hosts") else reason
    return ""


def _never_fits_at(*, demand: Demand, project: Project | None,
                   whole: Mapping[str, HostRoom]) -> list[tuple[str, str]]:
    """`never_fits`'s reason as (the field to change, reason); [] if the run could start on an idle cluster."""
    gpu_field = next((role.gpus_from for role in demand.roles if role.gpus), "placement")
    if project is not None and project.max_gpus is not None and demand.gpus > project.max_gpus:
        return [(gpu_field, f"needs {demand.gpus} GPUs but project {project.slug!r} may hold at most {project.max_gpus}")]
    if unknown := _unknown_hosts(demand, whole):
        return unknown
    cpu_roles = [role for role in demand.roles if not role.gpus_per_proc]
    cpu_processes = sum(role.procs for role in cpu_roles)
    if cpu_processes > MAX_CPU_PROCESSES:
        largest_role = max(cpu_roles, key=lambda role: role.procs)
        counts = ", ".join(f"{role.role} {role.procs}" for role in cpu_roles)
        return [(PROCESS_FIELDS.get(largest_role.role, "placement"),
                 f"starts {cpu_processes} processes without a GPU ({counts}); a run may start at most "
                 f"{MAX_CPU_PROCESSES}")]
    largest = max(r.gpus for r in whole.values())
    if demand.gpus and not largest:
        where = ("no node agent has registered a host, and this machine counts as one without GPUs"
                 if set(whole) == {LOCAL_HOST} else f"none of the {len(whole)} hosts of the cluster inventory has one")
        return [(gpu_field, f"needs {demand.gpus} GPU{'s' * (demand.gpus > 1)} ({demand.describe()}); the largest "
                            f"host has 0: {where}")]
    for role in demand.roles:
        if role.gpus and role.group * role.gpus_per_proc > largest:
            return [(f"placement.{role.role}", f"placement.{role.role} puts {role.group * role.gpus_per_proc} GPUs on "
                                               f"one host; the largest host has {largest}")]
    if demand.one_host and demand.gpus > largest:
        return [("placement.local_hosts", f"needs {demand.gpus} GPUs on one host (its simulated hosts share the run's "
                                          f"host); the largest host has {largest}")]
    if place(demand, whole) is None and not demand.gpus:
        return [("placement", "its roles are pinned to hosts with no host in common (a CPU-only run takes one slot "
                              "on one host)")]
    if place(demand, whole) is None:
        total = sum(r.gpus for r in whole.values())
        return [(gpu_field, f"needs {demand.gpus} GPUs ({demand.describe()}); the whole cluster ({len(whole)} hosts, "
                            f"{total} GPUs) cannot hold it")]
    return []


def config_schedule_problems(*, config: RunConfig, project: Project | None) -> list[FieldProblem]:
    """Why a valid config could never be scheduled on this cluster's inventory, at the field to change; [] if it could.

    The validation that launches and the live config check share (experiments/services.py) calls it, so such a run
    is refused with the reason before it is queued. A slurm or kubernetes run is placed by that cluster's scheduler.
    """
    if config.placement.backend in EXTERNAL_BACKENDS:
        return []
    whole = inventory(usable_only=False)
    demand = run_demand(config).pinned(known=whole)
    return [FieldProblem(f"config.{where}", reason) for where, reason in
            _never_fits_at(demand=demand, project=project, whole=whole)]
