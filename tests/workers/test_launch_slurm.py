"""SLURM launch: a run's monarch.job SlurmJob as sbatch receives it, and squeue/sacct JSON read as run states."""

from __future__ import annotations

import json
import subprocess
import sys
import os
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import get_args

import pytest

from forgeboard.runs.states import RunState
from workers.launch import slurm
from workers.launch.slurm import LaunchSpecError, SlurmLaunchRequest

RECORDED = Path(slurm.__file__).parent / "recorded"
REPO_DIR = Path(__file__).resolve().parents[2]

def _recorded(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


def _directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def _request(tmp: Path, **change) -> SlurmLaunchRequest:
    return replace(SlurmLaunchRequest(
        run_id=42, config_path="/shared/runs/42/config.yaml", nodes=2, gpus_per_node=8, cpus_per_node=96,
        memory="1600G", partition="h200", control_plane_url="https://forgeboard.example",
        token_file="/shared/tokens/run-42.token", log_dir=str(tmp / "logs"), venv="/shared/venvs/forgeboard",
        environment={"NCCL_DEBUG": "WARN", "HF_HOME": "/shared/hf cache"}, time_limit="1-00:00:00",
        account="research", overrides=("trainer.steps=200",),
    ), **change)


FAKE_SBATCH = """#!{python}
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
json.dump({{"args": sys.argv[1:], "stdin": sys.stdin.read(), "cwd": os.getcwd(), "env": dict(os.environ)}},
          open(os.path.join(here, "sbatch.json"), "w"))
print("Submitted batch job 4242")
"""


@dataclass
class Submitted:
    job_id: str
    script: str
    cwd: str
    env: dict[str, str]


def _submit(tmp: Path, request: SlurmLaunchRequest) -> Submitted:
    """Apply the request's SlurmJob as the backend does, against a fake sbatch that keeps what it was given."""
    from workers.launch.slurm_backend import SlurmCli

    fake = tmp / "bin" / "sbatch"
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(FAKE_SBATCH.format(python=sys.executable))
    fake.chmod(0o755)
    folder = tmp / "run"
    folder.mkdir(exist_ok=True)
    job_id = SlurmCli(bin_dir=str(fake.parent)).submit(request, folder=folder)
    seen = json.loads((fake.parent / "sbatch.json").read_text())
    assert seen["args"] == []
    return Submitted(job_id=job_id, script=seen["stdin"], cwd=seen["cwd"], env=seen["env"])


@pytest.fixture(scope="module")
def submitted(tmp_path_factory) -> Submitted:
    tmp = tmp_path_factory.mktemp("slurm-submit")
    return _submit(tmp, _request(tmp))


def test_the_job_asks_sbatch_for_the_nodes_gpus_and_accounting(submitted):
    assert submitted.job_id == "4242"
    assert submitted.script.startswith("#!/bin/bash\n")
    directives = _directives(submitted.script)
    [name] = [d for d in directives if d.startswith("--job-name=")]
    assert name.startswith("--job-name=forgeboard-run-42_")  # monarch adds the submitting process's pid
    assert [d for d in directives if not d.startswith(("--job-name=", "--output=", "--error="))] == [
        "--ntasks-per-node=1", "--nodes=2", "--time=1-00:00:00", "--gpus-per-node=8", "--cpus-per-task=96",
        "--mem=1600G", "--exclusive", "--partition=h200", "--account=research", "--comment=forgeboard-run-id=42",
        "--no-kill",
    ]
    [output] = [d for d in directives if d.startswith("--output=")]
    assert output.startswith(f"--output={Path(submitted.cwd).parent / 'logs'}/slurm_%j_forgeboard-run-42_")


def test_every_node_gets_a_service_identity_and_the_engine_runs_as_the_batch_client(submitted):
    from monarch.job import deserialize_service_proc_ids

    lines = submitted.script.splitlines()
    [identities] = [line for line in lines if line.startswith("export MONARCH_SERVICE_PROC_IDS=")]
    ids = deserialize_service_proc_ids(shlex.split(identities.split("=", 1)[1])[0])
    assert len(ids) == 2 and ids[0] != ids[1]
    assert lines[-1] == ("/shared/venvs/forgeboard/bin/python -m monarch._src.job._slurm_batch --port 22222 "
                         "'/shared/venvs/forgeboard/bin/python -m workers.engine train "
                         "--config /shared/runs/42/config.yaml trainer.steps=200'")
    result = subprocess.run(["bash", "-n"], input=submitted.script, capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


def test_the_job_inherits_the_run_environment_and_nothing_of_the_worker(submitted, monkeypatch):
    env = submitted.env
    assert {key: env[key] for key in ("FORGEBOARD_RUN_ID", "FORGEBOARD_URL", "FORGEBOARD_RUN_TOKEN_FILE", "HF_HOME",
                                      "NCCL_DEBUG", "FORGEBOARD_GPUS_PER_HOST", "FORGEBOARD_MONARCH_JOB")} == {
        "FORGEBOARD_RUN_ID": "42", "FORGEBOARD_URL": "https://forgeboard.example",
        "FORGEBOARD_RUN_TOKEN_FILE": "/shared/tokens/run-42.token", "HF_HOME": "/shared/hf cache", "NCCL_DEBUG": "WARN",
        "FORGEBOARD_GPUS_PER_HOST": "8", "FORGEBOARD_MONARCH_JOB": "slurm"}
    assert env["PATH"].startswith(str(Path(submitted.cwd).parent / "bin") + os.pathsep)
    assert not {"DATABASE_URL", "REDIS_URL", "DJANGO_SECRET_KEY"} & set(env), "the worker's secrets stay out of the job"


def test_the_job_is_pickled_where_its_client_will_look(submitted):
    """The batch client (the engine) loads the job from its working directory, which is sbatch's."""
    from monarch.job import job_load

    job = job_load(str(Path(submitted.cwd) / ".monarch" / "job_state.pkl"))
    slurm_job = job._job
    assert slurm_job._meshes == {"hosts": 2} and slurm_job._port == 22222
    assert len(slurm_job._service_proc_ids) == 2


def test_a_refusing_or_silent_sbatch_is_a_clear_error(tmp_path):
    from workers.launch.slurm_backend import SlurmCommandFailed

    request = _request(tmp_path)
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: h200' >&2\nexit 1\n")
    fake.chmod(0o755)
    (tmp_path / "run").mkdir()
    with pytest.raises(SlurmCommandFailed, match="invalid partition specified: h200"):
        SlurmCli_submit(tmp_path, request)
    fake.write_text("#!/bin/sh\necho 'queued for approval'\n")
    with pytest.raises(SlurmCommandFailed, match="Failed to parse job ID from sbatch output: queued for approval"):
        SlurmCli_submit(tmp_path, request)


def SlurmCli_submit(tmp: Path, request: SlurmLaunchRequest) -> str:  # noqa: N802 - reads as the call it makes
    from workers.launch.slurm_backend import SlurmCli

    return SlurmCli(bin_dir=str(tmp / "bin")).submit(request, folder=tmp / "run")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"nodes": 0}, "nodes"),
        ({"gpus_per_node": -1}, "gpus_per_node"),
        ({"cpus_per_node": True}, "cpus_per_node"),
        ({"memory": "lots"}, "memory"),
        ({"partition": "h200; rm -rf /"}, "partition"),
        ({"time_limit": "forever"}, "time_limit"),
        ({"image": "registry.example/fb:1"}, "image"),  # not through monarch's SlurmJob
        ({"venv": None}, "venv"),
        ({"config_path": "runs/42.yaml"}, "config_path"),
        ({"control_plane_url": "ftp://x"}, "control_plane_url"),
        ({"environment": {"FORGEBOARD_URL": "http://elsewhere"}}, "environment.FORGEBOARD_URL"),
        ({"environment": {"FORGEBOARD_MONARCH_JOB": "kubernetes"}}, "environment.FORGEBOARD_MONARCH_JOB"),
        ({"environment": {"BAD NAME": "x"}}, "environment.BAD NAME"),
        ({"monarch_port": 80}, "monarch_port"),
        ({"nodelist": ("gpu-001", "gpu 2")}, "nodelist.1"),
        ({"nodelist": ("a", "b", "c")}, "nodelist"),  # more names than the job's 2 nodes
    ],
)
def test_bad_requests_name_the_field(change, field, tmp_path):
    request = _request(tmp_path, **change)
    with pytest.raises(LaunchSpecError) as caught:
        request.check()
    assert caught.value.field == field


