"""The SLURM launch backend against fake sbatch/squeue/sacct/scancel programs that answer with recorded JSON:
only for what the suite's real cluster (Slurm 22.05, tests/system/test_slurm_cluster_live.py) cannot be made to do.

The programs are real executables run through subprocess, as on a login node; what they print
comes from workers/launch/recorded (Slurm 23.11 shapes), with the job id of the test's run. Each test
says what here a real cluster cannot give. Submitting, following, cancelling a queued or running job, a
refused partition and a time limit run on the real cluster.
"""

from __future__ import annotations

import json
import re
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.db.models import F
from django.utils import timezone

from forgeboard.runs.models import Run
from forgeboard.runs.reconcile import runs_reconcile
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.services import run_cancel, run_launch, run_launch_queue, run_transition
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from workers.engine.config import load_config_file
from workers.launch.backends import start_run
from workers.launch.slurm_backend import poll_slurm_runs

RECORDED = Path(__file__).resolve().parents[2] / "workers" / "launch" / "recorded"
# squeue --json of the suite's real Slurm 22.05 cluster just after scancel of a job whose processes outlive their
# SIGTERM: job 1 COMPLETING (SLURM is still stopping them), job 2 (another) RUNNING.
SQUEUE_22_05_COMPLETING = RECORDED / "squeue_22.05_completing.json"
# squeue --json of the suite's real Slurm 22.05 cluster with a job in each state it can be put in (recorded/README.md):
# 2 held, 3 requeued, 4 SPECIAL_EXIT, 5 CONFIGURING, 6 STOPPED, 7 SIGNALING (and 1, cancelled).
SQUEUE_22_05_STATES = RECORDED / "squeue_22.05_states.json"
# ... and of job 2, scancelled while SLURM sent it a SIGSTOP through a node that did not answer: squeue says STOPPED
# (the flag SLURM set once the node took the SIGSTOP) in place of its base state, sacct CANCELLED.
SQUEUE_22_05_STOPPED_AFTER_CANCEL = RECORDED / "squeue_22.05_stopped_after_cancel.json"
SACCT_22_05_STOPPED_AFTER_CANCEL = RECORDED / "sacct_22.05_stopped_after_cancel.json"
# sacct --json of a job that has not started yet (CONFIGURING, or held): accounting has no record of it.
SACCT_22_05_NOTHING_FOUND = RECORDED / "sacct_22.05_nothing_found.json"
SLURM_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: /shared/models/qwen3-0.6b
placement:
  backend: slurm
  trainer:
    gpus_per_proc: 1
trainer:
  ranks: 4
"""

FAKE = """#!{python}
import json, os, sys, time
from pathlib import Path
here = Path(__file__).resolve().parent
name = Path(sys.argv[0]).name
stdin = sys.stdin.read() if name == "sbatch" else ""
with open(here / "calls.jsonl", "a") as log:
    log.write(json.dumps({{"program": name, "args": sys.argv[1:], "stdin": stdin, "cwd": os.getcwd(),
                          "env": dict(os.environ)}}) + "\\n")
answer = json.loads((here / "answers.json").read_text()).get(name, {{}})
if answer.get("sleep"):
    time.sleep(answer["sleep"])
if answer.get("exit"):
    print(answer.get("stderr", ""), file=sys.stderr)
    sys.exit(answer["exit"])
if name in ("squeue", "sacct"):
    job = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--jobs=")), None)
    # Slurm 22.05's squeue --json lists every job whatever --jobs says
    jobs = [j for j in answer["jobs"] if job is None or answer.get("lists_every_job") or str(j["job_id"]) == job]
    print(json.dumps({{"jobs": jobs, "errors": answer.get("errors", [] if jobs or name == "sacct" else
                      [{{"error": "Invalid job id specified", "error_number": 2017}}])}}))
else:
    print(answer.get("stdout", ""))
