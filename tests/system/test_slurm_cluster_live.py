"""SLURM runs on a real cluster: slurmctld, slurmdbd and two slurmd nodes on this machine
(tests/support/slurm_cluster.py).

Nothing here is a fake: a real Celery worker configured for SLURM submits the run as a monarch.job SlurmJob with
real `sbatch`; the job's batch script starts a Monarch worker on each node through `srun` and then the engine,
which attaches to them, trains with a trainer rank on each node and reports to the web server. The beat task's
poll (`runs.poll_jobs`) follows the job through real `squeue` and `sacct`; cancelling goes through `scancel`.
Each node is a UTS namespace of its own whose hostname resolves to a loopback address of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.utils import timezone

from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Run
from forgeboard.runs.reconcile import PREVIOUS_ATTEMPT_NOT_STOPPED, PREVIOUS_ATTEMPT_STOPPED, runs_reconcile
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.services import run_cancel, run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import MetricPoint, RunEvent
from tests.support.processes import REPO_DIR, celery_worker, free_port, kill_processes_in, wait_for, web_server
from workers.launch.backends import start_run, stop_attempt
from workers.launch.local import run_dir
from workers.tasks import poll_jobs

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))]

GRPO_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: {model}
placement:
  backend: slurm
  trainer:
    procs_per_host: 1
trainer:
  ranks: 2
  steps: {steps}
  batch_size: 2
  threads_per_process: 1
grpo:
  group_size: 4
"""
# The trainer, reward and control proc on node 1, a generator replica on each node: losing node 2 loses a replica.
FAILOVER_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: {model}
placement:
  backend: slurm
  trainer: {{hosts: [fbslurm1]}}
  reward: {{hosts: [fbslurm1]}}
  replay_buffer: {{hosts: [fbslurm1]}}
  generator: {{hosts: [fbslurm2, fbslurm1]}}
trainer:
  ranks: 1
  steps: {steps}
  batch_size: 2
  threads_per_process: 1
generator:
  replicas: 2
  routing: round_robin
grpo:
  group_size: 4
failover:
  call_timeout_s: 60
