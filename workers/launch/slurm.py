"""SLURM: a run as a `monarch.job.SlurmJob` in batch mode, and run states read from `squeue --json` / `sacct --json`.

Django-free. `slurm_job` builds the SlurmJob for a run (one node per host of the run, one Monarch worker
per node); `workers/launch/slurm_submit.py` applies it with the engine as its client script. Monarch
then writes the sbatch script itself (the directives below, the hosts' service identities, and its
batch runner: a worker on every node through `srun`, then the client on the first node with
MONARCH_BATCH_JOB=1), pickles the job into `.monarch/job_state.pkl` in the submitting directory (the
run's folder, which is also the job's working directory) and pipes the script to `sbatch`.

Inside the allocation the engine loads that file and attaches to the job's workers through
`job.state()` (FORGEBOARD_MONARCH_JOB=slurm; `workers/engine/actors/monarch_job.py`).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import PurePosixPath
from typing import Any, Literal

from workers.engine.actors.monarch_job import HOST_MESH
from workers.engine.env import (ALLOWED_PATHS_ENV, CONTROL_PLANE_URL_ENV, GPUS_PER_HOST_ENV, JOB_ENV, RUN_ID_ENV,
                                RUN_TOKEN_FILE_ENV, WORKERS_ENV)

__all__ = ["JobStillCompleting", "LaunchSpecError", "SchedulerStatus", "SlurmLaunchRequest", "slurm_job",
           "client_script", "parse_squeue", "parse_sacct", "slurm_job_status", "job_ids_for_run", "parse_sinfo"]

# --- shared with workers/launch/kubernetes.py ------------------------------------------------------

RunStateName = Literal["queued", "launching", "running", "succeeded", "failed", "lost"]
NO_KILL_ENV = "SLURM_NO_KILL"  # srun's --no-kill for a job's steps
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_ENVIRONMENT = frozenset({RUN_ID_ENV, CONTROL_PLANE_URL_ENV, RUN_TOKEN_FILE_ENV, WORKERS_ENV, JOB_ENV,
                                  GPUS_PER_HOST_ENV, ALLOWED_PATHS_ENV, NO_KILL_ENV})


class LaunchSpecError(ValueError):
    """A launch request or a scheduler document that cannot be used, naming the field and the reason."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class SchedulerStatus:
    """What the scheduler says about a run's job, as one of our run states (RunState values) and a reason."""

    state: RunStateName
    reason: str
    job_id: str = ""
    nodes: str = ""  # the scheduler's node list for the job (SLURM's host list syntax), where it has one
    # What SLURM still does for a job it has ended ("still stopping its processes on gpu-001 (COMPLETING)"): until it
    # is done the job's state is "running", since its processes may still run or its data (a checkpoint) still be
    # copied out, and a lost run's restart must not start beside them.
    ending: str = ""
    # Slurm 22.05 printed a flag in place of the job's base state, which may be one it has ended the job in (a job
    # scancelled while SLURM sent it a SIGSTOP says STOPPED until it leaves the queue): only sacct says which.
    base_unknown: bool = False
    # How many times SLURM has started the job again (requeued it: a node failure with --requeue, `scontrol requeue`).
    restarts: int = 0
    # When the scheduler started the job running (epoch seconds; None where it does not say): SLURM's start time of a
    # running job (its latest start, for a requeued one).
    started_at: float | None = None

    @property
    def terminal(self) -> bool:
        return self.state in ("succeeded", "failed", "lost")

    @property
    def completing(self) -> bool:
        """SLURM has ended the job but is not done with it yet (`ending` says what it still does)."""
        return bool(self.ending)


class JobStillCompleting(RuntimeError):
    """A job asked to stop has ended, but the scheduler is not done stopping it: SLURM still stops its processes, runs
    its epilog or stages its data out, or a Kubernetes Job's pods are still terminating. The stop is not confirmed."""


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LaunchSpecError(name, f"must be a positive integer, got {value!r}")