"""


class FakeSlurm:
    def __init__(self, folder: Path):
        self.folder = folder
        for name in ("sbatch", "squeue", "sacct", "scancel"):
            program = folder / name
            program.write_text(FAKE.format(python=sys.executable))
            program.chmod(0o755)
        self.answers: dict = {"sbatch": {"stdout": "Submitted batch job 18004"}, "squeue": {"jobs": []}, "sacct": {"jobs": []}}
        self._save()

    def _save(self) -> None:
        (self.folder / "answers.json").write_text(json.dumps(self.answers))

    def answer(self, program: str, **answer) -> None:
        self.answers[program] = answer
        self._save()

    def job(self, program: str, recorded_id: int, *, as_id: str, started_ago: timedelta | None = None,
            no_start_time: bool = False) -> None:
        """Answer `program` with the recorded record of job `recorded_id`, under the test's job id; `started_ago`: SLURM
        started it that long ago (its start_time, in whole seconds); `no_start_time`: the record gives none."""
        document = json.loads((RECORDED / f"{program}_23.11.json").read_text())
        record = [j for j in document["jobs"] if j["job_id"] == recorded_id][-1] | {"job_id": int(as_id)}
        if no_start_time:
            record["start_time"] = {"set": False, "infinite": False, "number": 0}
        elif started_ago is not None:
            record["start_time"] = {"set": True, "infinite": False,
                                    "number": int((timezone.now() - started_ago).timestamp())}
        self.answer(program, jobs=[record])

    def completing(self, *, as_id: str, shape: str) -> None:
        """squeue says the job is COMPLETING: SLURM has ended it and is still stopping its processes on its nodes.
        Slurm 22.05 (captured from the suite's cluster, listed beside another job whatever --jobs says) says only
        that; 23.11 says how it ended besides (CANCELLED here), in its state list."""
        if shape == "22.05":
            completing, other = json.loads(SQUEUE_22_05_COMPLETING.read_text())["jobs"]
            self.answer("squeue", jobs=[completing | {"job_id": int(as_id)}, other], lists_every_job=True)
        else:
            self.job("squeue", 18004, as_id=as_id)
            [record] = self.answers["squeue"]["jobs"]
            self.answer("squeue", jobs=[record | {"job_state": ["CANCELLED", "COMPLETING"]}])

    def captured(self, *, job: int, as_id: str, state: str | None = None) -> None:
        """squeue answers as the suite's cluster did with its jobs in several states (listing them all whatever --jobs
        says), job `job` under the test's job id; `state`: as Slurm 22.05 prints that flag instead."""
        jobs = json.loads(SQUEUE_22_05_STATES.read_text())["jobs"]
        asked = [j | {"job_id": int(as_id)} | ({"job_state": state} if state else {})
                 for j in jobs if j["job_id"] == job]
        self.answer("squeue", jobs=asked + [j for j in jobs if j["job_id"] != job], lists_every_job=True)
        self.answer("sacct", **json.loads(SACCT_22_05_NOTHING_FOUND.read_text()))  # as for a job not started yet

    def stopped_after_cancel(self, *, as_id: str) -> None:
        """squeue and sacct as the suite's cluster answered for a job SLURM had cancelled but squeue said STOPPED."""
        squeue = json.loads(SQUEUE_22_05_STOPPED_AFTER_CANCEL.read_text())["jobs"]
        self.answer("squeue", jobs=[j | {"job_id": int(as_id)} if j["job_id"] == 2 else j for j in squeue],
                    lists_every_job=True)
        [accounted] = json.loads(SACCT_22_05_STOPPED_AFTER_CANCEL.read_text())["jobs"]
        self.answer("sacct", jobs=[accounted | {"job_id": int(as_id)}])

    def calls(self, program: str) -> list[dict]:
        path = self.folder / "calls.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [c for c in map(json.loads, lines) if c["program"] == program]


@pytest.fixture
def slurm(tmp_path, settings) -> FakeSlurm:
    folder = tmp_path / "slurm-bin"
    folder.mkdir()
    settings.SLURM_PARTITION = "gpu"
    settings.SLURM_VENV = "/shared/venvs/forgeboard"
    settings.SLURM_IMAGE = None
    settings.SLURM_BIN_DIR = str(folder)
    settings.SLURM_GPUS_PER_NODE = 2
    settings.DATA_DIR = tmp_path / "data"
    return FakeSlurm(folder)


def _submitted(team) -> Run:
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=SLURM_YAML)
    assert run.backend == "slurm" and run_launch_queue(run_id=run.pk) == "launch.slurm"
    assert run.pk in runs_schedule(now=timezone.now()), "SLURM queues it: no inventory host is needed"
    start_run(run_id=run.pk)
    run.refresh_from_db()
    return run