def test_nodes_the_roles_are_pinned_to_are_asked_for_by_name(tmp_path):
    request = _request(tmp_path, nodelist=("gpu-001", "gpu-007"))
    assert "--nodelist=gpu-001,gpu-007" in _directives(_submit(tmp_path, request).script)
    assert SlurmLaunchRequest.from_json(json.loads(json.dumps(request.to_json()))) == request


def test_a_bad_request_is_refused_before_sbatch_runs(tmp_path):
    from workers.launch.slurm_backend import SlurmCommandFailed

    with pytest.raises(SlurmCommandFailed, match="memory: 'lots' is not an sbatch size"):
        _submit(tmp_path, _request(tmp_path, memory="lots"))
    assert not (tmp_path / "bin" / "sbatch.json").exists()


# --- squeue and sacct ---------------------------------------------------------------------------

def test_mapped_states_are_run_states():
    assert set(get_args(slurm.RunStateName)) <= set(RunState.values)


def test_squeue_jobs_map_to_run_states():
    statuses = slurm.parse_squeue(_recorded("squeue_23.11.json"))
    assert {job_id: s.state for job_id, s in statuses.items()} == {
        "18001": "queued", "18002": "queued", "18003": "launching", "18004": "running", "18005": "running"}
    assert statuses["18001"].reason == "waiting in the SLURM queue (Resources)"
    assert statuses["18002"].reason.startswith("requeued")
    assert statuses["18004"].reason == "running on gpu-[001-002]" and not statuses["18004"].terminal


