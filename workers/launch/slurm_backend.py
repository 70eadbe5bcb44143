"""The SLURM launch backend: submit a claimed run as a monarch.job SlurmJob, follow its job, cancel it with scancel.

A run whose config says `placement.backend: slurm` is queued by SLURM, not placed on the inventory:
the scheduler claims it at once (within the project's quotas) and a worker configured for SLURM
(`FORGEBOARD_SLURM_PARTITION` and the other `SLURM_*` settings) applies the run's SlurmJob
(`workers/launch/slurm.py`) with the engine as its client, in a process of its own
(`workers/launch/slurm_submit.py`). `runs.poll_jobs` then reads `squeue --json` (and `sacct --json` once
the job has left the queue) and moves the run: a job that failed, timed out or was preempted fails or
loses the run with SLURM's reason, and a run cancelled while its job waits in the queue is
scancelled. A running engine reports its own progress and end through the API, as a local one does.
A lost run's job is scancelled (`stop_slurm_job`, asked by the reconciler) before the run restarts as a new job.

The run's folder (config, token, logs, the pickled job) is under FORGEBOARD_DATA_DIR, which must be on
a filesystem every node sees.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.utils import timezone

from forgeboard.cluster.models import Host, scheduler_state_unavailable
from forgeboard.cluster.services import hosts_record_scheduler_view
from forgeboard.runs.models import LaunchBackend, Run
from forgeboard.telemetry.models import EventKind
from forgeboard.telemetry.services import event_append
from workers.engine.actors.monarch_job import MonarchJobError, expand_hostlist
from workers.launch.jobs import (FOLLOWED_STATES, fail_launch, follow_job, last_job_status, named_hosts, node_shape,
                                 record_job_status)
from workers.launch.local import engine_allowed_paths, run_dir, write_run_files
from workers.launch.slurm import (JobStillCompleting, LaunchSpecError, SchedulerStatus, SlurmLaunchRequest,
                                  job_environment, job_ids_for_run, parse_sacct, parse_sinfo, parse_squeue)

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 60
SUBMIT_TIMEOUT_S = 120  # the submitting process imports monarch before it runs sbatch
# This code's own checkout first on the submitting process's path, without a PYTHONPATH that sbatch would hand on.
SUBMIT_CODE = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
               "from workers.launch.slurm_submit import main; sys.exit(main())")


class SlurmCommandFailed(RuntimeError):
    """sbatch, squeue, sacct or scancel exited non-zero, or could not be run: the reason says which and why."""


class SubmitTimedOut(SlurmCommandFailed):
    """sbatch did not answer in time: it may still have queued the job."""


@dataclass(frozen=True)
class SlurmCli:
    """Runs SLURM's commands (from `bin_dir`, else from PATH) and returns what they print."""

    bin_dir: str | None = None

    def path(self) -> str:
        """PATH for processes that run SLURM's commands themselves (monarch's SlurmJob calls them by name)."""
        system = os.environ.get("PATH", os.defpath)
        return f"{self.bin_dir}{os.pathsep}{system}" if self.bin_dir else system

    def submit(self, request: SlurmLaunchRequest, *, folder: Path) -> str:
        """Apply the run's SlurmJob from `folder` with the job's environment; the SLURM job id."""
        environment = {"PATH": self.path(), "HOME": os.environ.get("HOME", str(folder)),
                       "LANG": os.environ.get("LANG", "C.UTF-8"), **job_environment(request)}
        if os.environ.get("SLURM_CONF"):  # a cluster whose slurm.conf is not in SLURM's default place
            environment["SLURM_CONF"] = os.environ["SLURM_CONF"]
        try:
            done = subprocess.run([sys.executable, "-c", SUBMIT_CODE], input=json.dumps(request.to_json()),
                                  cwd=folder, env=environment, capture_output=True, text=True,
                                  timeout=SUBMIT_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise SubmitTimedOut(f"sbatch did not answer within {SUBMIT_TIMEOUT_S} s") from None
        except OSError as exc:
            raise SlurmCommandFailed(f"the submission could not be run: {exc}") from None
        lines = done.stdout.strip().splitlines()
        try:
            answer = json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            answer = {}
        if done.returncode != 0 or not isinstance(answer, dict) or "job_id" not in answer:
            error = answer.get("error") if isinstance(answer, dict) else None
            detail = error or (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise SlurmCommandFailed(detail[:500])
        job_id = str(answer["job_id"])
        if not job_id.isdigit():
            raise SlurmCommandFailed(f"sbatch answered {job_id!r}, not a job id")
        return job_id

    def _run(self, name: str, *args: str, stdin: str | None = None) -> str:
        program = str(Path(self.bin_dir) / name) if self.bin_dir else (shutil.which(name) or name)
        try:
            done = subprocess.run([program, *args], input=stdin, capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmCommandFailed(f"{name} could not be run: {exc}") from None
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SlurmCommandFailed(f"{name} exited with {done.returncode}: {detail[0][:500]}")
        return done.stdout

    def queue(self, job_id: str) -> dict[str, SchedulerStatus]:
        """The job's status while it is in the queue; {} once it has left (squeue says the id is invalid)."""
        try:
            document = self._json("squeue", "--json", f"--jobs={job_id}")
        except SlurmCommandFailed as exc:
            if "invalid job id" in str(exc).lower():
                return {}
            raise
        errors = " ".join(str(e.get("error") or e.get("description") or "") for e in document.get("errors") or [])
        if "invalid job id" in errors.lower():
            return {}
        return parse_squeue(document, job_id=job_id)

    def jobs_of_run(self, run_id: int) -> Sequence[str]:
        """The queued or running jobs whose comment names the run (every job submitted for it carries one)."""
        return job_ids_for_run(self._json("squeue", "--json"), run_id)

    def accounting(self, job_id: str, *, in_queue: bool = False) -> dict[str, SchedulerStatus]:
        """The job's status in accounting, by job id. A job still in the queue may have no record there yet (sacct says
        "Nothing found" until SLURM starts it): `in_queue` takes that for {}. For a job gone from the queue it stays an
        error: accounting that lags must not make the job one SLURM does not know."""
        document = self._json("sacct", "--json", f"--jobs={job_id}")
        errors = [str(e.get("description") or e.get("error") or "") for e in document.get("errors") or []]
        if in_queue and errors and all(error == "Nothing found" for error in errors):
            return {}
        return parse_sacct(document)

    def nodes(self) -> dict[str, tuple[str, str]]:
        """Every node's state and SLURM's reason for it, by node name (sinfo)."""
        return parse_sinfo(self._json("sinfo", "--json"))

    def cancel(self, job_id: str) -> None:
        self._run("scancel", job_id)

    def _json(self, name: str, *args: str) -> dict[str, Any]:
        out = self._run(name, *args)
        try:
            document = json.loads(out)
        except json.JSONDecodeError as exc:
            raise SlurmCommandFailed(f"{name} did not print JSON ({exc.msg} at {exc.pos})") from None
        if not isinstance(document, dict):
            raise SlurmCommandFailed(f"{name} printed JSON that is not an object")
        return document


def slurm_configured() -> bool:
    return bool(settings.SLURM_PARTITION)


def slurm_cli() -> SlurmCli:
    return SlurmCli(bin_dir=settings.SLURM_BIN_DIR)


def slurm_request(*, run: Run, folder: Path) -> SlurmLaunchRequest:
    """The sbatch request for a run: nodes enough for its GPUs, the worker's SLURM settings."""
    nodes, gpus_per_node = node_shape(run=run, gpus_per_node=settings.SLURM_GPUS_PER_NODE)
    nodelist = named_hosts(run=run)
    return SlurmLaunchRequest(
        run_id=run.pk, config_path=str(folder / "config.yaml"), nodes=max(nodes, len(nodelist)), nodelist=nodelist,
        gpus_per_node=gpus_per_node, cpus_per_node=settings.SLURM_CPUS_PER_NODE, memory=settings.SLURM_MEMORY,
        partition=settings.SLURM_PARTITION, control_plane_url=settings.PUBLIC_URL, token_file=str(folder / "run_token"),
        log_dir=str(folder / "slurm"), venv=settings.SLURM_VENV, image=settings.SLURM_IMAGE,
        time_limit=settings.SLURM_TIME_LIMIT, account=settings.SLURM_ACCOUNT, qos=settings.SLURM_QOS,
        monarch_port=settings.SLURM_MONARCH_PORT,
        allowed_paths=tuple(engine_allowed_paths(run=run, run_folder=str(folder))),
    )


def submit_slurm(*, run: Run, cli: SlurmCli | None = None) -> str:
    """Write the run's files, apply its SlurmJob and record the job id; a refused submission fails the run."""
    cli = cli or slurm_cli()
    folder = run_dir(run).resolve()
    try:
        request = slurm_request(run=run, folder=folder)
        request.check()
    except LaunchSpecError as exc:
        fail_launch(run=run, reason=f"SLURM launch settings: {exc}")
        return ""
    (folder / "slurm").mkdir(parents=True, exist_ok=True)
    write_run_files(run=run, folder=folder)
    found = False
    try:
        job_id = cli.submit(request, folder=folder)
    except SlurmCommandFailed as exc:
        job_id = _queued_anyway(run=run, cli=cli) if isinstance(exc, SubmitTimedOut) else ""
        if not job_id:
            fail_launch(run=run, reason=f"SLURM refused the job: {exc}")
            return ""
        found = True
    Run.objects.filter(pk=run.pk).update(job_id=job_id, log_path=str(folder / "slurm"))
    payload = {"name": "job_submitted", "backend": "slurm", "job_id": job_id, "nodes": request.nodes,
               "gpus_per_node": request.gpus_per_node, "partition": request.partition}
    if found:
        payload["found"] = "sbatch did not answer in time; the job was found in squeue by the run's comment"
    event_append(run=run, kind=EventKind.MESSAGE, payload=payload)
    logger.info("run %s submitted as SLURM job %s", run.pk, job_id, extra={"run_id": run.pk})
    return job_id


def _queued_anyway(*, run: Run, cli: SlurmCli) -> str:
    """The job sbatch queued for the run before it went quiet, if squeue has it (the newest); "" when none."""
    try:
        found = cli.jobs_of_run(run.pk)
    except (SlurmCommandFailed, LaunchSpecError) as exc:
        logger.warning("run %s: squeue could not be asked for its job: %s", run.pk, exc, extra={"run_id": run.pk})
        return ""
    return max(found, key=int, default="")


def job_status(*, job_id: str, cli: SlurmCli) -> SchedulerStatus | None:
    """The job's status: from the queue while it is there, then from accounting (None: SLURM knows no such job).

    Where Slurm 22.05's squeue gives a flag in place of the job's base state (`base_unknown`) accounting says whether
    SLURM has ended the job: a job scancelled while SLURM sent it a SIGSTOP says STOPPED until it leaves the queue.
    SLURM is done with it then (a job it still stops the processes of says COMPLETING, which squeue gives first)."""
    queued = cli.queue(job_id).get(job_id)
    if queued is not None and not queued.base_unknown:
        return queued
    if queued is None:
        return cli.accounting(job_id).get(job_id)
    accounted = cli.accounting(job_id, in_queue=True).get(job_id)
    return accounted if accounted is not None and accounted.terminal else queued


def stop_slurm_job(*, job_id: str, cli: SlurmCli | None = None) -> str | None:
    """scancel a lost run's job unless SLURM has ended it; what was done, or None while SLURM still runs it.

    A job SLURM has ended is gone only once SLURM is done with it (`SchedulerStatus.ending`): while it is COMPLETING
    its processes may still run on its nodes (SLURM gives them KillWait after the SIGTERM), or its epilog, and sacct
    already says how it ended; while it is in STAGE_OUT its burst buffer's data is still being copied out.
    Raises JobStillCompleting until then, SlurmCommandFailed (SLURM cannot be asked) and LaunchSpecError (its
    answer is unreadable: a state this code does not know).
    """
    cli = cli or slurm_cli()
    status = job_status(job_id=job_id, cli=cli)
    if status is None or status.terminal:
        return f"SLURM job {job_id} had ended" + (f" ({status.reason})" if status else "")
    if not status.completing:
        cli.cancel(job_id)
        status = job_status(job_id=job_id, cli=cli)
        if status is None or status.terminal:
            return f"SLURM job {job_id} cancelled"
    if status.completing:
        raise JobStillCompleting(f"SLURM job {job_id} has ended, but SLURM is {status.ending}")
    return None


def _node_view(cli: SlurmCli) -> dict[str, tuple[str, str]]:
    """SLURM's view of its nodes, also written onto the inventory's hosts of those names ({} when sinfo fails)."""
    try:
        view = cli.nodes()
    except (SlurmCommandFailed, LaunchSpecError) as exc:
        logger.warning("sinfo: %s", exc)
        return {}
    hosts_record_scheduler_view(nodes=view, now=timezone.now())
    return view


def _nodes_down(*, status: SchedulerStatus | None, last: Mapping[str, Any], view: dict[str, tuple[str, str]]
                ) -> dict[str, str]:
    """The job's nodes that SLURM has down, drained or failing, each with its state and reason: those it has now and
    those it had at the last poll (`last`, its job_status) or had down then (a job submitted --no-kill loses a failed
    node from its list)."""
    try:
        names = {*expand_hostlist(status.nodes if status else ""), *expand_hostlist(str(last.get("nodes") or ""))}
    except MonarchJobError:
        return {}
    names |= set(last.get("nodes_down") or {})
    return {name: ": ".join(filter(None, view[name])) for name in sorted(names)
            if name in view and scheduler_state_unavailable(view[name][0])}


def poll_slurm_runs(*, cli: SlurmCli | None = None) -> dict[int, str]:
    """Move each followed SLURM run by what SLURM says of its job; what was done, by run id. SLURM's view of the
    job and of its nodes is recorded on the run (a job_status event when it changes) and on the hosts."""
    cli = cli or slurm_cli()
    done: dict[int, str] = {}
    runs = Run.objects.filter(backend=LaunchBackend.SLURM, state__in=FOLLOWED_STATES).exclude(job_id="")
    view = _node_view(cli) if runs.exists() or Host.objects.exists() else {}
    for run in runs:
        try:
            status = job_status(job_id=run.job_id, cli=cli)
            last = last_job_status(run=run)
            record_job_status(run=run, status=status, backend="slurm", last=last,
                              nodes_down=_nodes_down(status=status, last=last or {}, view=view))
            done[run.pk] = follow_job(run=run, status=status, job=f"SLURM job {run.job_id}",
                                      cancel=lambda run=run: cli.cancel(run.job_id))
        except (SlurmCommandFailed, LaunchSpecError) as exc:
            logger.warning("SLURM job %s of run %s: %s", run.job_id, run.pk, exc, extra={"run_id": run.pk})
            done[run.pk] = f"unreadable: {exc}"
    return done