def check_environment(environment: Mapping[str, str], *, reserved: frozenset[str] = RESERVED_ENVIRONMENT) -> None:
    """A run's extra variables: valid names, text values, none of those the launcher sets itself (`reserved`)."""
    for key, value in environment.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise LaunchSpecError(f"environment.{key}", "is not a valid variable name")
        if key in reserved:
            raise LaunchSpecError(f"environment.{key}", "is set by Forgeboard itself")
        if not isinstance(value, str):
            raise LaunchSpecError(f"environment.{key}", "must be text")


def check_control_plane_url(url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise LaunchSpecError("control_plane_url", f"must be an http(s) URL, got {url!r}")


def engine_argv(*, python: str, config_path: str, overrides: Sequence[str]) -> list[str]:
    """The engine controller's command line, on any launcher."""
    return [python, "-m", "workers.engine", "train", "--config", config_path, *overrides]


def run_environment(*, run_id: int, control_plane_url: str, token_file: str,
                    extra: Mapping[str, str], allowed_paths: Sequence[str] = ()) -> dict[str, str]:
    """The variables every process of a run gets: who it is, where to report, its credential, and the paths its
    engine may use (FORGEBOARD_ALLOWED_PATHS, checked by its preflight; none given: unconfined)."""
    check_control_plane_url(control_plane_url)
    environment = {RUN_ID_ENV: str(run_id), CONTROL_PLANE_URL_ENV: control_plane_url, RUN_TOKEN_FILE_ENV: token_file,
                   **extra}
    if allowed_paths:
        environment[ALLOWED_PATHS_ENV] = json.dumps(list(allowed_paths))
    return environment


DEFAULT_MONARCH_PORT = 22222
_SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SLURM_MEMORY = re.compile(r"^[1-9][0-9]*[KMGT]?$")
_SLURM_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


@dataclass(frozen=True)
class SlurmLaunchRequest:
    run_id: int
    config_path: str  # on a filesystem every node sees
    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    memory: str  # per node, in sbatch's --mem units: "1600G"
    partition: str
    control_plane_url: str
    token_file: str  # the run token, readable by the job's user on every node
    log_dir: str
    venv: str | None = None  # a virtualenv every node sees (its python runs monarch's batch runner and workers)
    image: str | None = None  # refused: see check()
    overrides: tuple[str, ...] = ()  # section.key=value, passed to the engine
    environment: Mapping[str, str] = field(default_factory=dict)
    allowed_paths: tuple[str, ...] = ()  # what the engine's preflight accepts (FORGEBOARD_ALLOWED_PATHS)
    time_limit: str | None = None
    account: str | None = None
    qos: str | None = None
    monarch_port: int = DEFAULT_MONARCH_PORT
    nodelist: tuple[str, ...] = ()  # nodes the job must have (roles pinned to them); it may get others besides

    @property
    def job_name(self) -> str:
        return f"forgeboard-run-{self.run_id}"

    @property
    def python(self) -> str:
        return str(PurePosixPath(self.venv) / "bin" / "python") if self.venv else "python"

    def controller_argv(self) -> list[str]:
        return engine_argv(python=self.python, config_path=self.config_path, overrides=self.overrides)

    def check(self) -> None:
        check_positive("run_id", self.run_id)
        check_positive("nodes", self.nodes)
        check_positive("cpus_per_node", self.cpus_per_node)
        if not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool) or self.gpus_per_node < 0:
            raise LaunchSpecError("gpus_per_node", "must be an integer, 0 or more")
        if self.image is not None:
            raise LaunchSpecError("image", "container images are not supported: runs go through monarch.job's "
                                           "SlurmJob, whose batch runner starts the workers with a plain srun of the "
                                           "venv's python (pyxis applies --container-image to srun only); set venv")
        if self.venv is None:
            raise LaunchSpecError("venv", "a virtualenv every node sees is required")
        if not _SLURM_MEMORY.match(self.memory):
            raise LaunchSpecError("memory", f"{self.memory!r} is not an sbatch size such as 512G")
        for name in ("partition", "account", "qos"):
            value = getattr(self, name)
            if value is not None and not _SLURM_NAME.match(value):
                raise LaunchSpecError(name, f"{value!r} is not a SLURM name")
        if self.time_limit is not None and not _SLURM_TIME.match(self.time_limit):
            raise LaunchSpecError("time_limit", f"{self.time_limit!r} is not a SLURM time such as 1-00:00:00")
        for name in ("config_path", "token_file", "log_dir", "venv"):
            value = getattr(self, name)
            if value is not None and not PurePosixPath(value).is_absolute():
                raise LaunchSpecError(name, f"must be an absolute path, got {value!r}")
        if not 1024 <= self.monarch_port <= 65535:
            raise LaunchSpecError("monarch_port", f"must be from 1024 to 65535, got {self.monarch_port}")
        for index, node in enumerate(self.nodelist):
            if not isinstance(node, str) or not _SLURM_NAME.match(node):
                raise LaunchSpecError(f"nodelist.{index}", f"{node!r} is not a SLURM node name")
        if len(self.nodelist) > self.nodes:
            raise LaunchSpecError("nodelist", f"names {len(self.nodelist)} nodes for a job of {self.nodes}")
        check_environment(self.environment)
        check_control_plane_url(self.control_plane_url)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "overrides": list(self.overrides), "environment": dict(self.environment),
                "allowed_paths": list(self.allowed_paths), "nodelist": list(self.nodelist)}

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> SlurmLaunchRequest:
        return cls(**{**document, "overrides": tuple(document.get("overrides", ())),
                      "environment": dict(document.get("environment", {})),
                      "allowed_paths": tuple(document.get("allowed_paths", ())),
                      "nodelist": tuple(document.get("nodelist", ()))})