@pytest.mark.django_db
def test_a_slurm_runs_config_resumes_from_the_checkpoints_in_its_own_folder(team, slurm):
    """The config.yaml its job reads (again, as it is, when SLURM requeues the job; written anew when the reconciler
    restarts the run as a new job) sends its checkpoints to <run folder>/checkpoints, a folder every node sees, and
    resumes from the newest there at start. A user's checkpoint.folder is replaced, as the local backend always did (the
    platform lists a run's checkpoints there), their other checkpoint settings kept. On the old code it said neither:
    a requeued or restarted job trained again from step 0, writing into its working directory's `checkpoints`."""
    run = run_launch(actor=team.member, experiment=team.experiment,
                     config_yaml=SLURM_YAML + "checkpoint:\n  folder: mine\n  every_steps: 5\n")
    assert run.pk in runs_schedule(now=timezone.now())
    start_run(run_id=run.pk)
    run.refresh_from_db()
    folder = Path(run.log_path).parent
    written = yaml.safe_load((folder / "config.yaml").read_text())
    assert written["checkpoint"] == {"folder": str(folder / "checkpoints"), "every_steps": 5, "resume_latest": True}
    assert load_config_file(str(folder / "config.yaml")).checkpoint.resume_latest, "the engine's schema takes it"
    assert str(folder) in json.loads(slurm.calls("sbatch")[0]["env"]["FORGEBOARD_ALLOWED_PATHS"])


@pytest.mark.django_db
def test_a_slurm_run_is_submitted_followed_and_failed_with_slurms_reason(team, slurm):
    """Slurm 23.11's JSON (state lists, wrapped numbers) and GPU nodes, which the test cluster has neither of."""
    run = _submitted(team)
    assert run.state == RunState.LAUNCHING and run.job_id == "18004"
    assert run.allocation == {"slurm": {"gpus": 4, "slots": 0}}, "its GPUs count against the project's quota"
    [sbatch] = slurm.calls("sbatch")
    assert sbatch["args"] == [], "monarch's SlurmJob pipes its script to a bare sbatch"
    script = sbatch["stdin"]
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=2" in script
    assert f"#SBATCH --comment=forgeboard-run-id={run.pk}" in script
    folder = Path(run.log_path).parent
    assert script.splitlines()[-1] == ("/shared/venvs/forgeboard/bin/python -m monarch._src.job._slurm_batch --port 22222 "
                                       f"'/shared/venvs/forgeboard/bin/python -m workers.engine train --config "
                                       f"{folder / 'config.yaml'}'")
    assert sbatch["cwd"] == str(folder), "the job's working directory is the run's folder"
    assert sbatch["env"]["FORGEBOARD_RUN_TOKEN_FILE"] == str(folder / "run_token")
    assert sbatch["env"]["FORGEBOARD_MONARCH_JOB"] == "slurm" and "DATABASE_URL" not in sbatch["env"]
    assert (folder / "run_token").read_text() and "backend: slurm" in (folder / "config.yaml").read_text()
    assert (folder / ".monarch" / "job_state.pkl").is_file(), "the pickled job its engine attaches through"
    submitted = RunEvent.objects.get(run=run, kind="message", payload__name="job_submitted")
    assert submitted.payload | {} == {"name": "job_submitted", "backend": "slurm", "job_id": "18004", "nodes": 2,
                                      "gpus_per_node": 2, "partition": "gpu"}

    # running in SLURM, the engine not reported in yet: nothing changes; nor after the launch timeout
    slurm.job("squeue", 18004, as_id="18004")
    assert poll_slurm_runs() == {run.pk: "running"}
    report = runs_reconcile(now=timezone.now() + timedelta(hours=6))
    assert run.pk not in report.lost and Run.objects.get(pk=run.pk).state == RunState.LAUNCHING

    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)  # the engine reported in
    slurm.answer("squeue", jobs=[])  # it left the queue; accounting says it failed
    slurm.job("sacct", 17102, as_id="18004")
    assert poll_slurm_runs() == {run.pk: "failed"}
    run.refresh_from_db()
    assert run.state == RunState.FAILED and run.exit_reason.startswith("SLURM job 18004: the job failed with exit code")
    assert [c["args"] for c in slurm.calls("sacct")] == [["--json", "--jobs=18004"]]
    assert poll_slurm_runs() == {}, "a finished run is not followed any more"


@pytest.mark.django_db
def test_a_node_failure_loses_the_run_so_the_reconciler_can_restart_it(team, slurm):
    """A NODE_FAIL record as Slurm 23.11's sacct prints it."""
    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    slurm.job("sacct", 17106, as_id="18004")  # NODE_FAIL
    assert poll_slurm_runs() == {run.pk: "lost"}
    run.refresh_from_db()
    assert run.state == RunState.LOST and "a node of the job failed" in run.exit_reason


@pytest.mark.django_db
def test_bad_slurm_settings_fail_the_run_naming_the_setting(team, slurm, settings):
    """Refused before any SLURM command runs: the fake records that sbatch was never called."""
    settings.SLURM_MEMORY = "lots"
    run = _submitted(team)
    assert run.state == RunState.FAILED and slurm.calls("sbatch") == []
    assert run.exit_reason == "SLURM launch settings: memory: 'lots' is not an sbatch size such as 512G"