@pytest.mark.parametrize(
    ("job_id", "state", "reason"),
    [
        ("17101", "succeeded", "the job completed with exit code 0"),
        ("17102", "failed", "the job failed with exit code 1 (NonZeroExitCode)"),
        ("17103", "failed", "the job failed with signal SEGV (NonZeroExitCode)"),
        ("17104", "failed", "the SLURM job was cancelled"),
        ("17105", "failed", "the job hit its time limit of 1440 minutes"),
        ("17106", "lost", "a node of the job failed (gpu-[007-008]); restart from the last checkpoint"),
        ("17107", "failed", "the job ran out of host memory (OUT_OF_MEMORY)"),
        ("17108", "lost", "preempted by a higher-priority job; restart from the last checkpoint"),
        ("17109", "succeeded", "the job completed with exit code 0"),  # requeued once, then completed
    ],
)
def test_sacct_jobs_map_to_run_states(job_id, state, reason):
    status = slurm.parse_sacct(_recorded("sacct_23.11.json"))[job_id]
    assert (status.state, status.reason, status.job_id) == (state, reason, job_id)
    assert status.terminal


def test_older_slurm_json_is_read_too():
    statuses = slurm.parse_squeue(_recorded("squeue_21.08.json"))
    assert statuses["9001"].state == "running" and statuses["9002"].reason == "waiting in the SLURM queue (Priority)"