"""
SFT_YAML = GRPO_YAML.replace("recipe: grpo", "recipe: sft").replace("grpo:\n  group_size: 4\n", "")
ENDED = (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED, RunState.LOST)


def _checkout_venv(folder: Path) -> str:
    """SLURM_VENV for the jobs: the suite's venv, its python running this checkout's code (the venv's own install may
    be another checkout's, a worktree's main: its jobs would run that engine)."""
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={REPO_DIR}:{REPO_DIR / "platform"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(folder)


@pytest.fixture
def slurm_web(slurm_cluster, settings, tmp_path):
    """A web server for the runs' engines, and this process's settings for SLURM (the worker's, where a test takes
    the worker's steps itself); the env a Celery worker would be given for the same."""
    port = free_port()
    worker_settings = {"SLURM_PARTITION": "debug", "SLURM_VENV": _checkout_venv(tmp_path / "venv"),
                       "SLURM_CPUS_PER_NODE": "1",
                       "SLURM_MEMORY": "1000M", "SLURM_MONARCH_PORT": str(free_port()),
                       "PUBLIC_URL": f"http://127.0.0.1:{port}"}
    for name, value in worker_settings.items():
        setattr(settings, name, int(value) if value.isdigit() else value)
    settings.SLURM_BIN_DIR = None
    settings.SLURM_IMAGE = None
    try:
        with web_server(tmp_path / "web.log", port=port):
            yield {"cluster": slurm_cluster, "tmp": tmp_path,
                   "worker_env": {f"FORGEBOARD_{name}": value for name, value in worker_settings.items()}}
    finally:
        slurm_cluster.command("scancel", "--full", "--user=root")
        kill_processes_in(Path(settings.DATA_DIR) / "runs")
        wait_for(lambda: not slurm_cluster.command("squeue", "-h").stdout.strip(), timeout=60,
                 what="the test's jobs to leave the queue")


@pytest.fixture
def slurm_platform(slurm_web):
    """... and a real Celery worker that submits SLURM runs to the test cluster."""
    with celery_worker(slurm_web["tmp"] / "worker.log", **slurm_web["worker_env"]):
        yield slurm_web


def _claimed_and_started(run: Run) -> Run:
    """What beat's scheduler and the launch.slurm worker do with a queued run, in this process."""
    assert run.pk in runs_schedule(now=timezone.now())
    start_run(run_id=run.pk)
    return Run.objects.get(pk=run.pk)


def _polled(run: Run) -> Run:
    """The run after one poll of the beat task that follows SLURM jobs."""
    poll_jobs("slurm")
    return Run.objects.get(pk=run.pk)


def _job_log(run: Run) -> str:
    logs = sorted(Path(run.log_path or "/nonexistent").glob("slurm_*"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)


def _sacct(cluster, job_id: str, *, latest: bool = False) -> dict:
    """The job's (first) accounting record; `latest`: its last (a requeued job has one for each time it ran)."""
    jobs = [job for job in json.loads(cluster.command("sacct", "--json", f"--jobs={job_id}").stdout)["jobs"]
            if str(job["job_id"]) == job_id]
    return jobs[-1] if latest else jobs[0]


def _until_first_step(run: Run) -> None:
    """Polls the job meanwhile: a job that ends first fails the test with SLURM's reason and the job's log."""
    try:
        wait_for(lambda: _loss_points(run) > 0 or _polled(run).state in ENDED, timeout=240, interval=0.5,
                 what="the first step")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_job_log(Run.objects.get(pk=run.pk))}") from None
    run = Run.objects.get(pk=run.pk)
    assert _loss_points(run) > 0, f"{run.state}: {run.exit_reason}\n{_job_log(run)}"


def _squeue(cluster, job_id: str) -> dict:
    # Slurm 22.05's squeue --json lists every job whatever --jobs says
    jobs = json.loads(cluster.command("squeue", "--json", f"--jobs={job_id}").stdout)["jobs"]
    return next(job for job in jobs if str(job["job_id"]) == job_id)


def _loss_points(run: Run) -> int:
    return MetricPoint.objects.filter(series__run=run, series__key="loss").count()


@pytest.mark.parametrize("recipe", ["grpo", "sft"])
def test_a_run_trains_across_two_real_slurm_nodes(team, tiny_model, slurm_platform, recipe):
    """Submitted by the worker, followed by the poll, a trainer rank on each node, reported to the web server."""
    cluster = slurm_platform["cluster"]
    experiment = team.experiment if recipe == "grpo" else \
        experiment_create(actor=team.owner, project=team.project, name="warm-start", recipe="sft")
    template = GRPO_YAML if recipe == "grpo" else SFT_YAML
    submitted = time.monotonic()
    run = run_launch(actor=team.member, experiment=experiment, config_yaml=template.format(model=tiny_model, steps=2))
    job_id = wait_for(lambda: Run.objects.get(pk=run.pk).job_id, timeout=120, what="the worker to sbatch the run")
    _until_first_step(run)
    first_step = time.monotonic() - submitted
    run = wait_for(lambda: (r := _polled(run)).state in ENDED and r, timeout=240, interval=1, what="the run to end")
    assert run.state == RunState.SUCCEEDED, f"{run.exit_reason}\n{_job_log(run)}"
    print(f"\n{recipe} on SLURM: submission to first step {first_step:.1f} s")

    job = wait_for(lambda: (j := _sacct(cluster, job_id))["state"]["current"] != "RUNNING" and j, timeout=60,
                   what="accounting to record the job's end")
    assert job["state"]["current"] == "COMPLETED" and job["nodes"] == "fbslurm[1-2]"
    assert job["comment"]["job"] == f"forgeboard-run-id={run.pk}", "sacct finds the run's job by its comment"
    script = cluster.command("sacct", f"--jobs={job_id}", "--batch-script").stdout
    assert "#SBATCH --nodes=2" in script and "#SBATCH --partition=debug" in script, "trainer ranks one to a host"
    [identities] = [line for line in script.splitlines() if line.startswith("export MONARCH_SERVICE_PROC_IDS=")]
    assert len(json.loads(identities.split("=", 1)[1].strip("'"))) == 2, "a service identity per node"
    submitted_event = RunEvent.objects.filter(run=run, kind="message", payload__name="job_submitted").get()
    assert submitted_event.payload["job_id"] == job_id and submitted_event.payload["nodes"] == 2
    port = settings.SLURM_MONARCH_PORT
    attached = RunEvent.objects.filter(run=run, kind="message", payload__text__startswith="attached to").get()
    assert attached.payload["text"].startswith(
        f"attached to 2 Monarch workers of the slurm job (fbslurm1 (tcp://fbslurm1:{port}), "
        f"fbslurm2 (tcp://fbslurm2:{port}))")
    ready = RunEvent.objects.filter(run=run, kind="message", payload__name="meshes_ready").get().payload
    assert ready["trainer_hosts"] == ["fbslurm1", "fbslurm2"] and ready["trainer_master_addr"] == "fbslurm1"
    assert _loss_points(run) == 2


def test_a_run_cancelled_while_its_job_waits_is_scancelled(team, tiny_model, slurm_platform):
    """The cluster is full: the run's job waits with SLURM's reason; cancelling it removes the job from the queue."""
    cluster = slurm_platform["cluster"]
    blocker = cluster.command("sbatch", "--parsable", "-N2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 600")
    assert blocker.returncode == 0, blocker.stderr
    wait_for(lambda: _squeue(cluster, blocker.stdout.strip())["job_state"] == "RUNNING", timeout=60,
             what="the job that fills the cluster to run")
    run = run_launch(actor=team.member, experiment=team.experiment,
                     config_yaml=GRPO_YAML.format(model=tiny_model, steps=2))
    job_id = wait_for(lambda: Run.objects.get(pk=run.pk).job_id, timeout=120, what="the worker to sbatch the run")
    queued = wait_for(lambda: (j := _squeue(cluster, job_id))["state_reason"] != "None" and j, timeout=30,
                      what="the scheduler to look at the job")
    assert queued["job_state"] == "PENDING" and queued["state_reason"] == "Resources"
    assert _polled(run).state == RunState.LAUNCHING

    cancelled_at = time.monotonic()
    run_cancel(actor=team.member, run=run)
    run = _polled(run)
    assert run.state == RunState.CANCELLED and "waiting in the SLURM queue (Resources)" in run.exit_reason
    wait_for(lambda: _sacct(cluster, job_id)["state"]["current"] == "CANCELLED", timeout=30,
             what="the job to be cancelled")
    gone = wait_for(lambda: job_id not in cluster.command("squeue", "-h", "-o", "%i").stdout.split() and
                    time.monotonic() - cancelled_at, timeout=30, what="the job to leave the queue")
    print(f"\ncancel to job gone (pending job): {gone:.1f} s")


@pytest.mark.parametrize("engine_stops", [True, False])
def test_a_running_run_is_cancelled_by_its_engine_or_else_by_scancel(team, tiny_model, slurm_platform, settings,
                                                                     engine_stops):
    """The engine takes the cancel and its job ends; past the cancel grace (0 s here) the poll scancels the job
    instead. Either way no process of the job is left on either node."""
    cluster = slurm_platform["cluster"]
    if not engine_stops:
        settings.JOB_CANCEL_GRACE_S = 0
    run = run_launch(actor=team.member, experiment=team.experiment,
                     config_yaml=GRPO_YAML.format(model=tiny_model, steps=500))
    _until_first_step(run)
    job_id = Run.objects.get(pk=run.pk).job_id
    cancelled_at = time.monotonic()
    run_cancel(actor=team.member, run=run)
    if engine_stops:
        assert poll_jobs("slurm") == {run.pk: "waiting for the engine to stop"}
        run = wait_for(lambda: (r := _polled(run)).state in ENDED and r, timeout=120, interval=0.5,
                       what="the engine to stop its job")
        assert run.state == RunState.CANCELLED and run.exit_reason == \
            f"SLURM job {job_id}: the job completed with exit code 0", run.exit_reason
        final = "COMPLETED"
    else:
        run = _polled(run)
        assert run.state == RunState.CANCELLED and "removed by the scheduler" in run.exit_reason
        final = "CANCELLED"
    wait_for(lambda: _sacct(cluster, job_id)["state"]["current"] == final, timeout=60,
             what=f"accounting to record the job {final}")
    wait_for(lambda: job_id not in cluster.command("squeue", "-h", "-o", "%i").stdout.split(), timeout=60,
             what="the job to leave the queue")
    gone = time.monotonic() - cancelled_at
    wait_for(lambda: all(cluster.job_processes(node) == [] for node in cluster.node_list), timeout=30,
             what="no step of the job left on either node")
    print(f"\ncancel to job gone ({'the engine stops' if engine_stops else 'scancel'}): {gone:.1f} s")


def test_a_partition_slurm_does_not_have_fails_the_run_with_slurms_reason(team, tiny_model, slurm_web, settings):
    settings.SLURM_PARTITION = "gpu-h100"  # a worker configured for another cluster
    run = _claimed_and_started(run_launch(actor=team.member, experiment=team.experiment,
                                          config_yaml=GRPO_YAML.format(model=tiny_model, steps=2)))
    assert run.state == RunState.FAILED and not run.job_id
    assert run.exit_reason.startswith("SLURM refused the job:") and "invalid partition name specified" in \
        run.exit_reason.lower(), run.exit_reason


def test_a_job_past_its_time_limit_fails_the_run_with_slurms_reason(team, tiny_model, slurm_web, settings):
    """Partition `short` has a one-minute limit: SLURM ends the job and the poll says why."""
    settings.SLURM_PARTITION = "short"
    run = _claimed_and_started(run_launch(actor=team.member, experiment=team.experiment,
                                          config_yaml=GRPO_YAML.format(model=tiny_model, steps=5000)))
    assert run.job_id, run.exit_reason
    run = wait_for(lambda: (r := _polled(run)).state in ENDED and r, timeout=240, interval=2,
                   what="SLURM to end the job at its time limit")
    assert _sacct(slurm_web["cluster"], run.job_id)["state"]["current"] == "TIMEOUT"
    assert run.state == RunState.FAILED and "time limit" in run.exit_reason, run.exit_reason


def _register_nodes_once(team, cluster, tmp_path: Path) -> None:
    """The node agent once on each node, through srun: the inventory has both nodes as hosts."""
    from forgeboard.cluster.services import agent_token_create

    _, raw = agent_token_create(actor=team.operator, name="slurm-nodes")
    token_file = tmp_path / "agent-once-token"
    token_file.write_text(raw)
    done = cluster.command("srun", "-N2", "--ntasks-per-node=1", f"{sys.prefix}/bin/forgeboard", "agent",
                           "--server", settings.PUBLIC_URL, "--token-file", str(token_file), "--once", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_lost_node_fails_over_its_replica_and_slurm_shows_the_node_down(team, tiny_model, slurm_platform):
    """Node 2 goes away whole (its slurmd, its Monarch worker, the generator replica there): the engine replaces the
    replica on node 1 and the run finishes; SLURM marks the node down and keeps the job (--no-kill)."""
    from forgeboard.cluster.models import Host

    cluster = slurm_platform["cluster"]
    _register_nodes_once(team, cluster, slurm_platform["tmp"])
    run = run_launch(actor=team.member, experiment=team.experiment,
                     config_yaml=FAILOVER_YAML.format(model=tiny_model, steps=800))
    _until_first_step(run)
    job_id = Run.objects.get(pk=run.pk).job_id
    placed = RunEvent.objects.get(run=run, kind="placement_applied").payload
    assert placed["plan"] == {"0": "fbslurm2", "1": "fbslurm1"}, placed
    killed_at = time.time()
    try:
        assert cluster.kill_node("fbslurm2"), "processes on node 2"
        down = wait_for(lambda: cluster.node_states().get("fbslurm2", "").startswith("down")
                        and time.time() - killed_at, timeout=90, interval=0.5, what="SLURM to mark node 2 down")
        assert _squeue(cluster, job_id)["job_state"] == "RUNNING", "--no-kill: the job outlives its node"
        assert _polled(run).state == RunState.RUNNING and _loss_points(run) < 800, "SLURM saw it while training went on"
        node = Host.objects.get(hostname="fbslurm2")
        assert (node.scheduler_state, node.scheduler_reason) == ("down (not responding)", "Not responding")
        assert node.scheduler_unavailable
        assert Host.objects.get(hostname="fbslurm1").scheduler_state in ("allocated", "mixed")
        status = RunEvent.objects.filter(run=run, kind="message", payload__name="job_status").latest("seq").payload
        # --no-kill: SLURM takes the failed node out of the job's node list; the run's job status still names it
        assert (status["state"], status["nodes"], status["nodes_down"]) == (
            "running", "fbslurm1", {"fbslurm2": "down (not responding): Not responding"}), status
        run = wait_for(lambda: (r := _polled(run)).state in ENDED and r, timeout=240, interval=1,
                       what="the run to end")
        assert run.state == RunState.SUCCEEDED, f"{run.exit_reason}\n{_job_log(run)}"
    finally:
        cluster.restart_node("fbslurm2")
    detected = list(RunEvent.objects.filter(run=run, kind="failure_detected").order_by("seq"))
    assert [(e.payload["role"], e.payload["replica"], e.payload["host"]) for e in detected] == [
        ("generator", 0, "fbslurm2")], [e.payload for e in detected]
    replaced = [e.payload for e in RunEvent.objects.filter(run=run, kind="replica_replaced")]
    assert [(p["role"], p["replica"], p["host"]) for p in replaced] == [("generator", 0, "fbslurm1")], replaced
    [recovered] = [e.payload for e in RunEvent.objects.filter(run=run, kind="recovered")]
    assert _loss_points(run) == 800
    print(f"\nnode loss: SLURM marked it down after {down:.1f} s; the engine detected it after "
          f"{detected[0].occurred_at.timestamp() - killed_at:.1f} s and recovered in "
          f"{recovered['time_to_recover_s']:.1f} s")


def test_the_node_agent_batch_script_registers_every_node(team, slurm_web, tmp_path):
    """infra/slurm/forgeboard-agent.sbatch as a site would submit it: an agent per node, each under its node's name,
    heartbeating until the job is cancelled."""
    from forgeboard.cluster.models import Host
    from forgeboard.cluster.services import agent_token_create

    cluster = slurm_web["cluster"]
    _, raw = agent_token_create(actor=team.operator, name="slurm-agents")
    token_file = tmp_path / "agent-token"
    token_file.write_text(raw)
    token_file.chmod(0o600)
    env = {**cluster.env, "FORGEBOARD_PUBLIC_URL": settings.PUBLIC_URL, "FORGEBOARD_AGENT_TOKEN_FILE": str(token_file),
           "FORGEBOARD_VENV": sys.prefix}
    submitted = subprocess.run(["sbatch", "--parsable", "--chdir", str(tmp_path),
                                str(REPO_DIR / "infra" / "slurm" / "forgeboard-agent.sbatch")],
                               env={**os.environ, **env}, capture_output=True, text=True, timeout=30, check=False)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    output = tmp_path / f"forgeboard-agent-{job_id}.out"
    hosts = wait_for(lambda: (h := {h.hostname: h for h in Host.objects.filter(hostname__startswith="fbslurm")})
                     and len(h) == 2 and h, timeout=120, interval=0.5,
                     what=f"both nodes' agents to register\n{output.read_text() if output.exists() else ''}")
    assert all(h.state == "up" and h.cpu_count > 0 and h.memory_bytes > 0 for h in hosts.values())
    first = {name: h.last_heartbeat_at for name, h in hosts.items()}
    wait_for(lambda: all(Host.objects.get(hostname=name).last_heartbeat_at > seen for name, seen in first.items()),
             timeout=60, interval=1, what="a heartbeat from each agent after it registered")
    assert cluster.command("scancel", job_id).returncode == 0
    wait_for(lambda: _sacct(cluster, job_id)["state"]["current"] == "CANCELLED", timeout=60,
             what="the agents' job to be cancelled")
    wait_for(lambda: all(cluster.job_processes(node) == [] for node in cluster.node_list), timeout=30,
             what="no agent left on either node")


def test_a_lost_runs_job_is_confirmed_stopped_only_once_slurm_has_stopped_its_processes(
        team, tiny_model, slurm_cluster, settings, monkeypatch, tmp_path):
    """A lost run's job whose processes outlive their SIGTERM (a hung engine, or one still saving a checkpoint): once
    scancelled, sacct says CANCELLED at once, but squeue has the job COMPLETING while SLURM waits KillWait (5 s on
    the test cluster) to SIGKILL them. They run on meanwhile, so the run restarts only once the job has left
    COMPLETING. (The test cluster's slurm.conf has no epilog, the other thing a COMPLETING job waits for.)"""
    from workers.celery import app

    settings.SLURM_BIN_DIR = None
    asks: list[dict] = []
    monkeypatch.setattr(app, "send_task", lambda name, **kw: asks.append({"name": name, **kw}))
    run = run_launch(actor=team.member, experiment=team.experiment,
                     config_yaml=GRPO_YAML.format(model=tiny_model, steps=2))
    alive, termed = tmp_path / "alive_at", tmp_path / "term_at"
    job = slurm_cluster.command(
        "sbatch", "--parsable", "-N1", "-o", "/dev/null", f"--comment=forgeboard-run-id={run.pk}", "--wrap",
        f"trap 'date +%s.%N > {termed}.new && mv {termed}.new {termed}' TERM; "
            f"while true; do date +%s.%N > {alive}.new && mv {alive}.new {alive}; sleep 0.2; done")
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip()
    try:
        wait_for(alive.exists, timeout=60, what="the job to run")
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, job_id=job_id, max_restarts=1,
                                             last_heartbeat_at=timezone.now() - timedelta(seconds=120))
        assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
        [ask] = [a for a in asks if a["name"] == "runs.stop_attempt"]
        asks.clear()

        answer = stop_attempt(**ask["kwargs"])  # squeue: RUNNING; scancel; squeue: COMPLETING
        answered_at = time.time()
        assert re.fullmatch(rf"still stopping: SLURM job {job_id} has ended, but SLURM is still stopping its "
                            r"processes on fbslurm[12] \(COMPLETING\)", answer), answer
        assert Run.objects.get(pk=run.pk).state == RunState.LOST
        wait_for(lambda: _squeue(slurm_cluster, job_id)["job_state"] != "COMPLETING", timeout=60,
                 what="SLURM to end the job's processes")
        assert termed.exists() and float(termed.read_text()) < answered_at, "the scancel's SIGTERM came first"
        assert float(alive.read_text()) > answered_at, "its processes ran on after the stop was not confirmed"
        assert _sacct(slurm_cluster, job_id)["state"]["current"] == "CANCELLED"
        assert all(slurm_cluster.job_processes(node) == [] for node in slurm_cluster.node_list)

        assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
        [ask] = [a for a in asks if a["name"] == "runs.stop_attempt"]
        assert stop_attempt(**ask["kwargs"]) == f"SLURM job {job_id} had ended (the SLURM job was cancelled); restarted"
        run.refresh_from_db()
        assert (run.state, run.restart_count, run.job_id) == (RunState.QUEUED, 1, "")
        [not_stopped] = RunEvent.objects.filter(run=run, kind="message", payload__name=PREVIOUS_ATTEMPT_NOT_STOPPED)
        assert not_stopped.payload["problem"] == answer.removeprefix("still stopping: ")
        assert RunEvent.objects.filter(run=run, kind="message", payload__name=PREVIOUS_ATTEMPT_STOPPED).exists()
    finally:
        slurm_cluster.command("scancel", job_id)


def _put_in(cluster, state: str, *, run_id: int, alive: Path, leave: ExitStack, frozen: ExitStack) -> str:
    """A job of the run's (its comment) put in `state` for real, as tests/support/slurm_cluster.py's cluster can; its
    id. What it leaves (a job held in its prolog, the job) goes when `leave` closes; a node frozen for it (SIGNALING)
    when `frozen` does."""
    name = f"state-{state}-{run_id}"
    if state == "CONFIGURING":
        leave.callback(cluster.hold_configuring(name).unlink)
    options = {"PENDING": ["--hold"], "SPECIAL_EXIT": ["--requeue"]}.get(state, [])
    job = cluster.command("sbatch", "--parsable", "-N1", "-w", "fbslurm1", "-J", name, "-o", "/dev/null",
                          f"--comment=forgeboard-run-id={run_id}", *options, "--wrap",
                          f"while true; do date +%s.%N > {alive}.new && mv {alive}.new {alive}; sleep 0.2; done")
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip()
    leave.callback(cluster.command, "scancel", job_id)
    if state in ("SPECIAL_EXIT", "STOPPED", "SIGNALING"):
        wait_for(lambda: _squeue(cluster, job_id)["job_state"] == "RUNNING", timeout=60, what="the job to run")
    if state == "SPECIAL_EXIT":
        assert cluster.command("scontrol", "requeuehold", "State=SpecialExit", job_id).returncode == 0
    if state == "SIGNALING":  # SLURM signals the job through its node's slurmd, which does not answer meanwhile
        frozen.enter_context(cluster.node_frozen("fbslurm1"))
    if state in ("STOPPED", "SIGNALING"):
        assert cluster.command("scancel", "--signal=STOP", "--full", job_id).returncode == 0
    wait_for(lambda: _squeue(cluster, job_id)["job_state"] == state, timeout=30, what=f"the job to be {state}")
    return job_id


@pytest.mark.parametrize(("state", "run_state", "reason"), [
    ("PENDING", "queued", "held in the SLURM queue until released (JobHeldUser)"),
    ("SPECIAL_EXIT", "queued", "requeued and held after a special exit (SPECIAL_EXIT) until released (JobHeldUser)"),
    ("CONFIGURING", "launching",
     "SLURM is setting up the job's nodes fbslurm1: booting them or running its prolog (CONFIGURING)"),
    ("STOPPED", "running", "stopped by SIGSTOP on fbslurm1: its processes are frozen, its nodes held (STOPPED)"),
    ("SIGNALING", "running", "running on fbslurm1; SLURM is sending it a signal (SIGNALING)"),
])
def test_a_lost_runs_job_in_any_state_the_cluster_puts_it_in_is_followed_and_stopped(
        team, tiny_model, slurm_cluster, settings, monkeypatch, tmp_path, state, run_state, reason):
    """Slurm 22.05 prints a flag in place of a job's state: held (sbatch --hold: PENDING, JobHeldUser), requeued and
    held (scontrol requeuehold State=SpecialExit), its node set up by slurmctld's prolog (CONFIGURING), stopped by
    `scancel --signal=STOP` (STOPPED), and being sent that signal through a node's slurmd that does not answer yet
    (SIGNALING). The flags were unknown states: the poll called the run's job unreadable, and a lost run's stop was
    never confirmed (the run failed 15 minutes on). Now the poll says what SLURM does with the job, and the stop
    scancels it and is confirmed once SLURM has ended it and its processes. (workers/launch/recorded/
    squeue_22.05_states.json has these states as captured from this cluster.)"""
    from workers.celery import app

    settings.SLURM_BIN_DIR = None
    asks: list[dict] = []
    monkeypatch.setattr(app, "send_task", lambda name, **kw: asks.append({"name": name, **kw}))

    def stop_asked() -> str:
        assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
        [ask] = [a for a in asks if a["name"] == "runs.stop_attempt"]
        asks.clear()
        return stop_attempt(**ask["kwargs"])

    run = run_launch(actor=team.member, experiment=team.experiment,
                     config_yaml=GRPO_YAML.format(model=tiny_model, steps=2))
    with ExitStack() as leave:
        frozen = leave.enter_context(ExitStack())
        job_id = _put_in(slurm_cluster, state, run_id=run.pk, alive=tmp_path / "alive_at", leave=leave, frozen=frozen)
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, job_id=job_id, max_restarts=1)
        requeued = run_state in ("queued", "launching")  # a running run's job back in the queue: SLURM requeued it
        assert poll_jobs("slurm") == {run.pk: "requeued" if requeued else run_state}
        status = RunEvent.objects.filter(run=run, kind="message", payload__name="job_status").latest("seq").payload
        assert (status["state"], status["reason"]) == (run_state, reason)
        assert Run.objects.get(pk=run.pk).state == (RunState.LAUNCHING if requeued else RunState.RUNNING)

        # Taken for lost as a running run all the same (its job's state is what this test is about).
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING,
                                             last_heartbeat_at=timezone.now() - timedelta(seconds=120))
        answer = stop_asked()
        if state == "SIGNALING":  # scancelled, but its node has not taken it yet: the job's processes run on
            assert answer == (f"still stopping: SLURM job {job_id} has ended, but SLURM is still stopping its "
                              "processes on fbslurm1 (COMPLETING)"), answer
            assert Run.objects.get(pk=run.pk).state == RunState.LOST
            frozen.close()
        for _ in range(30):  # SLURM may take a moment more to end it
            if not answer.startswith("still stopping"):
                break
            time.sleep(0.5)
            answer = stop_asked()
        assert re.fullmatch(rf"SLURM job {job_id} (cancelled|had ended \(the SLURM job was cancelled\)); restarted",
                            answer), answer
        run.refresh_from_db()
        assert (run.state, run.restart_count, run.job_id) == (RunState.QUEUED, 1, "")
        wait_for(lambda: _sacct(slurm_cluster, job_id, latest=True)["state"]["current"] == "CANCELLED", timeout=30,
                 what="accounting to record the job cancelled")
        assert all(slurm_cluster.job_processes(node) == [] for node in slurm_cluster.node_list)