@pytest.mark.django_db
def test_unreadable_scheduler_output_leaves_the_run_alone(team, slurm):
    """A controller that cannot be contacted, as squeue reports it."""
    run = _submitted(team)
    slurm.answer("squeue", exit=1, stderr="slurm_load_jobs error: Unable to contact slurm controller")
    assert poll_slurm_runs() == {run.pk: "unreadable: squeue exited with 1: slurm_load_jobs error: "
                                          "Unable to contact slurm controller"}
    assert Run.objects.get(pk=run.pk).state == RunState.LAUNCHING


@pytest.mark.django_db
def test_sbatch_output_that_is_not_a_job_id_fails_the_run(team, slurm):
    """An sbatch (a site's wrapper) that prints something else than a job id."""
    slurm.answer("sbatch", stdout="Submitted batch job pending approval")
    run = _submitted(team)
    assert run.state == RunState.FAILED and run.job_id == ""
    assert run.exit_reason == "SLURM refused the job: sbatch answered 'approval', not a job id"


@pytest.mark.django_db
def test_squeue_output_that_is_not_json_is_reported_and_the_run_left_alone(team, slurm):
    """An squeue too old for --json."""
    run = _submitted(team)
    # an squeue too old for --json prints its table
    (slurm.folder / "squeue").write_text(f"#!{sys.executable}\nprint('JOBID PARTITION NAME')\n")
    assert poll_slurm_runs() == {run.pk: "unreadable: squeue did not print JSON (Expecting value at 0)"}
    assert Run.objects.get(pk=run.pk).state == RunState.LAUNCHING


@pytest.mark.django_db
def test_a_run_spread_one_rank_to_a_host_asks_for_a_node_per_rank_even_without_gpus(team, slurm):
    """Three nodes, one more than the test cluster has."""
    yaml = ("recipe: grpo\nmodel: {family: qwen3, path: /shared/models/qwen3-0.6b}\n"
            "placement: {backend: slurm, trainer: {procs_per_host: 1}}\ntrainer: {ranks: 3}\n")
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=yaml)
    runs_schedule(now=timezone.now())
    start_run(run_id=run.pk)
    [sbatch] = slurm.calls("sbatch")
    assert "#SBATCH --nodes=3" in sbatch["stdin"] and "--gpus-per-node" not in sbatch["stdin"]
    submitted = RunEvent.objects.get(run=run, kind="message", payload__name="job_submitted")
    assert (submitted.payload["nodes"], submitted.payload["gpus_per_node"]) == (3, 0)


@pytest.mark.django_db
@pytest.mark.parametrize("queued", [True, False])
def test_a_job_queued_by_an_sbatch_that_then_went_quiet_is_found_by_the_runs_comment(team, slurm, monkeypatch, queued):
    """An sbatch that queues the job, then does not answer in time."""
    monkeypatch.setattr("workers.launch.slurm_backend.SUBMIT_TIMEOUT_S", 3)
    slurm.answer("sbatch", sleep=6, stdout="Submitted batch job 18004")
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=SLURM_YAML)
    runs_schedule(now=timezone.now())
    jobs = json.loads((RECORDED / "squeue_23.11.json").read_text())["jobs"]
    mine = next(j for j in jobs if j["job_id"] == 18004) | {"job_id": 18077, "comment": f"forgeboard-run-id={run.pk}"}
    others = [j | {"comment": "someone else's job"} for j in jobs if j["job_id"] != 18004]
    slurm.answer("squeue", jobs=others + ([mine] if queued else []))
    start_run(run_id=run.pk)
    run.refresh_from_db()
    if queued:
        assert run.state == RunState.LAUNCHING and run.job_id == "18077", run.exit_reason
        submitted = RunEvent.objects.get(run=run, kind="message", payload__name="job_submitted")
        assert submitted.payload["found"].startswith("sbatch did not answer in time")
    else:
        assert run.state == RunState.FAILED and run.job_id == ""
        assert run.exit_reason == "SLURM refused the job: sbatch did not answer within 3 s"
    assert [c["args"] for c in slurm.calls("squeue")] == [["--json"]]