def test_a_job_slurm_is_still_completing_is_not_over():
    """COMPLETING: SLURM has ended the job and is still stopping its processes on its nodes (or runs its epilog).
    Slurm 22.05 says only that (captured from the suite's cluster after a scancel); 23.02+ gives how it ended
    besides."""
    captured = slurm.parse_squeue(_recorded("squeue_22.05_completing.json"))
    newer = slurm.slurm_job_status({"job_id": 18004, "job_state": ["CANCELLED", "COMPLETING"], "nodes": "gpu-001"})
    for status, nodes in ((captured["1"], "fbslurm1"), (newer, "gpu-001")):
        assert status.completing and not status.terminal and status.state == "running"
        assert status.reason == f"SLURM is ending the job: still stopping its processes on {nodes} (COMPLETING)"
    assert not captured["2"].completing and captured["2"].reason == "running on fbslurm1"
    assert not slurm.parse_sacct(_recorded("sacct_23.11.json"))["17104"].completing


# Every job state and state flag Slurm has (slurm.h `job_states` and JOB_STATE_FLAGS, 22.05 to 25.11).
SLURM_STATES = {"PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
SLURM_FLAGS = {"LAUNCH_FAILED", "UPDATE_DB", "REQUEUED", "REQUEUE_HOLD", "SPECIAL_EXIT", "RESIZING", "CONFIGURING",
               "COMPLETING", "STOPPED", "RECONFIG_FAIL", "POWER_UP_NODE", "REVOKED", "REQUEUE_FED", "RESV_DEL_HOLD",
               "SIGNALING", "STAGE_OUT", "EXPEDITING"}
ENDING = "SLURM is ending the job: "
# Slurm 23.02+'s shape (a list of the base state and its flags), on the recorded 23.11 record of a job on gpu-[001-002]:
# what each means for a run, and what SLURM still does for a job it has ended (the job's processes may still run).
LIST_SHAPES = [
    (["PENDING"], "queued", "waiting in the SLURM queue", ""),
    (["RUNNING"], "running", "running on gpu-[001-002]", ""),
    (["SUSPENDED"], "running", "suspended by SLURM; it resumes where it stopped", ""),
    (["COMPLETED"], "succeeded", "the job completed with exit code 0", ""),
    (["CANCELLED"], "failed", "the SLURM job was cancelled", ""),
    (["FAILED"], "failed", "the job failed", ""),
    (["TIMEOUT"], "failed", "the job hit its time limit of 1440 minutes", ""),
    (["NODE_FAIL"], "lost", "a node of the job failed (gpu-[001-002]); restart from the last checkpoint", ""),
    (["PREEMPTED"], "lost", "preempted by a higher-priority job; restart from the last checkpoint", ""),
    (["BOOT_FAIL"], "lost", "SLURM could not boot the job's nodes", ""),
    (["DEADLINE"], "failed", "the job missed its deadline", ""),
    (["OUT_OF_MEMORY"], "failed", "the job ran out of host memory (OUT_OF_MEMORY)", ""),
    (["CANCELLED", "COMPLETING"], "running", None, "still stopping its processes on gpu-[001-002] (COMPLETING)"),
    (["COMPLETED", "STAGE_OUT"], "running", None, "still staging out its burst buffer data (STAGE_OUT)"),
    (["FAILED", "EXPEDITING"], "running", None, "still checking whether to requeue it (EXPEDITING)"),  # 25.11
    (["PENDING", "REQUEUED"], "queued", "requeued", ""),
    (["PENDING", "REQUEUE_HOLD"], "queued", "requeued and held until released (REQUEUE_HOLD)", ""),
    (["PENDING", "SPECIAL_EXIT"], "queued", "requeued and held after a special exit (SPECIAL_EXIT) until released", ""),
    (["PENDING", "REQUEUE_FED"], "queued", "requeued by its federation (REQUEUE_FED)", ""),
    (["PENDING", "RESV_DEL_HOLD"], "queued", "held until released: its reservation was deleted (RESV_DEL_HOLD)", ""),
    (["PENDING", "LAUNCH_FAILED"], "queued", "waiting in the SLURM queue", ""),
    (["PENDING", "RECONFIG_FAIL"], "queued", "waiting in the SLURM queue", ""),
    (["RUNNING", "CONFIGURING"], "launching",
     "SLURM is setting up the job's nodes gpu-[001-002]: booting them or running its prolog (CONFIGURING)", ""),
    (["RUNNING", "CONFIGURING", "POWER_UP_NODE"], "launching",
     "SLURM is powering up the job's nodes gpu-[001-002] (POWER_UP_NODE)", ""),
    (["PENDING", "REVOKED"], "running", "revoked on this cluster: another cluster of its federation runs it (REVOKED)",
     ""),
    (["RUNNING", "STOPPED"], "running",
     "stopped by SIGSTOP on gpu-[001-002]: its processes are frozen, its nodes held (STOPPED)", ""),
    (["RUNNING", "SIGNALING"], "running", "running on gpu-[001-002]; SLURM is sending it a signal (SIGNALING)", ""),
    (["RUNNING", "RESIZING"], "running", "running on gpu-[001-002]; SLURM is changing its size (RESIZING)", ""),
    (["RUNNING", "UPDATE_DB"], "running", "running on gpu-[001-002]", ""),
    (["CANCELLED", "LAUNCH_FAILED"], "failed", "the SLURM job was cancelled", ""),
]


def test_every_slurm_state_and_flag_is_mapped():
    assert {word for states, *_ in LIST_SHAPES for word in states} == SLURM_STATES | SLURM_FLAGS


@pytest.mark.parametrize(("states", "state", "reason", "ending"), LIST_SHAPES,
                         ids=["+".join(shape[0]) for shape in LIST_SHAPES])
def test_each_state_in_slurm_23s_shape_is_what_it_means_for_a_run(states, state, reason, ending):
    [record] = [job for job in _recorded("squeue_23.11.json")["jobs"] if job["job_id"] == 18004]
    status = slurm.slurm_job_status(record | {"job_state": states})
    assert (status.state, status.reason, status.ending, status.completing) == (
        state, reason or ENDING + ending, ending, bool(ending))
    assert not status.base_unknown
    assert status.terminal == (state in ("succeeded", "failed", "lost"))


@pytest.mark.parametrize(("job_id", "state", "reason"), [
    ("2", "queued", "held in the SLURM queue until released (JobHeldUser)"),  # sbatch --hold
    # scontrol requeue: a requeued job waits its BeginTime; its record's restart_cnt says SLURM requeued it
    ("3", "queued", "requeued by SLURM (restart 1): waiting in the SLURM queue (BeginTime)"),
    ("4", "queued", "requeued and held after a special exit (SPECIAL_EXIT) until released (JobHeldUser)"),
    ("5", "launching",
     "SLURM is setting up the job's nodes fbslurm2: booting them or running its prolog (CONFIGURING)"),
    ("6", "running", "stopped by SIGSTOP on fbslurm2: its processes are frozen, its nodes held (STOPPED)"),
    ("7", "running", "running on fbslurm1; SLURM is sending it a signal (SIGNALING)"),
])
def test_each_state_slurm_22_05_printed_on_the_suites_cluster_is_read(job_id, state, reason):
    """Captured from the suite's real cluster (Slurm 22.05 prints one word: a flag in place of the base state):
    workers/launch/recorded/README.md says how each job was put in its state."""
    status = slurm.parse_squeue(_recorded("squeue_22.05_states.json"), job_id=job_id)[job_id]
    assert (status.state, status.reason, status.completing) == (state, reason, False)
    assert status.base_unknown == (job_id not in ("2", "3")), "a flag in place of the base state: sacct may say more"


@pytest.mark.parametrize(("word", "state", "reason"), [
    ("STAGE_OUT", "running", ENDING + "still staging out its burst buffer data (STAGE_OUT)"),
    ("COMPLETING", "running", ENDING + "still stopping its processes on fbslurm1 (COMPLETING)"),
    ("RESIZING", "running", "running on fbslurm1; SLURM is changing its size (RESIZING)"),
    ("REQUEUED", "queued", "requeued"),
    ("REQUEUE_FED", "queued", "requeued by its federation (REQUEUE_FED)"),
    ("REQUEUE_HOLD", "queued", "requeued and held until released (REQUEUE_HOLD)"),
    ("RESV_DEL_HOLD", "queued", "held until released: its reservation was deleted (RESV_DEL_HOLD)"),
    ("REVOKED", "running", "revoked on this cluster: another cluster of its federation runs it (REVOKED)"),
])
def test_each_flag_slurm_22_05_prints_in_place_of_the_state_is_read(word, state, reason):
    """The words Slurm 22.05 prints for a job with a flag the suite's cluster cannot give (a burst buffer, a
    federation, a resize, a deleted reservation), on a record it captured."""
    [record] = [job for job in _recorded("squeue_22.05_states.json")["jobs"] if job["job_id"] == 7]
    status = slurm.slurm_job_status(record | {"job_state": word})
    assert (status.state, status.reason, status.completing) == (state, reason, reason.startswith(ENDING))


def test_a_running_jobs_start_time_is_read_in_both_shapes():
    """squeue's start_time of a running job: a plain number in Slurm 22.05 (captured), {"set", "number"} in 23.11. A
    pending job's is SLURM's estimate of its start (job 3, requeued, waits its BeginTime), and 0 or unset says none."""
    captured = slurm.parse_squeue(_recorded("squeue_22.05_states.json"))
    assert {job_id: s.started_at for job_id, s in captured.items()} == {
        "1": None, "2": None, "3": None, "4": None, "5": None, "6": 1796578034, "7": 1796578037}
    assert slurm.parse_squeue(_recorded("squeue_22.05_completing.json"))["2"].started_at == 1796576260
    newer = slurm.parse_squeue(_recorded("squeue_23.11.json"))
    assert {job_id: s.started_at for job_id, s in newer.items()} == {
        "18001": None, "18002": None, "18003": None, "18004": 1764498604, "18005": 1764498605}
    [record] = [job for job in _recorded("squeue_23.11.json")["jobs"] if job["job_id"] == 18004]
    for unset in ({"set": False, "infinite": False, "number": 1764498604}, {"set": True, "infinite": False, "number": 0},
                  0, None):
        assert slurm.slurm_job_status(record | {"start_time": unset}).started_at is None, unset
    assert slurm.parse_squeue(_recorded("squeue_21.08.json"))["9001"].started_at is None, "no start_time given"


def test_a_requeued_jobs_accounting_is_its_latest_record():
    """sacct of the suite's cluster after `scontrol requeue`: the run before it (REQUEUED) and the waiting one, whose
    nodes are "None assigned"."""
    document = _recorded("sacct_22.05_requeued.json")
    assert [job["state"]["current"] for job in document["jobs"]] == ["REQUEUED", "PENDING"]
    assert slurm.slurm_job_status(document["jobs"][0]).state == "queued"
    assert slurm.parse_sacct(document) == {"3": slurm.SchedulerStatus("queued", "waiting in the SLURM queue", "3")}


@pytest.mark.parametrize("states", [["MIGRATING"], ["RUNNING", "MIGRATING"], ["UPDATE_DB"], ["RUNNING", "PENDING"], []])
def test_a_state_slurm_does_not_have_is_unreadable_and_named(states):
    """A word no Slurm has (yet), a flag alone that 22.05 never prints alone, two base states, none: what it means
    for the run, and so whether the job has ended, is not known."""
    with pytest.raises(LaunchSpecError, match=re.escape(f"job_state: unknown SLURM job state {states!r}")):
        slurm.slurm_job_status({"job_id": 1, "job_state": states})


def test_one_jobs_record_is_read_without_the_others():
    """Slurm 22.05's squeue --json lists every job whatever --jobs says: another job's record that cannot be read
    does not make the asked job's unreadable."""
    document = _recorded("squeue_22.05_completing.json")
    document["jobs"][0]["job_state"] = "MIGRATING"  # no Slurm has it (yet)
    assert set(slurm.parse_squeue(document, job_id="2")) == {"2"}
    with pytest.raises(LaunchSpecError, match="unknown SLURM job state"):
        slurm.parse_squeue(document)


def test_slurm_errors_are_raised_not_mapped():
    with pytest.raises(LaunchSpecError, match="Invalid job id specified"):
        slurm.parse_squeue(_recorded("squeue_unknown_job.json"))
    with pytest.raises(LaunchSpecError, match="unknown SLURM job state"):
        slurm.slurm_job_status({"job_id": 1, "job_state": ["WEIRD"]})
    with pytest.raises(LaunchSpecError, match="no 'jobs' list"):
        slurm.parse_sacct({"meta": {}})


def test_jobs_are_found_by_the_run_comment():
    document = _recorded("squeue_23.11.json")
    assert slurm.job_ids_for_run(document, 42) == ["18004"]
    assert slurm.job_ids_for_run(document, 4) == []


def test_the_engine_finds_its_control_plane_in_what_a_job_exports(tmp_path, monkeypatch):
    from workers.engine.control_plane import ControlPlaneTarget
    from workers.launch.slurm import run_environment

    token = tmp_path / "run.token"
    token.write_text("s3cret\n")
    for key in ("FORGEBOARD_URL", "FORGEBOARD_RUN_ID", "FORGEBOARD_RUN_TOKEN_FILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in run_environment(run_id=42, control_plane_url="https://fb.example/", token_file=str(token),
                                      extra={}).items():
        monkeypatch.setenv(key, value)
    assert ControlPlaneTarget.from_environment() == ControlPlaneTarget(url="https://fb.example", run_id=42, token="s3cret")


@pytest.mark.parametrize(("exit_code", "reason"), [
    (768, "the job failed with exit code 3 (NonZeroExitCode)"),  # Slurm 22.05's squeue: a wait status
    (9, "the job failed with signal 9 (NonZeroExitCode)"),
    ({"status": "SUCCESS", "return_code": 0}, "the job failed (NonZeroExitCode)"),  # 22.05's sacct loses the code
])
def test_slurm_22_05_exit_codes_are_read_as_what_they_are(exit_code, reason):
    status = slurm.slurm_job_status({"job_id": 3, "job_state": "FAILED", "state_reason": "NonZeroExitCode",
                                     "exit_code": exit_code})
    assert (status.state, status.reason) == ("failed", reason)


def test_sinfo_nodes_read_as_a_person_reads_them():
    """Slurm 22.05's shape (the test cluster's: state text and flags) and 23.02+'s (one list of state and flags)."""
    document = {"errors": [], "nodes": [
        {"name": "fbslurm1", "state": "idle", "state_flags": [], "reason": ""},
        {"name": "fbslurm2", "state": "down", "state_flags": ["NOT_RESPONDING"], "reason": "Not responding"},
        {"name": "gpu-007", "state": ["IDLE", "DRAIN"], "reason": "bad DIMM"},
    ]}
    assert slurm.parse_sinfo(document) == {"fbslurm1": ("idle", ""),
                                           "fbslurm2": ("down (not responding)", "Not responding"),
                                           "gpu-007": ("idle (drain)", "bad DIMM")}
    with pytest.raises(LaunchSpecError, match="unreadable node record"):
        slurm.parse_sinfo({"nodes": [{"name": "x", "state": 3}]})
    with pytest.raises(LaunchSpecError, match="no 'nodes' list"):
        slurm.parse_sinfo({"nodes": {}})
    with pytest.raises(LaunchSpecError, match="Unable to contact"):
        slurm.parse_sinfo({"errors": [{"error": "Unable to contact slurm controller"}], "nodes": []})