def test_a_job_slurm_requeues_takes_its_run_back_to_launching_and_is_not_taken_for_lost(
        team, tiny_model, slurm_cluster, settings, monkeypatch, tmp_path):
    """`scontrol requeue` of a running run's job (as SLURM does after a node failure with --requeue): SLURM kills its
    processes and queues it again, then runs it again. The poll notices (squeue: PENDING, its restart_cnt 1) and takes
    the run back to launching, saying so once; the reconciler, an hour on, neither takes it for lost nor asks for its
    job to be stopped, so SLURM's requeue is not scancelled nor the run restarted beside it; the job runs again, and
    the run waits for its engine to report in. On the old code the run stayed running and was taken for lost."""
    from workers.celery import app

    settings.SLURM_BIN_DIR = None
    asks: list[dict] = []
    monkeypatch.setattr(app, "send_task", lambda name, **kw: asks.append({"name": name, **kw}))
    run = run_launch(actor=team.member, experiment=team.experiment,
                     config_yaml=GRPO_YAML.format(model=tiny_model, steps=2))
    alive = tmp_path / "alive_at"
    job = slurm_cluster.command(
        "sbatch", "--parsable", "-N1", "--requeue", "-o", "/dev/null", f"--comment=forgeboard-run-id={run.pk}",
        "--wrap", f"while true; do date +%s.%N > {alive}; sleep 0.2; done")
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip()
    try:
        wait_for(lambda: _squeue(slurm_cluster, job_id)["job_state"] == "RUNNING", timeout=60, what="the job to run")
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, job_id=job_id, max_restarts=1,
                                             last_heartbeat_at=timezone.now())
        assert poll_jobs("slurm") == {run.pk: "running"}

        assert slurm_cluster.command("scontrol", "requeue", job_id).returncode == 0
        queued = wait_for(lambda: (j := _squeue(slurm_cluster, job_id))["job_state"] == "PENDING" and j, timeout=60,
                          what="SLURM to queue the job again")
        assert queued["restart_cnt"] == 1
        assert poll_jobs("slurm") == {run.pk: "requeued"}
        run.refresh_from_db()
        assert (run.state, run.job_id, run.restart_count) == (RunState.LAUNCHING, job_id, 0)
        assert run.exit_reason.startswith(f"SLURM job {job_id} is back in the scheduler's queue: requeued by SLURM "
                                          "(restart 1): waiting in the SLURM queue"), run.exit_reason

        report = runs_reconcile(now=timezone.now() + timedelta(hours=1))
        assert (report.lost, report.stopping, report.restarted) == ([], [], [])
        assert not [a for a in asks if a["name"] == "runs.stop_attempt"]
        # SLURM holds a requeued job back for a while (BeginTime): sooner here.
        assert slurm_cluster.command("scontrol", "update", f"JobId={job_id}", "StartTime=now").returncode == 0
        wait_for(lambda: _squeue(slurm_cluster, job_id)["job_state"] == "RUNNING", timeout=60,
                 what="SLURM to run the job again")
        assert poll_jobs("slurm") == {run.pk: "running"}
        assert Run.objects.get(pk=run.pk).state == RunState.LAUNCHING, "until its engine reports in again"
        moves = RunEvent.objects.filter(run=run, kind="state_changed", payload__to="launching")
        assert moves.count() == 1, "the requeue said once"
    finally:
        slurm_cluster.command("scancel", job_id)