@pytest.mark.django_db
def test_a_cancelled_run_whose_engine_went_silent_has_its_job_removed_by_the_poller_not_left_by_the_reconciler(
        team, slurm, settings):
    """An engine that stops heartbeating while its run is cancelled, its job still running: a real cluster's engine
    cannot be made to hang. Ended by the reconciler, its job would run on with nobody following it."""
    settings.JOB_CANCEL_GRACE_S = 120
    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    Run.objects.filter(pk=run.pk).update(max_restarts=2, last_heartbeat_at=timezone.now() - timedelta(seconds=600))
    run_cancel(actor=team.member, run=Run.objects.get(pk=run.pk))

    report = runs_reconcile(now=timezone.now() + timedelta(hours=1))
    assert (report.lost, report.cancelled) == ([], []) and Run.objects.get(pk=run.pk).state == RunState.CANCELLING

    slurm.job("squeue", 18004, as_id="18004")
    Run.objects.filter(pk=run.pk).update(state_changed_at=timezone.now() - timedelta(seconds=300))
    assert poll_slurm_runs() == {run.pk: "cancelled by the scheduler"}
    assert [c["args"] for c in slurm.calls("scancel")] == [["18004"]]
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED and run.restart_count == 0
    assert run.exit_reason == "SLURM job 18004 removed by the scheduler: the engine had not stopped 300 s after the cancel"


@pytest.mark.django_db
@pytest.mark.parametrize("shape", ["22.05", "23.11"])
def test_a_cancelled_runs_job_still_completing_past_the_grace_is_not_scancelled_again_and_ends_cancelled(
        team, slurm, shape):
    """The engine took the cancel and its job has ended, but SLURM is still stopping its processes (COMPLETING) when
    the cancel grace is over: a second scancel changes nothing, and the run was cancelled, not removed by the
    scheduler. On the old code it was scancelled again and its reason said 'removed by the scheduler'."""
    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    run_cancel(actor=team.member, run=Run.objects.get(pk=run.pk))
    Run.objects.filter(pk=run.pk).update(state_changed_at=timezone.now() - timedelta(seconds=300))
    slurm.completing(as_id="18004", shape=shape)

    assert poll_slurm_runs() == {run.pk: "cancelled, its job still stopping"}

    assert slurm.calls("scancel") == []
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED
    assert re.fullmatch(r"cancelled; SLURM job 18004 has ended, but SLURM is still stopping its processes on "
                        r"\S+ \(COMPLETING\)", run.exit_reason), run.exit_reason


@pytest.mark.django_db
def test_a_run_cancelled_before_its_worker_took_the_launch_ends_cancelled_after_the_launch_timeout(team, slurm):
    """The launch.slurm worker died before it took the run's launch (a launch that takes it ends the cancelled run at
    once, unsubmitted: tests/platform/test_cancel_before_submission.py): the run has no job for the poller to follow,
    and its submission could still have been under way until the launch timeout."""
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=SLURM_YAML)
    assert runs_schedule(now=timezone.now()) == [run.pk]
    run_cancel(actor=team.member, run=Run.objects.get(pk=run.pk))
    run.refresh_from_db()
    assert run.state == RunState.CANCELLING and run.job_id == ""

    assert runs_reconcile(now=run.state_changed_at + timedelta(seconds=120)).cancelled == []
    report = runs_reconcile(now=run.state_changed_at + timedelta(seconds=400))
    assert report.cancelled == [run.pk] and report.lost == []
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED and run.restart_count == 0
    assert run.exit_reason == "cancelled; its controller never reported in (400 s after the cancel)"


@pytest.mark.django_db
@pytest.mark.parametrize("shape", ["22.05", "23.11"])
def test_a_job_slurm_is_still_completing_keeps_its_run_as_it_is_until_its_processes_are_gone(team, slurm, shape):
    """A job SLURM has ended but whose processes it is still stopping (COMPLETING) is not over: its run is not moved
    (a lost run would restart beside them). Slurm 23.11's shape, which the test cluster (22.05) cannot give, and
    22.05's as captured from it: its bare COMPLETING was read as no state at all (the poll unreadable). A real one
    lasts KillWait on the test cluster: tests/system/test_slurm_cluster_live.py stops a lost run's job through one."""
    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    slurm.completing(as_id="18004", shape=shape)
    nodes = "fbslurm1" if shape == "22.05" else "gpu-[001-002]"
    assert poll_slurm_runs() == {run.pk: "running"}
    assert Run.objects.get(pk=run.pk).state == RunState.RUNNING
    status = RunEvent.objects.filter(run=run, kind="message", payload__name="job_status").latest("seq").payload
    assert status["reason"] == f"SLURM is ending the job: still stopping its processes on {nodes} (COMPLETING)"

    slurm.answer("squeue", jobs=[])  # it left the queue: now it is over
    slurm.job("sacct", 17106, as_id="18004")  # NODE_FAIL
    assert poll_slurm_runs() == {run.pk: "lost"}