def run_comment(run_id: int) -> str:
    """The job's --comment: how `job_ids_for_run` finds a run's jobs in squeue."""
    return f"forgeboard-run-id={run_id}"


def job_environment(request: SlurmLaunchRequest) -> dict[str, str]:
    """What the job's processes get from the submitting process (sbatch exports its environment), besides PATH."""
    environment = run_environment(run_id=request.run_id, control_plane_url=request.control_plane_url,
                                  token_file=request.token_file, extra=request.environment,
                                  allowed_paths=request.allowed_paths)
    environment[JOB_ENV] = "slurm"  # the engine takes its workers from the job
    # srun's --no-kill for the job's steps (monarch's batch runner starts the workers' step with a plain srun): a
    # failed node must not end the step that runs the other nodes' workers either.
    environment[NO_KILL_ENV] = "set"  # what srun takes for "on"
    if request.gpus_per_node:  # the engine hands them to procs (placement gpus_per_proc)
        environment[GPUS_PER_HOST_ENV] = str(request.gpus_per_node)
    return environment


def client_script(request: SlurmLaunchRequest) -> str:
    """The command monarch's batch runner starts on the first node once the workers are up: the engine."""
    return shlex.join(request.controller_argv())


def slurm_job(request: SlurmLaunchRequest) -> Any:
    """The run's `monarch.job.SlurmJob` (not applied): every node a host, the run's resources and accounting."""
    request.check()
    from monarch.job import SlurmJob

    # --no-kill: a failed node does not end the job; the engine fails over what ran there (or fails the run, saying
    # why), as it does for a lost host anywhere.
    slurm_args = [f"--comment={run_comment(request.run_id)}", "--no-kill"]
    if request.nodelist:
        slurm_args.append(f"--nodelist={','.join(request.nodelist)}")
    return SlurmJob(
        meshes={HOST_MESH: request.nodes},
        python_exe=request.python,
        slurm_args=slurm_args,
        monarch_port=request.monarch_port,
        job_name=request.job_name,
        time_limit=request.time_limit,
        partition=request.partition,
        log_dir=request.log_dir,
        exclusive=True,
        gpus_per_node=request.gpus_per_node or None,
        cpus_per_task=request.cpus_per_node,
        mem=request.memory,
        account=request.account,
        qos=request.qos,
    )


# --- run states from SLURM's JSON ----------------------------------------------------------------

