"""Where a Monarch run's procs go: the workers a caller named, those of the run's monarch.job (a SLURM or
Kubernetes job), those in FORGEBOARD_MONARCH_WORKERS, or this machine; and the failure reports of its procs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import workers.engine.actors  # noqa: F401 - sets monarch's supervision poll before monarch is imported
import monarch.actor  # noqa: I001

from workers.engine.actors.hosts import Hosts, check_placement, workers_from_env
from workers.engine.actors.monarch_job import job_kind
from workers.engine.actors.worker import Worker
from workers.engine.config import RunConfig
from workers.engine.drills import DrillPlan
from workers.engine.metrics import Recorder
from workers.engine.run_control import RunControl
from workers.engine.startup import StartupPhases

ATTACH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class HostSource:
    from_job: str | None  # the monarch.job kind the workers come from, once attached
    workers: list[Worker]  # named workers (none: this machine's procs, or the job's)


def host_source(config: RunConfig, workers: Sequence[Worker] | None) -> HostSource:
    """`workers`: the Monarch workers to place procs on; None: those of the run's monarch.job (FORGEBOARD_MONARCH_JOB),
    else those in FORGEBOARD_MONARCH_WORKERS. Named workers are checked against the placement now; a job's once
    attached."""
    from_job = job_kind() if workers is None else None
    named = [] if from_job else workers_from_env() if workers is None else list(workers)
    check_placement(config.placement, workers=named)
    return HostSource(from_job=from_job, workers=named)


def attach_hosts(config: RunConfig, recorder: Recorder, *, source: HostSource) -> Hosts:
    if source.from_job:
        hosts = Hosts.from_job(kind=source.from_job, timeout_s=ATTACH_TIMEOUT_S)
        check_placement(config.placement, workers=list(hosts.workers.values()))
    else:
        hosts = Hosts.attach(workers=source.workers, timeout_s=ATTACH_TIMEOUT_S)
    if hosts.workers:
        of_job = f"of the {source.from_job} job " if source.from_job else ""
        recorder.event("message", step=0, text=f"attached to {len(hosts.workers)} Monarch workers {of_job}"
                       f"({', '.join(hosts.describe(n) for n in hosts.names)}) in {hosts.attach_seconds} s")
    return hosts


def collect_fault_reports() -> list[Any]:
    """A proc that dies must not kill this controller (monarch's default exits the client): its failure reports are
    kept, for the supervisor to read."""
    reports: list[Any] = []
    monarch.actor.unhandled_fault_hook = reports.append
    return reports


Result = TypeVar("Result", covariant=True)


class MonarchRun(Protocol[Result]):
    """A recipe's wired parts (`recipes/grpo_monarch.py`, `recipes/sft_monarch.py`)."""

    def __init__(self, config: RunConfig, recorder: Recorder, *, hosts: Hosts, plan: DrillPlan,
                 control: RunControl | None, fault_reports: list[Any]) -> None: ...

    def start(self, startup: StartupPhases) -> None: ...

    def train(self) -> Result: ...

    def stop(self) -> None: ...


def train_on_hosts(run_class: type[MonarchRun[Result]], config: RunConfig, recorder: Recorder, *, source: HostSource,
                   plan: DrillPlan, control: RunControl | None, startup: StartupPhases) -> Result:
    """Attach the run's hosts, wire the recipe's parts, start and train; every proc and worker stopped after."""
    fault_reports = collect_fault_reports()
    hosts, run = Hosts(), None
    try:
        hosts = attach_hosts(config, recorder, source=source)
        run = run_class(config, recorder, hosts=hosts, plan=plan, control=control, fault_reports=fault_reports)
        run.start(startup)
        return run.train()
    finally:
        if run is not None:
            run.stop()
        hosts.stop()