@pytest.mark.django_db
def test_another_job_completing_does_not_make_this_ones_answer_unreadable(team, slurm):
    """Slurm 22.05's squeue --json lists every job of the cluster, whatever --jobs says (captured): only the run's own
    job's record is read, so another job in a state this code does not know leaves this run followed."""
    run = _submitted(team)
    completing, other = json.loads(SQUEUE_22_05_COMPLETING.read_text())["jobs"]
    slurm.answer("squeue", jobs=[completing | {"job_state": "MIGRATING"}, other | {"job_id": 18004}],
                 lists_every_job=True)
    assert poll_slurm_runs() == {run.pk: "running"}


@pytest.mark.django_db
@pytest.mark.parametrize(("job", "state", "said"), [
    (2, "queued", "held in the SLURM queue until released (JobHeldUser)"),
    (4, "queued", "requeued and held after a special exit (SPECIAL_EXIT) until released (JobHeldUser)"),
    (5, "launching", "SLURM is setting up the job's nodes fbslurm2: booting them or running its prolog (CONFIGURING)"),
    (6, "running", "stopped by SIGSTOP on fbslurm2: its processes are frozen, its nodes held (STOPPED)"),
    (7, "running", "running on fbslurm1; SLURM is sending it a signal (SIGNALING)"),
])
def test_a_job_in_any_state_slurm_22_05_prints_is_followed_not_unreadable(team, slurm, job, state, said):
    """Slurm 22.05 prints a flag in place of the job's state (captured from the suite's cluster): each was "unknown",
    the run's job unreadable to the poll. Now the run is followed, and its timeline says what SLURM does with its job:
    a running job is left to its engine, which reports for itself; one back in the queue or being set up again was
    requeued, and its run goes back to launching until its engine reports in again."""
    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    slurm.captured(job=job, as_id="18004")
    assert poll_slurm_runs() == {run.pk: "running" if state == "running" else "requeued"}
    assert Run.objects.get(pk=run.pk).state == (RunState.RUNNING if state == "running" else RunState.LAUNCHING)
    status = RunEvent.objects.filter(run=run, kind="message", payload__name="job_status").latest("seq").payload
    assert (status["state"], status["reason"]) == (state, said)


@pytest.mark.django_db
def test_a_job_staging_out_its_data_keeps_its_run_as_it_is_until_slurm_is_done(team, slurm):
    """STAGE_OUT (a burst buffer's data copied out after the job, a checkpoint perhaps), as Slurm 22.05 prints it: the
    job has not ended for the run yet. A real one needs a burst buffer, which the suite's cluster has not."""
    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    slurm.captured(job=7, as_id="18004", state="STAGE_OUT")
    assert poll_slurm_runs() == {run.pk: "running"}
    status = RunEvent.objects.filter(run=run, kind="message", payload__name="job_status").latest("seq").payload
    assert status["reason"] == "SLURM is ending the job: still staging out its burst buffer data (STAGE_OUT)"

    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17101, as_id="18004")  # COMPLETED
    assert poll_slurm_runs() == {run.pk: "succeeded"}


@pytest.mark.django_db
def test_a_cancelled_run_whose_job_is_held_is_scancelled_as_one_in_the_queue(team, slurm):
    """A held job (sbatch --hold, captured) waits in the queue: no engine runs that could take the cancel."""
    run = _submitted(team)
    slurm.captured(job=2, as_id="18004")
    run_cancel(actor=team.member, run=run)
    assert poll_slurm_runs() == {run.pk: "cancelled in the queue"}
    assert [c["args"] for c in slurm.calls("scancel")] == [["18004"]]
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED and "held in the SLURM queue until released (JobHeldUser)" in run.exit_reason