# A SLURM job has one base state and any of a set of flags (slurm.h: `job_states`, JOB_STATE_FLAGS). Slurm 23.02+ lists
# both ("state": ["CANCELLED", "COMPLETING"]); 22.05 and older give one word: the first flag set, in job_state_string's
# order, else the base state (a job SLURM is ending says COMPLETING, not how it ended). What each means for a run:
_BASE_STATES = ("PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY")
# SLURM has ended the job but is not done with it: its processes may still run (COMPLETING: it stops them, then runs
# the epilog), its burst buffer's data (a checkpoint, say) is still being copied out (STAGE_OUT), or it checks whether
# to requeue it (EXPEDITING, 25.11). Whatever the base state says, the job has not ended for a restart yet.
_ENDING = {"COMPLETING": "still stopping its processes on {nodes} (COMPLETING)",
           "STAGE_OUT": "still staging out its burst buffer data (STAGE_OUT)",
           "EXPEDITING": "still checking whether to requeue it (EXPEDITING)"}
# The job waits in the queue to run (again), whatever the base state says: requeued, or held until someone releases it
# (`scontrol release`).
_WAITING = {"SPECIAL_EXIT": "requeued and held after a special exit (SPECIAL_EXIT) until released",
            "REQUEUE_HOLD": "requeued and held until released (REQUEUE_HOLD)",
            "RESV_DEL_HOLD": "held until released: its reservation was deleted (RESV_DEL_HOLD)",
            "REQUEUE_FED": "requeued by its federation (REQUEUE_FED)",
            "REQUEUED": "requeued"}
# SLURM has given the job its nodes and is still setting them up: powering them up, booting them, or running
# slurmctld's prolog. Nothing of the run runs yet.
_STARTING = {"POWER_UP_NODE": "SLURM is powering up the job's nodes {nodes} (POWER_UP_NODE)",
             "CONFIGURING": "SLURM is setting up the job's nodes {nodes}: booting them or running its prolog "
                            "(CONFIGURING)"}
# Another cluster of the job's federation runs it, or may: it has not ended.
_REVOKED = "revoked on this cluster: another cluster of its federation runs it (REVOKED)"
# The job runs (its processes hold their nodes), with something to say about it.
_RUNNING = {"STOPPED": "stopped by SIGSTOP on {nodes}: its processes are frozen, its nodes held (STOPPED)",
            "SIGNALING": "running on {nodes}; SLURM is sending it a signal (SIGNALING)",
            "RESIZING": "running on {nodes}; SLURM is changing its size (RESIZING)"}
# Flags that change nothing for a run: its accounting record is being sent, or an earlier launch or node set-up failed
# (the base state says what became of the job).
_NOTES = ("UPDATE_DB", "LAUNCH_FAILED", "RECONFIG_FAIL")
_FLAGS = frozenset((*_ENDING, *_WAITING, *_STARTING, "REVOKED", *_RUNNING, *_NOTES))
# The flags Slurm 22.05 and older print in place of the base state (the others they never print).
_BARE_FLAGS = frozenset(("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED",
                         "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING"))
_HELD_REASONS = ("JobHeldUser", "JobHeldAdmin")


def _states(value: Any) -> list[str]:
    # Slurm 23.02+ gives a list of state and flags; older releases a single string such as "CANCELLED by 1000".
    if isinstance(value, str):
        return value.split()[:1]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise LaunchSpecError("job_state", f"unreadable SLURM state {value!r}")


def _number(value: Any) -> int | None:
    # Slurm 23.02+ wraps numbers as {"set": bool, "infinite": bool, "number": int}.
    if isinstance(value, dict):
        return value.get("number") if value.get("set", True) and not value.get("infinite", False) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _exit(record: Mapping[str, Any]) -> tuple[int | None, str | None]:
    exit_code = record.get("exit_code")
    if not isinstance(exit_code, dict):
        # Slurm 22.05 and older: squeue gives the batch script's wait status (code << 8 | signal number).
        status = _number(exit_code)
        if status is None:
            return None, None
        return status >> 8, (f"{status & 0x7F}" if status & 0x7F else None)
    signal = exit_code.get("signal") or {}
    signal_name = signal.get("name") if isinstance(signal, dict) else None
    return _number(exit_code.get("return_code")), signal_name or None