def test_a_job_slurm_requeues_resumes_from_its_runs_last_checkpoint(team, tiny_model, slurm_web):
    """`scontrol requeue` after the run's first checkpoint (as SLURM does after a node failure with --requeue): SLURM
    runs the same batch script and config.yaml again, and the engine resumes from the newest checkpoint in the run's
    own folder (<run folder>/checkpoints), not from step 0. On the old code the config.yaml said nothing of the run's
    folder or of resuming: the requeued engine started again at step 0, writing into the job's relative
    `checkpoints`."""
    cluster = slurm_web["cluster"]
    run = _claimed_and_started(run_launch(
        actor=team.member, experiment=team.experiment,
        config_yaml=GRPO_YAML.format(model=tiny_model, steps=5000) + "checkpoint:\n  every_steps: 2\n"))
    job_id = run.job_id
    assert job_id, run.exit_reason
    checkpoints = run_dir(run).resolve() / "checkpoints"
    saved = wait_for(lambda: RunEvent.objects.filter(run=run, kind="checkpoint_saved").order_by("seq").first(),
                     timeout=240, interval=0.5, what="the first checkpoint")

    assert cluster.command("scontrol", "requeue", job_id).returncode == 0
    wait_for(lambda: _squeue(cluster, job_id)["job_state"] == "PENDING", timeout=60, what="SLURM to queue it again")
    assert cluster.command("scontrol", "update", f"JobId={job_id}", "StartTime=now").returncode == 0
    ready = RunEvent.objects.filter(run=run, kind="message", payload__name="startup_phase", payload__phase="ready")
    wait_for(lambda: ready.count() == 2 or _polled(run).state in ENDED, timeout=240, interval=0.5,
             what="the requeued job's engine to be ready")
    [resumed] = RunEvent.objects.filter(run=run, kind="message", payload__name="resumed")
    reported = RunEvent.objects.filter(run=run, kind="checkpoint_saved", seq__lt=resumed.seq)
    step = resumed.payload["step"]  # its newest on disk: the killed engine may not have reported the last one
    assert step >= max(e.payload["step"] for e in reported) >= saved.payload["step"] > 0
    assert resumed.payload["path"] == str(checkpoints / f"step_{step:06d}"), "the newest checkpoint in its own folder"