@pytest.mark.django_db
def test_a_job_slurm_says_is_stopped_but_has_cancelled_ends_its_run(team, slurm):
    """Slurm 22.05's squeue says STOPPED (a flag, in place of the base state) for a job it has cancelled, until the
    job leaves the queue (captured: scancelled while its SIGSTOP was on its way); sacct says CANCELLED."""
    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    slurm.stopped_after_cancel(as_id="18004")
    assert poll_slurm_runs() == {run.pk: "failed"}
    run.refresh_from_db()
    assert run.state == RunState.FAILED and run.exit_reason == "SLURM job 18004: the SLURM job was cancelled"

    running = _submitted(team)  # while sacct says it runs, squeue's STOPPED stands
    run_transition(run_id=running.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    slurm.captured(job=6, as_id="18004")
    slurm.job("sacct", 17104, as_id="18004")
    [record] = slurm.answers["sacct"]["jobs"]
    slurm.answer("sacct", jobs=[record | {"state": {"current": ["RUNNING"], "reason": "None"}}])
    assert poll_slurm_runs() == {running.pk: "running"}

    slurm.answer("squeue", jobs=[])  # gone from the queue, and accounting has no record of it (yet): not "unknown"
    slurm.answer("sacct", **json.loads(SACCT_22_05_NOTHING_FOUND.read_text()))
    assert poll_slurm_runs() == {running.pk: "unreadable: sacct: SLURM reported errors: Nothing found"}
    assert Run.objects.get(pk=running.pk).state == RunState.RUNNING


@pytest.mark.django_db
def test_a_job_slurm_requeues_takes_its_run_back_to_launching_not_lost_nor_restarted_beside_it(team, slurm, asks):
    """`scontrol requeue` (or a node failure with --requeue): SLURM kills the job's processes and queues it again
    (captured: PENDING, BeginTime, restart_cnt 1), to start the engine again itself. The run goes back to launching,
    said once with SLURM's restart count; its silence meanwhile does not make it lost, so the reconciler neither
    scancels SLURM's requeue nor restarts the run beside it, and its own restarts are not spent; its engine's report
    makes it running again, its start time kept. On the old code the run stayed running, the poll said "queued", and
    the reconciler took it for lost and asked for the job to be stopped."""
    from forgeboard.runs.services import run_reported_in

    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    started_at = Run.objects.get(pk=run.pk).started_at
    Run.objects.filter(pk=run.pk).update(max_restarts=2, last_heartbeat_at=timezone.now() - timedelta(seconds=30))
    slurm.captured(job=3, as_id="18004")

    assert poll_slurm_runs() == {run.pk: "requeued"}
    assert poll_slurm_runs() == {run.pk: "queued"}, "followed as a queued job, and said once"

    run.refresh_from_db()
    assert (run.state, run.job_id, run.restart_count) == (RunState.LAUNCHING, "18004", 0)
    assert run.exit_reason == ("SLURM job 18004 is back in the scheduler's queue: requeued by SLURM (restart 1): "
                               "waiting in the SLURM queue (BeginTime)")
    moves = RunEvent.objects.filter(run=run, kind="state_changed").order_by("seq")
    assert [m.payload["to"] for m in moves] == ["queued", "launching", "running", "launching"]
    report = runs_reconcile(now=timezone.now() + timedelta(hours=1))
    assert (report.lost, report.stopping, report.restarted) == ([], [], [])
    assert not [a for a in asks if a["name"] == "runs.stop_attempt"] and slurm.calls("scancel") == []

    slurm.job("squeue", 18004, as_id="18004")  # SLURM runs it again, and its engine reports in
    assert poll_slurm_runs() == {run.pk: "running"}
    assert Run.objects.get(pk=run.pk).state == RunState.LAUNCHING, "until its engine reports in"
    run_reported_in(run=Run.objects.get(pk=run.pk))
    run.refresh_from_db()
    assert (run.state, run.started_at, run.restart_count) == (RunState.RUNNING, started_at, 0)


@pytest.mark.django_db
def test_a_paused_runs_job_that_completes_ends_the_run_succeeded(team, slurm):
    """An engine leaves its pause only for a resume or a cancel: a job that completes while its run reads paused was
    resumed and finished. On the old code paused -> succeeded was refused, the poll said 'moved meanwhile', and the run
    stayed paused until the reconciler took it for lost."""
    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.PAUSED)
    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17101, as_id="18004")  # COMPLETED, exit 0

    assert poll_slurm_runs() == {run.pk: "succeeded"}

    run.refresh_from_db()
    assert (run.state, run.exit_reason) == (RunState.SUCCEEDED, "SLURM job 18004: the job completed with exit code 0")