def slurm_job_status(record: Mapping[str, Any]) -> SchedulerStatus:
    """One job record of `squeue --json` or `sacct --json` as a run state with a reason a person can read."""
    nodes = record.get("nodes")
    nodes = nodes if isinstance(nodes, str) and nodes != "None assigned" else ""  # sacct's words for none
    state = record.get("state")
    base, flags = _base_and_flags(_states(state.get("current") if isinstance(state, dict) else record.get("job_state")))
    status = _slurm_job_status(record, base=base, flags=flags, nodes=nodes)
    restarts = _number(record.get("restart_cnt")) or 0
    if restarts and status.state in ("queued", "launching") and "requeued" not in status.reason:
        status = replace(status, reason=f"requeued by SLURM (restart {restarts}): {status.reason}")
    # A pending job's start_time is SLURM's estimate of when it will start: read only for a running one. 0 is unset.
    started_at = (_number(record.get("start_time")) or None) if status.state == "running" else None
    return replace(status, nodes=nodes, base_unknown=base is None and not status.completing, restarts=restarts,
                   started_at=started_at)


def _slurm_job_status(record: Mapping[str, Any], *, base: str | None, flags: list[str], nodes: str) -> SchedulerStatus:
    state = record.get("state")
    reason = state.get("reason", "") if isinstance(state, dict) else record.get("state_reason", "")
    reason = "" if reason in (None, "None") else str(reason)
    job_id = str(record.get("job_id", ""))
    where = nodes or "its nodes"
    ending = next((text.format(nodes=where) for flag, text in _ENDING.items() if flag in flags), None)
    if ending is not None:
        return SchedulerStatus("running", f"SLURM is ending the job: {ending}", job_id, ending=ending)
    waiting = next((text for flag, text in _WAITING.items() if flag in flags), None)
    if waiting is not None:
        return SchedulerStatus("queued", f"{waiting} ({reason})" if reason else waiting, job_id)
    if base not in (None, "PENDING", "RUNNING", "SUSPENDED"):
        return _ended(record, base=base, reason=reason, nodes=nodes, job_id=job_id)
    starting = next((text for flag, text in _STARTING.items() if flag in flags), None)
    if starting is not None:
        return SchedulerStatus("launching", starting.format(nodes=where), job_id)
    if "REVOKED" in flags:
        return SchedulerStatus("running", _REVOKED, job_id)
    if base == "PENDING":
        why = "held in the SLURM queue until released" if reason in _HELD_REASONS else "waiting in the SLURM queue"
        return SchedulerStatus("queued", f"{why} ({reason})" if reason else why, job_id)
    if base == "SUSPENDED":
        return SchedulerStatus("running", "suspended by SLURM; it resumes where it stopped", job_id)
    running = next((text for flag, text in _RUNNING.items() if flag in flags), None)
    if running is not None:
        return SchedulerStatus("running", running.format(nodes=where), job_id)
    return SchedulerStatus("running", f"running on {nodes}" if nodes else "running", job_id)


def _base_and_flags(states: list[str]) -> tuple[str | None, list[str]]:
    """The job's base state (None where Slurm 22.05 printed a flag in its place) and its flags. A word this code does
    not know (a state a later Slurm adds) makes the whole state unreadable, named: what it means for the run is not
    known, so neither is whether the job has ended."""
    bases = [s for s in states if s in _BASE_STATES]
    flags = [s for s in states if s in _FLAGS]
    if not states or len(bases) + len(flags) < len(states) or len(bases) > 1 or not (bases or _BARE_FLAGS & set(flags)):
        raise LaunchSpecError("job_state", f"unknown SLURM job state {states!r}")
    return (bases[0] if bases else None), flags


