"""SLURM launch: the sbatch script for a run, and squeue/sacct JSON read as run states."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import get_args

import pytest

from forgeboard.runs.states import RunState
from workers.launch import slurm
from workers.launch.slurm import LaunchSpecError, SlurmLaunchRequest, sbatch_script

RECORDED = Path(slurm.__file__).parent / "recorded"
REPO_DIR = Path(__file__).resolve().parents[2]

REQUEST = SlurmLaunchRequest(
    run_id=42, config_path="/shared/runs/42/config.yaml", nodes=2, gpus_per_node=8, cpus_per_node=96,
    memory="1600G", partition="h200", control_plane_url="https://forgeboard.example",
    token_file="/shared/tokens/run-42.token", log_dir="/shared/logs", venv="/shared/venvs/forgeboard",
    environment={"NCCL_DEBUG": "WARN", "HF_HOME": "/shared/hf cache"}, time_limit="1-00:00:00", account="research",
    overrides=("trainer.steps=200",),
)


def _recorded(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


def _directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_sbatch_directives_request_the_nodes_and_gpus():
    script = sbatch_script(REQUEST)
    assert script.startswith("#!/bin/bash\n")
    assert _directives(script) == [
        "--job-name=forgeboard-run-42", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8",
        "--cpus-per-task=96", "--mem=1600G", "--partition=h200", "--exclusive",
        "--output=/shared/logs/forgeboard-run-42-%j.out", "--comment=forgeboard-run-id=42",
        "--time=1-00:00:00", "--account=research",
    ]


def test_sbatch_environment_is_exported_and_quoted():
    lines = sbatch_script(REQUEST).splitlines()
    assert "export FORGEBOARD_RUN_ID=42" in lines
    assert "export FORGEBOARD_URL=https://forgeboard.example" in lines
    assert "export FORGEBOARD_RUN_TOKEN_FILE=/shared/tokens/run-42.token" in lines
    assert "export HF_HOME='/shared/hf cache'" in lines
    assert f"export FORGEBOARD_GPUS_PER_HOST={REQUEST.gpus_per_node}" in lines
    assert 'export FORGEBOARD_MONARCH_WORKERS="$(IFS=,; echo "${workers[*]}")"' in lines


def test_sbatch_runs_a_worker_on_every_node_and_the_controller_on_the_first():
    lines = sbatch_script(REQUEST).splitlines()
    worker = next(line for line in lines if "run_worker_loop_forever" in line)
    assert worker.startswith("srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 "
                             "/shared/venvs/forgeboard/bin/python -c ")
    assert worker.endswith(" &")
    assert 'address="tcp://" + socket.gethostname() + ":22222"' in worker
    assert lines[-1] == ('srun --overlap --nodes=1 --ntasks=1 --nodelist="${nodes[0]}" '
                         '/shared/venvs/forgeboard/bin/python '
                         '-m workers.engine train --config /shared/runs/42/config.yaml trainer.steps=200')
    assert "trap 'kill \"$workers_pid\" 2>/dev/null || true' EXIT" in lines


def test_worker_bootstrap_is_valid_python():
    code = slurm.worker_loop_code(port=22222, host_suffix=".svc", bind_all=True)
    compile(code, "<worker>", "exec")
    assert '".svc:22222@tcp://0.0.0.0:22222"' in code


def test_sbatch_script_is_valid_bash():
    script = sbatch_script(REQUEST)
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


def test_container_image_runs_through_pyxis_with_the_token_and_config_mounted():
    script = sbatch_script(replace(REQUEST, venv=None, image="registry.example/forgeboard:1.0", gpus_per_node=0))
    assert "--gpus-per-node" not in script
    controller = script.splitlines()[-1]
    assert ("--container-image=registry.example/forgeboard:1.0 "
            "--container-mounts=/shared/runs/42:/shared/runs/42:ro,/shared/tokens:/shared/tokens:ro") in controller
    assert " python -m workers.engine train" in controller


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"nodes": 0}, "nodes"),
        ({"gpus_per_node": -1}, "gpus_per_node"),
        ({"cpus_per_node": True}, "cpus_per_node"),
        ({"memory": "lots"}, "memory"),
        ({"partition": "h200; rm -rf /"}, "partition"),
        ({"time_limit": "forever"}, "time_limit"),
        ({"image": "registry.example/fb:1"}, "venv"),  # both a venv and an image
        ({"venv": None}, "venv"),  # neither
        ({"config_path": "runs/42.yaml"}, "config_path"),
        ({"control_plane_url": "ftp://x"}, "control_plane_url"),
        ({"environment": {"FORGEBOARD_URL": "http://elsewhere"}}, "environment.FORGEBOARD_URL"),
        ({"environment": {"BAD NAME": "x"}}, "environment.BAD NAME"),
        ({"monarch_port": 80}, "monarch_port"),
    ],
)
def test_bad_requests_name_the_field(change, field):
    with pytest.raises(LaunchSpecError) as caught:
        sbatch_script(replace(REQUEST, **change))
    assert caught.value.field == field


def test_directives_agree_with_monarchs_slurm_job(tmp_path):
    """monarch.job.SlurmJob asks sbatch for the same resources: its script, captured by a fake sbatch."""
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ncat > {tmp_path}/monarch.sbatch\necho 'Submitted batch job 123'\n")
    fake.chmod(0o755)
    code = ("from monarch.job import SlurmJob\n"
            f"job = SlurmJob(meshes={{'workers': 2}}, gpus_per_node=8, cpus_per_task=96, mem='1600G', partition='h200',"
            f" time_limit='1-00:00:00', account='research', log_dir={str(tmp_path)!r})\n"
            "print(job._submit_slurm_job(2))\n")
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    theirs = {d for d in _directives((tmp_path / "monarch.sbatch").read_text())
              if not d.startswith(("--job-name", "--output", "--error"))}
    assert theirs <= set(_directives(sbatch_script(REQUEST)))
    assert "--gpus-per-node=8" in theirs and "--nodes=2" in theirs


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