@pytest.mark.django_db
def test_a_requeued_job_whose_engine_never_reports_in_again_loses_its_run_which_restarts_once_the_job_is_gone(
        team, slurm, asks, settings):
    """SLURM runs the requeued job again, but its engine never reports in (it hangs importing on a broken node, it
    cannot reach the control plane): the run, back in launching, is followed as a job SLURM restarts, never lost for
    its silence, so on the old code it stayed launching for ever, holding its nodes (the poll said "running"). Its
    engine has ENGINE_START_TIMEOUT_S from the poll that first saw its job running again: neither the job's first run
    (hours) nor its time back in the queue (hours) counts. Past it the run is lost, saying so, and restarts only once its
    job is confirmed gone: scancelled, not beside it."""
    from forgeboard.runs.services import run_reported_in
    from workers.launch.backends import stop_attempt

    def later(**elapsed) -> None:  # time passes: what the polls recorded is that much older
        RunEvent.objects.filter(run=run).update(created_at=F("created_at") - timedelta(**elapsed))

    settings.ENGINE_START_TIMEOUT_S = 900
    run = _submitted(team)
    Run.objects.filter(pk=run.pk).update(max_restarts=2)
    slurm.job("squeue", 18004, as_id="18004")  # RUNNING on gpu-[001-002]
    assert poll_slurm_runs() == {run.pk: "running"}
    run_reported_in(run=Run.objects.get(pk=run.pk))
    later(hours=5)
    slurm.captured(job=3, as_id="18004")  # requeued: PENDING (BeginTime)
    assert poll_slurm_runs() == {run.pk: "requeued"}
    later(hours=2)
    assert poll_slurm_runs() == {run.pk: "queued"}
    # SLURM runs it again; this squeue gives no start time (test_the_engine_start_up_clock_starts_when_slurm_... for
    # one that does): the clock starts at the poll that first sees it running
    slurm.job("squeue", 18004, as_id="18004", no_start_time=True)
    assert poll_slurm_runs() == {run.pk: "running"}, "neither its first run nor its time queued counts"
    later(seconds=899)
    assert poll_slurm_runs() == {run.pk: "running"}
    assert Run.objects.get(pk=run.pk).state == RunState.LAUNCHING
    later(seconds=13)

    assert poll_slurm_runs() == {run.pk: "lost"}

    run.refresh_from_db()
    assert (run.state, run.job_id) == (RunState.LOST, "18004")
    assert run.exit_reason == ("SLURM job 18004 ran for 912 s on gpu-[001-002] and its engine never reported in "
                               "(start-up timeout 900 s)")
    assert poll_slurm_runs() == {}, "the reconciler's now"
    report = runs_reconcile(now=timezone.now())
    assert (report.stopping, report.restarted) == ([run.pk], [])
    [ask] = [a["kwargs"] for a in asks if a["name"] == "runs.stop_attempt"]
    assert ask["job_id"] == "18004"
    assert stop_attempt(**ask) == "still stopping", "scancelled, SLURM still runs it"
    assert [c["args"] for c in slurm.calls("scancel")] == [["18004"]]
    assert Run.objects.get(pk=run.pk).state == RunState.LOST, "not restarted beside its job"
    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17104, as_id="18004")  # CANCELLED
    assert stop_attempt(**ask).endswith("; restarted")
    run.refresh_from_db()
    assert (run.state, run.restart_count, run.job_id) == (RunState.QUEUED, 1, "")


@pytest.mark.django_db
@pytest.mark.parametrize(("launching_ago", "started_ago", "said", "reason"), [
    # SLURM gives whole seconds: 1200 s, and the time this test has taken since
    (30, 20, "lost", r"SLURM job 18004 ran for 12[0-5]\d s on gpu-\[001-002\] and its engine never reported in "
                     r"\(start-up timeout 900 s\)"),
    (30, 1, "running", None),
    (5, 20, "running", None),  # a start SLURM gives from before the run last went launching does not count
])
def test_the_engine_start_up_clock_starts_when_slurm_started_the_job_not_when_a_poll_first_saw_it(
        team, slurm, settings, launching_ago, started_ago, said, reason):
    """The worker was down (or its poll late): the poll sees a launching run's job running for the first time now,
    but SLURM says it started that job `started_ago` minutes ago (squeue's start_time). Its engine's start-up time
    counts from then, or from when the run went launching if that is later: a job started 20 minutes ago is lost at
    once past a 15-minute timeout. On the old code the clock started at this poll, and the run stayed launching for
    another 15 minutes."""
    settings.ENGINE_START_TIMEOUT_S = 900
    run = _submitted(team)
    RunEvent.objects.filter(run=run).update(created_at=F("created_at") - timedelta(minutes=launching_ago))
    slurm.job("squeue", 18004, as_id="18004", started_ago=timedelta(minutes=started_ago))  # RUNNING on gpu-[001-002]

    assert poll_slurm_runs() == {run.pk: said}

    run.refresh_from_db()
    assert run.state == (RunState.LOST if said == "lost" else RunState.LAUNCHING)
    if reason is not None:
        assert re.fullmatch(reason, run.exit_reason), run.exit_reason