def _ended(record: Mapping[str, Any], *, base: str, reason: str, nodes: str, job_id: str) -> SchedulerStatus:
    """A job SLURM has ended and is done with, by its base state."""
    code, signal = _exit(record)
    if base == "COMPLETED":
        return SchedulerStatus("succeeded", "the job completed with exit code 0", job_id)
    if base == "FAILED":
        # Slurm 22.05's sacct records a failed batch script's exit code as 0: then there is no code to give.
        detail = f" with signal {signal}" if signal else f" with exit code {code}" if code else ""
        return SchedulerStatus("failed", f"the job failed{detail}" + (f" ({reason})" if reason else ""), job_id)
    if base == "CANCELLED":
        return SchedulerStatus("failed", "the SLURM job was cancelled" + (f" ({reason})" if reason else ""), job_id)
    if base == "TIMEOUT":
        time = record.get("time")
        limit = _number(time.get("limit") if isinstance(time, dict) else record.get("time_limit"))
        of_limit = f" of {limit} minutes" if limit else ""
        return SchedulerStatus("failed", f"the job hit its time limit{of_limit}", job_id)
    if base == "DEADLINE":
        return SchedulerStatus("failed", "the job missed its deadline", job_id)
    if base == "OUT_OF_MEMORY":
        return SchedulerStatus("failed", "the job ran out of host memory (OUT_OF_MEMORY)", job_id)
    if base == "NODE_FAIL":
        return SchedulerStatus("lost", f"a node of the job failed ({nodes}); restart from the last checkpoint"
                               if nodes else "a node of the job failed; restart from the last checkpoint", job_id)
    if base == "PREEMPTED":
        return SchedulerStatus("lost", "preempted by a higher-priority job; restart from the last checkpoint", job_id)
    return SchedulerStatus("lost", "SLURM could not boot the job's nodes", job_id)  # BOOT_FAIL


def _jobs(document: Mapping[str, Any], source: str) -> list[Mapping[str, Any]]:
    errors = document.get("errors") or []
    if errors:
        messages = "; ".join(str(e.get("description") or e.get("error") or e) for e in errors)
        raise LaunchSpecError(source, f"SLURM reported errors: {messages}")
    jobs = document.get("jobs")
    if not isinstance(jobs, list):
        raise LaunchSpecError(source, "no 'jobs' list in the document")
    return jobs


def parse_squeue(document: Mapping[str, Any], *, job_id: str | None = None) -> dict[str, SchedulerStatus]:
    """`squeue --json`: the status of each listed job, by job id; with `job_id`, of that job alone (Slurm 22.05 lists
    every job whatever --jobs says, and another job's record must not make this one's unreadable). A job missing here
    has left the queue."""
    return {str(job["job_id"]): slurm_job_status(job) for job in _jobs(document, "squeue")
            if job_id is None or str(job.get("job_id")) == job_id}


def parse_sacct(document: Mapping[str, Any]) -> dict[str, SchedulerStatus]:
    """`sacct --json`: the status of each job, by job id; for a requeued job, its latest record."""
    return {str(job["job_id"]): slurm_job_status(job) for job in _jobs(document, "sacct")}


def parse_sinfo(document: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """`sinfo --json`: each node's state as a person reads it ("idle", "down (not responding)") and SLURM's reason.
    Slurm 22.05 gives the state as text beside a list of flags; 23.02+ as one list of state and flags."""
    errors = document.get("errors") or []
    if errors:
        raise LaunchSpecError("sinfo", "SLURM reported errors: " + "; ".join(
            str(e.get("description") or e.get("error") or e) for e in errors))
    nodes = document.get("nodes")
    if not isinstance(nodes, list):
        raise LaunchSpecError("sinfo", "no 'nodes' list in the document")
    view = {}
    for node in nodes:
        state = node.get("state")
        words = [state] if isinstance(state, str) else list(state) if isinstance(state, list) else []
        words += [f for f in node.get("state_flags") or [] if isinstance(f, str)]
        if not isinstance(node.get("name"), str) or not words or not all(isinstance(w, str) for w in words):
            raise LaunchSpecError("sinfo", f"unreadable node record {str(node)[:200]}")
        base, flags = words[0].lower(), [w.lower().replace("_", " ") for w in words[1:] if w.lower() != words[0].lower()]
        view[node["name"]] = (f"{base} ({', '.join(flags)})" if flags else base, str(node.get("reason") or ""))
    return view


def job_ids_for_run(document: Mapping[str, Any], run_id: int) -> Sequence[str]:
    """The SLURM jobs whose comment names this run (set by `slurm_job`)."""
    tag = run_comment(run_id)
    found = []
    for job in _jobs(document, "squeue"):
        comment = job.get("comment")
        text = comment.get("job", "") if isinstance(comment, dict) else (comment or "")
        if text == tag:
            found.append(str(job["job_id"]))
    return found
