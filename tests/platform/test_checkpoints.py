"""A run's checkpoints: listed from its folder and events, exported as HF folders, new runs started from them."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from django.db import connection
from django.utils import timezone

from forgeboard.audit.models import AuditEvent
from forgeboard.errors import NotFound, PermissionDenied, ValidationFailed
from forgeboard.experiments.services import experiment_create
from forgeboard.runs import checkpoints
from forgeboard.runs.checkpoints import (
    STATE_FILE,
    ExportFailed,
    checkpoint_export,
    checkpoint_export_request,
    checkpoints_on_disk,
    checkpoints_reported,
    run_checkpoints,
    run_launch_from_checkpoint,
    run_launch_from_checkpoint_request,
)
from forgeboard.runs.models import CheckpointExport, PendingChildRun, Run
from forgeboard.runs.services import run_launch
from forgeboard.telemetry.models import EventKind
from forgeboard.telemetry.services import event_append
from workers.launch.local import REPO_DIR, engine_config_yaml, run_dir


@pytest.fixture
def data_dir(settings, tmp_path: Path) -> Path:
    settings.DATA_DIR = tmp_path / "data"
    return settings.DATA_DIR


def _write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


@pytest.fixture
def run_with_checkpoints(team, grpo_yaml, data_dir) -> Run:
    """step 2 and 4 complete on disk; an unfinished temp folder and a folder without trainer.pt beside them."""
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml, priority=7)
    folder = run_dir(run) / "checkpoints"
    _write(folder / "step_000002" / "trainer.pt", 100)
    _write(folder / "step_000002" / "config.json", 20)
    _write(folder / "step_000004" / "trainer.pt", 300)
    _write(folder / ".tmp_step_000006" / "trainer.pt", 5)
    _write(folder / "step_000005" / "config.json", 5)
    _write(folder / "notes.txt", 5)
    event_append(run=run, kind=EventKind.CHECKPOINT_SAVED, payload={"step": 1, "path": "/elsewhere/step_000001"})
    event_append(run=run, kind=EventKind.CHECKPOINT_SAVED, payload={"step": 4, "path": str(folder / "step_000004")})
    event_append(run=run, kind=EventKind.CHECKPOINT_SAVED, payload={"step": "five", "path": 3})
    return run


def _fake_export(run: Run, step: int) -> Path:
    out = run_dir(run) / "exports" / f"step_{step}"
    _write(out / "config.json", 10)
    _write(out / "model.safetensors", 10)
    return out


def test_checkpoints_are_listed_from_disk_and_events(run_with_checkpoints):
    run = run_with_checkpoints
    listed = run_checkpoints(run=run)
    assert [(c.step, c.size_bytes) for c in listed] == [(1, None), (2, 120), (4, 300)]
    assert listed[1].path == str(run_dir(run) / "checkpoints" / "step_000002")
    assert listed[0].path == "/elsewhere/step_000001"  # reported, then pruned or on another machine
    assert all(c.created_at.tzinfo is not None for c in listed)
    assert [(c.step, c.size_bytes) for c in checkpoints_reported(run=run)] == [(1, None), (4, 300)]


def test_a_run_never_lists_measures_or_exports_another_runs_checkpoint(team, grpo_yaml, run_with_checkpoints):
    """A run's engine can report any path, and a link in its folder can point anywhere: the checkpoints table
    shows another run's checkpoint as a bare report (no size: nothing about that folder is read), and a link to it
    is neither listed nor exported."""
    run = run_with_checkpoints
    other = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    theirs = run_dir(other) / "checkpoints" / "step_000007"
    _write(theirs / STATE_FILE, 700)
    event_append(run=run, kind=EventKind.CHECKPOINT_SAVED, payload={"step": 7, "path": str(theirs)})
    event_append(run=run, kind=EventKind.CHECKPOINT_SAVED, payload={"step": 8, "path": "/tmp/" + "a" * 5000})
    (run_dir(run) / "checkpoints" / "step_000009").symlink_to(theirs, target_is_directory=True)
    listed = {c.step: c.size_bytes for c in run_checkpoints(run=run)}
    assert listed == {1: None, 2: 120, 4: 300, 7: None, 8: None}, listed
    with pytest.raises(NotFound, match="no checkpoint at step 9"):
        checkpoint_export(actor=team.member, run=run, step=9)
    assert [c.step for c in checkpoints_on_disk(run=other)] == [7]  # its own run still has it


def test_a_reported_path_no_file_system_can_look_up_leaves_the_run_page_working(client, team, run_with_checkpoints):
    """A run's engine reports a checkpoint in its own folder under a name longer than a file system allows: the run
    page and its checkpoints table still open, and list that step as a bare report (no size)."""
    run = run_with_checkpoints
    too_long = run_dir(run) / ("a" * 300) / "step_000011"
    event_append(run=run, kind=EventKind.CHECKPOINT_SAVED, payload={"step": 11, "path": str(too_long)})
    assert {c.step: c.size_bytes for c in run_checkpoints(run=run)} == {1: None, 2: 120, 4: 300, 11: None}
    client.force_login(team.member)
    for url in (f"/runs/{run.pk}/", f"/runs/{run.pk}/checkpoints/"):
        page = client.get(url)
        assert page.status_code == 200, url
        assert "a" * 300 + "/step_000011" in page.content.decode()


def test_a_reported_step_no_export_can_have_leaves_the_checkpoints_table_working(client, team, run_with_checkpoints):
    """An engine reports a step past any a path or an export can name, once the run has an export folder: the table
    still opens, with no export status for that step."""
    run = run_with_checkpoints
    _fake_export(run, 2)
    event_append(run=run, kind=EventKind.CHECKPOINT_SAVED, payload={"step": 10**300, "path": "/elsewhere/step_x"})
    assert [(c.step, c.export and c.export.summary) for c in run_checkpoints(run=run)] == [
        (1, None), (2, "exported"), (4, None), (10**300, None)]
    client.force_login(team.member)
    assert client.get(f"/runs/{run.pk}/checkpoints/").status_code == 200


def test_export_checks_role_step_and_that_the_checkpoint_is_here(team, run_with_checkpoints):
    run = run_with_checkpoints
    with pytest.raises(PermissionDenied):
        checkpoint_export(actor=team.viewer, run=run, step=2)
    for bad in (-1, "2", True, 2.0, None):
        with pytest.raises(ValidationFailed) as raised:
            checkpoint_export(actor=team.member, run=run, step=bad)
        assert raised.value.problems[0].field == "step"
    for missing in (1, 3, 5, 6):  # 1 is only reported; 5 has no trainer.pt; 6 is unfinished
        with pytest.raises(NotFound, match=f"no checkpoint at step {missing}"):
            checkpoint_export(actor=team.member, run=run, step=missing)
    assert not (run_dir(run) / "exports").exists()


def test_an_export_that_exists_is_returned_as_it_is(team, run_with_checkpoints):
    out = _fake_export(run_with_checkpoints, 4)
    assert checkpoint_export(actor=team.member, run=run_with_checkpoints, step=4) == out


FAILING_EXPORTER = """\
import sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True)
(out / "model.safetensors").write_bytes(b"half")
print("RuntimeError: trainer.pt is not a checkpoint", file=sys.stderr)
sys.exit(1)
"""


def test_a_failed_export_leaves_nothing_behind(team, run_with_checkpoints, tmp_path, monkeypatch):
    # The real exporter is exercised below; this one fails after writing half of its output.
    exporter = tmp_path / "failing_exporter.py"
    exporter.write_text(FAILING_EXPORTER)
    monkeypatch.setattr(checkpoints, "ENGINE_COMMAND", (sys.executable, str(exporter)))
    with pytest.raises(ExportFailed, match="step 2 of run .* failed .exit 1.: RuntimeError: trainer.pt is not a"):
        checkpoint_export(actor=team.member, run=run_with_checkpoints, step=2)
    assert list((run_dir(run_with_checkpoints) / "exports").iterdir()) == []
    assert not AuditEvent.objects.filter(action="checkpoint.export").exists()


def test_launch_from_checkpoint_makes_a_child_run(team, run_with_checkpoints):
    parent = run_with_checkpoints
    out = _fake_export(parent, 2)
    with pytest.raises(PermissionDenied):
        run_launch_from_checkpoint(actor=team.viewer, run=parent, step=2)
    with pytest.raises(ValidationFailed) as raised:
        run_launch_from_checkpoint(actor=team.member, run=parent, step=4, overrides=["trainer.steps=0"])
    assert raised.value.problems[0].field == "config.trainer.steps"
    with pytest.raises(ValidationFailed) as raised:
        run_launch_from_checkpoint(actor=team.member, run=parent, step=2, overrides="trainer.steps=3")
    assert raised.value.problems[0].field == "overrides"
    assert Run.objects.count() == 1 and not (run_dir(parent) / "exports" / "step_4").exists()

    child = run_launch_from_checkpoint(actor=team.member, run=parent, step=2, overrides=["trainer.steps=3"])
    assert (child.parent, child.experiment, child.number, child.priority) == (parent, parent.experiment, 2, 7)
    assert child.config.parsed["model"]["artifact"] == f"run:{parent.pk}@step:2"
    assert child.artifact_paths["model.path"] == str(out)
    assert yaml.safe_load(engine_config_yaml(child))["model"]["path"] == str(out)
    assert child.config.parsed["checkpoint"]["resume_from"] is None
    assert child.config.parsed["trainer"]["steps"] == 3
    assert child.config.parsed["grpo"] == parent.config.parsed["grpo"]
    entry = AuditEvent.objects.get(action="run.launch_from_checkpoint")
    assert entry.payload == {"parent": parent.pk, "step": 2, "model_path": str(out)}


def _engine(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(REPO_DIR), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "workers.engine", *args], cwd=REPO_DIR, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_real_engine_checkpoint_is_exported_and_a_run_starts_from_it(team, data_dir, tmp_path):
    from safetensors.numpy import load_file

    from workers.engine.config import parse_config_mapping
    from workers.engine.preflight import preflight_errors

    tiny = tmp_path / "tiny"
    _engine("make-tiny-model", "--family", "qwen3", "--hidden-size", "32", "--out", str(tiny))
    sft = experiment_create(actor=team.owner, project=team.project, name="sft", recipe="sft")
    yaml_text = (f"recipe: sft\nmodel: {{family: qwen3, path: '{tiny}'}}\n"
                 "data: {max_operand: 5, train_size: 16, eval_size: 2, seq_len: 64}\n"
                 "trainer: {steps: 2, batch_size: 2, micro_batch_size: 2, optimizer: {lr: 0.01}}\n"
                 "eval: {every_steps: 0}\ntelemetry: {console: false}\n")
    parent = run_launch(actor=team.member, experiment=sft, config_yaml=yaml_text)
    config = run_dir(parent) / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(yaml_text)
    _engine("train", "--config", str(config), f"checkpoint.folder={run_dir(parent) / 'checkpoints'}")
    [saved] = run_checkpoints(run=parent)
    assert saved.step == 2 and saved.size_bytes > 0

    child = run_launch_from_checkpoint(actor=team.member, run=parent, step=2)
    engine_config = yaml.safe_load(engine_config_yaml(child))
    exported = Path(engine_config["model"]["path"])
    assert exported == run_dir(parent) / "exports" / "step_2"
    trained, initial = load_file(exported / "model.safetensors"), load_file(tiny / "model.safetensors")
    assert trained.keys() == initial.keys()
    assert any((trained[k] != initial[k]).any() for k in trained), "the export holds the untrained weights"
    assert preflight_errors(parse_config_mapping(engine_config)) == []
    assert [p.name for p in exported.parent.iterdir()] == ["step_2"]  # no temp folder left


# --- export off the request: POST queues a task (202), GET polls ---------------------------------------

SUCCEEDING_EXPORTER = """\
import sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True)
(out / "config.json").write_text("{}")
(out / "model.safetensors").write_bytes(b"weights")
"""


@pytest.fixture
def export_api(client, team, run_with_checkpoints, monkeypatch):
    """An API caller with write and read tokens; queued export tasks are recorded instead of sent."""
    from forgeboard.accounts.services import api_token_create
    from workers.celery import app

    _, write = api_token_create(actor=team.member, project=team.project, name="ci-write", scope="write")
    _, read = api_token_create(actor=team.member, project=team.project, name="ci-read", scope="read")
    sent: list[tuple[str, list, dict]] = []
    queues: list[str | None] = []
    monkeypatch.setattr(app, "send_task", lambda name, args, **kw: (sent.append((name, args, kw.get("kwargs") or {})),
                                                                     queues.append(kw.get("queue"))))

    def call(method: str, step: object, token: str = write):
        return getattr(client, method)(f"/api/v1/runs/{run_with_checkpoints.pk}/checkpoints/{step}/export",
                                       HTTP_AUTHORIZATION=f"Bearer {token}")

    return SimpleNamespace(call=call, sent=sent, queues=queues, read=read, run=run_with_checkpoints)


def _run_queued_tasks(api) -> None:
    """What a worker does with the queued messages: the real task, with the recorded arguments."""
    from workers.tasks import export_checkpoint

    while api.sent:
        name, args, kwargs = api.sent.pop(0)
        assert name == "checkpoints.export"
        export_checkpoint.apply(args=args, kwargs=kwargs)


def test_the_api_queues_an_export_and_the_client_polls_it(export_api, tmp_path, monkeypatch,
                                                          django_capture_on_commit_callbacks):
    api = export_api
    assert api.call("get", 2).status_code == 404  # never asked for
    with django_capture_on_commit_callbacks(execute=True):
        answer = api.call("post", 2)
    assert answer.status_code == 202, answer.content
    assert answer.json()["state"] == "queued" and answer.json()["path"] is None
    with django_capture_on_commit_callbacks(execute=True):
        again = api.call("post", 2)
    assert again.status_code == 202 and again.json()["state"] == "queued"
    assert len(api.sent) == 1  # asked twice, queued once
    assert api.call("get", 2, api.read).json()["state"] == "queued"  # a read-only token may poll

    exporter = tmp_path / "failing_exporter.py"
    exporter.write_text(FAILING_EXPORTER)
    monkeypatch.setattr(checkpoints, "ENGINE_COMMAND", (sys.executable, str(exporter)))
    _run_queued_tasks(api)
    failed = api.call("get", 2).json()
    assert failed["state"] == "failed" and "RuntimeError: trainer.pt is not a checkpoint" in failed["error"]

    exporter.write_text(SUCCEEDING_EXPORTER)
    with django_capture_on_commit_callbacks(execute=True):
        assert api.call("post", 2).json()["state"] == "queued"  # a failed export is queued again
    _run_queued_tasks(api)
    done = api.call("get", 2).json()
    out = run_dir(api.run) / "exports" / "step_2"
    assert (done["state"], done["path"], done["error"]) == ("done", str(out), "")
    with django_capture_on_commit_callbacks(execute=True):
        sync = api.call("post", 2)
    assert sync.status_code == 200 and sync.json()["path"] == str(out)  # already exported: answered at once
    assert api.sent == []
    assert sorted(p.name for p in out.parent.iterdir()) == ["step_2"]  # no status file or temp folder left
    assert AuditEvent.objects.filter(action="checkpoint.export").count() == 1
    assert AuditEvent.objects.filter(action="checkpoint.export_request").count() == 2


def test_export_requests_are_checked_before_anything_is_queued(export_api, team, client):
    api = export_api
    assert api.call("post", 2, api.read).status_code == 403  # read-only token
    for bad in (-1, 2**63):
        answer = api.call("post", bad)
        assert answer.status_code == 400, answer.content
        assert answer.json()["errors"][0]["field"] == "step"
    for missing in (1, 3, 5):
        answer = api.call("post", missing)
        assert answer.status_code == 404 and f"no checkpoint at step {missing}" in answer.json()["message"]
    client.force_login(team.viewer)
    as_viewer = client.post(f"/api/v1/runs/{api.run.pk}/checkpoints/2/export")
    assert as_viewer.status_code == 403 and "needs the member role" in as_viewer.json()["message"]
    assert api.sent == [] and not (run_dir(api.run) / "exports").exists()


def _status_reads_wait_for_each_other(monkeypatch) -> None:
    """Each of two requests' first read of an export's status waits until the other has read too (the race the run's
    row lock closes); a request that cannot read before the other writes goes on alone after 2 s."""
    both_read = threading.Barrier(2, timeout=2)
    read_status, first_read = checkpoints._read_status, threading.local()

    def read_then_wait_for_the_other(**kwargs):
        status = read_status(**kwargs)
        if not getattr(first_read, "done", False):
            first_read.done = True
            with contextlib.suppress(threading.BrokenBarrierError):
                both_read.wait()
        return status

    monkeypatch.setattr(checkpoints, "_read_status", read_then_wait_for_the_other)


@pytest.mark.django_db(transaction=True)
def test_two_export_requests_at_once_queue_one_export(team, run_with_checkpoints, monkeypatch):
    """Two requests (two operators, or a retry) for one checkpoint each read 'never asked for' before either wrote
    'queued', and both queued an export: the checkpoint was exported twice at once. Now a request reads and writes
    the status under the run's row lock, so the second finds the first's 'queued'."""
    run = run_with_checkpoints
    queued: list[int] = []
    monkeypatch.setattr(checkpoints, "_enqueue_export", lambda *, run_id, step, attempt: queued.append(step))
    _status_reads_wait_for_each_other(monkeypatch)
    answers: list[str] = []

    def request() -> None:
        try:
            answers.append(checkpoint_export_request(actor=team.member, run=Run.objects.get(pk=run.pk), step=2).state)
        finally:
            connection.close()

    threads = [threading.Thread(target=request) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert answers == ["queued", "queued"]
    assert queued == [2], "one export queued for two requests"


def test_an_export_goes_to_the_pool_of_the_host_the_run_ran_on(export_api, team,
                                                                django_capture_on_commit_callbacks):
    from forgeboard.cluster.services import host_register

    api = export_api
    with django_capture_on_commit_callbacks(execute=True):
        api.call("post", 2)  # no inventory host: the default queue
    host_register(actor=team.operator, hostname="node-a", pool="gpu-a")
    Run.objects.filter(pk=api.run.pk).update(allocation={"node-a": {"gpus": 0, "slots": 1}})
    with django_capture_on_commit_callbacks(execute=True):
        api.call("post", 4)
    assert api.queues == [None, "launch.gpu-a"]


# --- the dashboard's "start a new run from here": the export runs in a worker, then the run starts -----

@pytest.fixture
def export_worker(monkeypatch, tmp_path) -> SimpleNamespace:
    """Queued tasks recorded (name, args, keyword arguments) instead of sent; the exporter succeeds unless its
    script (`exporter`) is rewritten."""
    from workers.celery import app

    sent: list[tuple[str, list, dict]] = []
    monkeypatch.setattr(app, "send_task", lambda name, args, **kw: sent.append((name, args, kw.get("kwargs") or {})))
    exporter = tmp_path / "exporter.py"
    exporter.write_text(SUCCEEDING_EXPORTER)
    monkeypatch.setattr(checkpoints, "ENGINE_COMMAND", (sys.executable, str(exporter)))
    return SimpleNamespace(sent=sent, exporter=exporter)


@pytest.fixture
def dashboard(client, team, run_with_checkpoints, export_worker):
    """A member logged in; queued tasks recorded (with their keyword arguments) instead of sent."""
    client.force_login(team.member)
    parent = run_with_checkpoints
    return SimpleNamespace(client=client, sent=export_worker.sent, exporter=export_worker.exporter, parent=parent,
                           url=f"/runs/{parent.pk}/checkpoints/2/launch/")


def _work(sent: list[tuple[str, list, dict]]) -> None:
    from workers.tasks import export_checkpoint

    while sent:
        name, args, kwargs = sent.pop(0)
        assert name == "checkpoints.export"
        export_checkpoint.apply(args=args, kwargs=kwargs)


def test_start_a_new_run_from_here_exports_in_a_worker_then_starts_the_run(dashboard, django_capture_on_commit_callbacks):
    from forgeboard.telemetry.models import RunEvent

    parent = dashboard.parent
    with django_capture_on_commit_callbacks(execute=True):
        answer = dashboard.client.post(dashboard.url)
    assert answer.status_code == 302 and answer.url == f"/runs/{parent.pk}/", "back on the parent's page at once"
    assert Run.objects.count() == 1 and not (run_dir(parent) / "exports" / "step_2").exists(), "nothing exported yet"
    assert "exporting step 2; the new run starts when the export is done" in dashboard.client.get(answer.url).content.decode()
    assert [(name, kwargs) for name, _, kwargs in dashboard.sent] == [("checkpoints.export", {"attempt": 1})]
    assert [(p.step, p.overrides) for p in PendingChildRun.objects.filter(parent=parent)] == [(2, [])], \
        "the run waits for the export"

    _work(dashboard.sent)
    child = Run.objects.get(parent=parent)
    assert child.config.parsed["model"]["artifact"] == f"run:{parent.pk}@step:2"
    assert yaml.safe_load(engine_config_yaml(child))["model"]["path"] == str(run_dir(parent) / "exports" / "step_2")
    started = RunEvent.objects.get(run=parent, kind="message", payload__name="child_run_started")
    assert started.payload == {"name": "child_run_started", "step": 2, "run": child.pk, "number": child.number,
                               "experiment": parent.experiment.name}
    assert AuditEvent.objects.filter(action="checkpoint.launch_request").count() == 1

    # exported now: the next click starts a run at once, with no task
    with django_capture_on_commit_callbacks(execute=True):
        again = dashboard.client.post(dashboard.url)
    second = Run.objects.filter(parent=parent).order_by("-pk").first()
    assert second != child and again.url == f"/runs/{second.pk}/"
    assert [name for name, _, _ in dashboard.sent] == ["runs.launch"], "no export task, only the new run's launch"


def test_a_failed_export_says_on_the_timeline_why_no_run_started(dashboard, django_capture_on_commit_callbacks):
    from forgeboard.telemetry.models import RunEvent

    dashboard.exporter.write_text(FAILING_EXPORTER)
    with django_capture_on_commit_callbacks(execute=True):
        dashboard.client.post(dashboard.url)
    _work(dashboard.sent)
    assert Run.objects.count() == 1
    failed = RunEvent.objects.get(run=dashboard.parent, kind="message", payload__name="child_run_failed")
    assert failed.payload["step"] == 2
    assert failed.payload["reason"].startswith("exporting step 2: exporting step 2 of run")
    assert "RuntimeError: trainer.pt is not a checkpoint" in failed.payload["reason"]


def test_a_token_that_expires_before_its_export_runs_fails_only_its_own_run(client, team, run_with_checkpoints,
                                                                           export_worker,
                                                                           django_capture_on_commit_callbacks):
    """A CI token asks for a run from a checkpoint (202, the export is queued) and expires before a worker gets to it:
    the checkpoint is exported (the system exports for the project; the token was checked when it asked) but no run
    starts, and the parent's timeline says the token may no longer do it (as a revoked token, or one whose creator
    left the project)."""
    from datetime import timedelta

    from django.utils import timezone

    from forgeboard.accounts.models import ApiToken
    from forgeboard.accounts.services import api_token_create
    from forgeboard.telemetry.models import RunEvent

    parent = run_with_checkpoints
    token, raw = api_token_create(actor=team.member, project=team.project, name="ci", scope="write",
                                  expires_at=timezone.now() + timedelta(hours=1))
    with django_capture_on_commit_callbacks(execute=True):
        queued = client.post(f"/api/v1/runs/{parent.pk}/checkpoints/2/runs", {}, content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert queued.status_code == 202, queued.content
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    _work(export_worker.sent)
    assert not Run.objects.filter(parent=parent).exists()
    assert (run_dir(parent) / "exports" / "step_2" / "config.json").is_file()
    failed = RunEvent.objects.get(run=parent, kind="message", payload__name="child_run_failed")
    assert "you are not a member of project 'alpha'" in failed.payload["reason"]


def test_a_first_asker_who_lost_access_fails_no_one_elses_run(client, team, run_with_checkpoints, export_worker,
                                                                django_capture_on_commit_callbacks):
    """A CI token asks for a run from a checkpoint and queues its export; a member asks for another while it is
    queued; the token is revoked before a worker gets to the export. The export ran as the token, so it failed and
    took the member's run down with it. Now the system exports on behalf of the project (each asker was checked when
    they asked): the member's run starts, the token's alone fails with its reason, and the audit record of the
    export says who asked for it."""
    from forgeboard.accounts.services import api_token_create, api_token_revoke
    from forgeboard.telemetry.models import RunEvent

    parent = run_with_checkpoints
    token, raw = api_token_create(actor=team.member, project=team.project, name="ci", scope="write")
    with django_capture_on_commit_callbacks(execute=True):
        queued = client.post(f"/api/v1/runs/{parent.pk}/checkpoints/2/runs", {"overrides": ["trainer.steps=2"]},
                             content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert queued.status_code == 202, queued.content
    with django_capture_on_commit_callbacks(execute=True):
        waiting = run_launch_from_checkpoint_request(actor=team.member, run=parent, step=2,
                                                     overrides=["trainer.steps=3"])
    assert waiting.state == "queued" and len(export_worker.sent) == 1, "one export for both"
    api_token_revoke(actor=team.member, token=token)

    _work(export_worker.sent)
    [child] = Run.objects.filter(parent=parent)
    assert child.config.parsed["trainer"]["steps"] == 3 and child.launched_by == team.member
    assert RunEvent.objects.filter(run=parent, payload__name="child_run_started", payload__run=child.pk).exists()
    [failed] = RunEvent.objects.filter(run=parent, kind="message", payload__name="child_run_failed")
    assert "you are not a member of project 'alpha'" in failed.payload["reason"], failed.payload
    export = AuditEvent.objects.get(action="checkpoint.export")
    assert export.actor_label == "system" and export.payload["requested_by"] == f"token:{token.prefix}"
    launched = AuditEvent.objects.get(action="run.launch_from_checkpoint")
    assert launched.actor == team.member and launched.target_id == str(child.pk)


def test_start_from_a_checkpoint_is_checked_before_anything_is_queued(dashboard, team, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        missing = dashboard.client.post(f"/runs/{dashboard.parent.pk}/checkpoints/3/launch/")
    assert missing.status_code == 302, "back to the run page, which says why"
    assert "has no checkpoint at step 3" in dashboard.client.get(missing.url).content.decode()
    dashboard.client.force_login(team.viewer)
    with django_capture_on_commit_callbacks(execute=True):
        refused = dashboard.client.post(dashboard.url)
    assert refused.status_code == 403
    assert dashboard.sent == [] and Run.objects.count() == 1


def test_start_a_new_run_from_here_sent_twice_asks_once(dashboard, django_capture_on_commit_callbacks):
    """The button's form carries an idempotency key: a double click, or the form sent again, starts one run."""
    from forgeboard.idempotency.models import IdempotentRequest

    table = dashboard.client.get(f"/runs/{dashboard.parent.pk}/checkpoints/").content.decode()
    key = re.search(r'name="idempotency_key" value="([0-9a-f]{32})"', table).group(1)
    with django_capture_on_commit_callbacks(execute=True):
        missing = dashboard.client.post(f"/runs/{dashboard.parent.pk}/checkpoints/3/launch/", {"idempotency_key": key})
    assert missing.status_code == 302 and not IdempotentRequest.objects.exists(), "a refusal keeps no answer"
    with django_capture_on_commit_callbacks(execute=True):
        answers = [dashboard.client.post(dashboard.url, {"idempotency_key": key}) for _ in range(2)]
    assert [a.status_code for a in answers] == [302, 302] and answers[0].url == answers[1].url
    assert "Idempotent-Replayed" not in answers[0] and answers[1]["Idempotent-Replayed"] == "true"
    assert [name for name, _, _ in dashboard.sent] == ["checkpoints.export"], "one export, for one run"
    assert AuditEvent.objects.filter(action="checkpoint.launch_request").count() == 1



@pytest.mark.django_db(transaction=True)
def test_two_runs_started_from_one_checkpoint_at_once_share_one_export(team, run_with_checkpoints, export_worker,
                                                                        monkeypatch):
    """Two members (or two CI jobs) start a run from the same checkpoint at once. Each request queued an export of its
    own (a second request, even a minute later, queued a second export while the first was queued or running), so
    two workers exported one checkpoint side by side. Now the second request finds the first's export under the
    run's row lock and waits for it: one export is queued, and it starts both runs from the exported weights."""
    from forgeboard.telemetry.models import RunEvent
    from workers.tasks import export_checkpoint

    parent = run_with_checkpoints
    _status_reads_wait_for_each_other(monkeypatch)
    answers: list[object] = []

    def request(steps: int) -> None:
        try:
            answers.append(run_launch_from_checkpoint_request(actor=team.member, run=Run.objects.get(pk=parent.pk),
                                                              step=2, overrides=[f"trainer.steps={steps}"]))
        except BaseException as error:  # noqa: BLE001 - asserted below
            answers.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=request, args=(steps,)) for steps in (2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [getattr(answer, "state", answer) for answer in answers] == ["queued", "queued"], answers
    [(name, args, kwargs)] = export_worker.sent
    assert name == "checkpoints.export", "one export for two runs"

    export_checkpoint.apply(args=args, kwargs=kwargs)
    children = list(Run.objects.filter(parent=parent).order_by("pk"))
    assert sorted(child.config.parsed["trainer"]["steps"] for child in children) == [2, 3]
    export = str(run_dir(parent) / "exports" / "step_2")
    assert [child.artifact_paths["model.path"] for child in children] == [export, export]
    started = RunEvent.objects.filter(run=parent, kind="message", payload__name="child_run_started")
    assert sorted(event.payload["run"] for event in started) == [child.pk for child in children]
    assert AuditEvent.objects.filter(action="checkpoint.export").count() == 1

# --- lost exports: the run reconciler queues them again, then fails them and the runs waiting for them ---------

LONG_AGO = timedelta(hours=3)


def _lose(run: Run, step: int, **fields) -> None:
    """What a worker that died (or a task message that was lost) leaves behind: the export's state, written long ago."""
    CheckpointExport.objects.filter(run=run, step=step).update(updated_at=timezone.now() - LONG_AGO, **fields)


def _export_row(run: Run, step: int) -> CheckpointExport:
    return CheckpointExport.objects.get(run=run, step=step)


@pytest.fixture
def lost_exports(settings, team, run_with_checkpoints, export_worker, django_capture_on_commit_callbacks):
    """Two runs waiting for the export of step 2 (asked for by a member and by a CI token), and an export of step 4
    asked for just now. Exports are lost after an hour and queued again at most twice."""
    from forgeboard.accounts.services import api_token_create

    settings.EXPORT_TIMEOUT_S, settings.EXPORT_LOST_AFTER_S, settings.EXPORT_REQUEUES = 600, 3600, 2
    parent = run_with_checkpoints
    token, _ = api_token_create(actor=team.member, project=team.project, name="ci", scope="write")
    with django_capture_on_commit_callbacks(execute=True):
        for actor, steps in ((team.member, 2), (token, 3)):
            run_launch_from_checkpoint_request(actor=actor, run=parent, step=2, overrides=[f"trainer.steps={steps}"])
        checkpoint_export_request(actor=team.member, run=parent, step=4)
    assert [(args, kwargs) for _, args, kwargs in export_worker.sent] == [
        ([parent.pk, 2], {"attempt": 1}), ([parent.pk, 4], {"attempt": 1})]
    export_worker.sent.clear()
    return SimpleNamespace(parent=parent, sent=export_worker.sent, exporter=export_worker.exporter)


def test_a_lost_export_is_queued_again_then_fails_and_tells_the_runs_waiting_for_it(
        lost_exports, team, django_capture_on_commit_callbacks):
    """A worker dies while exporting (killed, out of memory, its host lost) or the export's task message is lost: the
    export said queued or running forever, and the runs waiting for it never started nor failed. Now the run
    reconciler takes an export queued or running past FORGEBOARD_EXPORT_LOST_AFTER_S for lost and queues it again,
    at most FORGEBOARD_EXPORT_REQUEUES times; then it fails with the reason, and every waiting run is told on the
    parent's timeline. An export asked for recently is left alone."""
    from forgeboard.telemetry.models import RunEvent
    from workers.tasks import export_checkpoint, reconcile_runs

    parent, sent = lost_exports.parent, lost_exports.sent
    with django_capture_on_commit_callbacks(execute=True):
        assert reconcile_runs.apply().get()["exports_requeued"] == [], "nothing lost yet"

    _lose(parent, 2)  # its task message was lost: sent again as the same attempt
    with django_capture_on_commit_callbacks(execute=True):
        report = reconcile_runs.apply().get()
    assert (report["exports_requeued"], report["exports_failed"]) == ([(parent.pk, 2)], [])
    assert [(args, kwargs) for _, args, kwargs in sent] == [([parent.pk, 2], {"attempt": 1})]
    sent.clear()
    assert (_export_row(parent, 2).state, _export_row(parent, 2).requeues) == ("queued", 1)

    _lose(parent, 2, state="running", worker="node-a pid 4242")  # a worker took it and died
    with django_capture_on_commit_callbacks(execute=True):
        assert checkpoints.checkpoint_exports_reconcile(now=timezone.now()).requeued == [(parent.pk, 2)]
    assert [(args, kwargs) for _, args, kwargs in sent] == [([parent.pk, 2], {"attempt": 2})], "a new attempt"
    sent.clear()
    export_checkpoint.apply(args=[parent.pk, 2], kwargs={"attempt": 1})  # the dead attempt's message, late
    assert not (run_dir(parent) / "exports" / "step_2").exists(), "a lost attempt never runs beside the next"
    assert (_export_row(parent, 2).state, _export_row(parent, 2).attempt) == ("queued", 2)

    _lose(parent, 2)
    with django_capture_on_commit_callbacks(execute=True):
        report = checkpoints.checkpoint_exports_reconcile(now=timezone.now())
    assert (report.requeued, report.failed) == ([], [(parent.pk, 2)]) and sent == []
    status = checkpoints.checkpoint_export_status(actor=team.viewer, run=parent, step=2)
    assert status.state == "failed"
    assert status.error == ("the export was lost 3 times; the last time it was queued for 3600 s and no worker took "
                            "it (its task was lost, or no worker of its run's pool is up)")
    told = RunEvent.objects.filter(run=parent, kind="message", payload__name="child_run_failed")
    assert [event.payload["reason"] for event in told] == [f"exporting step 2: {status.error}"] * 2, "both runs"
    assert not PendingChildRun.objects.exists() and not Run.objects.filter(parent=parent).exists()
    assert (_export_row(parent, 4).state, _export_row(parent, 4).requeues) == ("queued", 0), "a fresh one: left"

    with django_capture_on_commit_callbacks(execute=True):  # asked for again: queued afresh
        assert checkpoint_export_request(actor=team.member, run=parent, step=2).state == "queued"
    assert (_export_row(parent, 2).attempt, _export_row(parent, 2).requeues) == (3, 0)


def _told(run: Run, step: int) -> list[tuple[str, str]]:
    """What the run's timeline says of the export of `step`: each change of its state, with its words."""
    from forgeboard.telemetry.models import RunEvent

    told = RunEvent.objects.filter(run=run, kind="message", payload__name="checkpoint_export", payload__step=step)
    return [(event.payload["state"], event.payload["summary"]) for event in told.order_by("seq")]


def test_each_change_of_an_exports_state_is_told_on_the_runs_timeline(lost_exports,
                                                                      django_capture_on_commit_callbacks):
    """The run page's checkpoints table reloads on these messages, so its Export column follows the export: queued,
    queued again when it was lost, running, then exported (before the runs waiting for it start) or failed."""
    from forgeboard.telemetry.models import RunEvent
    from workers.tasks import export_checkpoint

    parent = lost_exports.parent
    assert _told(parent, 2) == [("queued", "queued")], "asked for twice, queued once"
    assert _told(parent, 4) == [("queued", "queued")]
    _lose(parent, 2)
    with django_capture_on_commit_callbacks(execute=True):
        checkpoints.checkpoint_exports_reconcile(now=timezone.now())
    export_checkpoint.apply(args=[parent.pk, 2], kwargs={"attempt": 1})
    assert _told(parent, 2) == [("queued", "queued"),
                                ("queued", "queued again after it was lost (requeue 1 of 2)"),
                                ("running", "running again after it was lost (requeue 1 of 2)"),
                                ("done", "exported")]
    names = list(RunEvent.objects.filter(run=parent, kind="message").order_by("seq")
                 .values_list("payload__name", flat=True))
    assert names[-3:] == ["checkpoint_export", "child_run_started", "child_run_started"], "done, then the runs start"

    lost_exports.exporter.write_text(FAILING_EXPORTER)
    export_checkpoint.apply(args=[parent.pk, 4], kwargs={"attempt": 1})
    export_checkpoint.apply(args=[parent.pk, 4], kwargs={"attempt": 1})  # a second copy of its message: no change
    *_, running, failed = _told(parent, 4)
    assert running == ("running", "running") and len(_told(parent, 4)) == 3
    assert failed[0] == "failed" and failed[1].startswith(f"failed: exporting step 4 of run {parent.pk} failed")


def _export_cells(client, run: Run) -> dict[int, str]:
    """What the run page's checkpoints table says of each checkpoint's export, by step."""
    html = client.get(f"/runs/{run.pk}/checkpoints/").content.decode()
    rows = re.findall(r'<tr><td class="num">(\d+)</td>.*?<td class="export">(.*?)</td>', html, re.S)
    return {int(step): re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", cell)).strip() for step, cell in rows}


def test_an_export_queued_again_says_so_in_the_api_and_on_the_run_page(lost_exports, client, team,
                                                                       django_capture_on_commit_callbacks):
    """A fresh request and an export whose worker (or task) was lost twice both read "queued" no more: the API gives
    how often it was queued again and the bound, and the page says it in words."""
    parent = lost_exports.parent
    client.force_login(team.viewer)
    api = f"/api/v1/runs/{parent.pk}/checkpoints/{{step}}/export"
    fresh = client.get(api.format(step=4)).json()
    assert (fresh["state"], fresh["requeues"], fresh["max_requeues"], fresh["summary"]) == ("queued", 0, 2, "queued")
    assert _export_cells(client, parent) == {1: "", 2: "queued", 4: "queued"}

    _lose(parent, 2)  # its task message was lost
    with django_capture_on_commit_callbacks(execute=True):
        checkpoints.checkpoint_exports_reconcile(now=timezone.now())
    again = client.get(api.format(step=2)).json()
    assert (again["state"], again["requeues"], again["max_requeues"]) == ("queued", 1, 2)
    assert again["summary"] == "queued again after it was lost (requeue 1 of 2)"
    assert _export_cells(client, parent) == {1: "", 2: "queued again after it was lost (requeue 1 of 2)", 4: "queued"}

    _lose(parent, 2, state="running", worker="node-a pid 4242")  # a worker took it and died
    with django_capture_on_commit_callbacks(execute=True):
        checkpoints.checkpoint_exports_reconcile(now=timezone.now())
    CheckpointExport.objects.filter(run=parent, step=2).update(state="running", worker="node-b pid 7")  # taken again
    assert client.get(api.format(step=2)).json()["summary"] == "running again after it was lost (requeue 2 of 2)"
    assert _export_cells(client, parent)[2] == "running again after it was lost (requeue 2 of 2)"

    _lose(parent, 2)
    checkpoints.checkpoint_exports_reconcile(now=timezone.now())
    failed = client.get(api.format(step=2)).json()
    assert (failed["state"], failed["requeues"]) == ("failed", 2)
    assert failed["summary"] == f"failed: {failed['error']}" and failed["error"].startswith("the export was lost 3 times")
    assert _export_cells(client, parent)[2].startswith("failed the export was lost 3 times")

    _fake_export(parent, 4)
    done = client.get(api.format(step=4)).json()
    assert (done["state"], done["requeues"], done["summary"]) == ("done", 0, "exported")
    assert _export_cells(client, parent)[4] == "exported"


def test_an_export_its_worker_finished_before_it_died_starts_the_runs_waiting_for_it(lost_exports):
    """The worker died after the export folder was complete but before it recorded so: the reconciler finds it done
    and starts the runs that waited for it."""
    from forgeboard.telemetry.models import RunEvent

    parent = lost_exports.parent
    _fake_export(parent, 2)
    _lose(parent, 2, state="running", worker="node-a pid 4242")
    report = checkpoints.checkpoint_exports_reconcile(now=timezone.now())
    assert (report.requeued, report.failed) == ([], [])
    assert not CheckpointExport.objects.filter(run=parent, step=2).exists()
    assert sorted(child.config.parsed["trainer"]["steps"] for child in Run.objects.filter(parent=parent)) == [2, 3]
    assert RunEvent.objects.filter(run=parent, payload__name="child_run_started").count() == 2


def test_a_second_copy_of_an_export_message_does_nothing(lost_exports):
    """A queued export sent again (its first message only waited long in its pool's queue) runs once: the copy a
    worker takes second finds it running or done."""
    from workers.tasks import export_checkpoint

    parent = lost_exports.parent
    assert export_checkpoint.apply(args=[parent.pk, 4], kwargs={"attempt": 1}).get() == "done"
    assert export_checkpoint.apply(args=[parent.pk, 4], kwargs={"attempt": 1}).get() == "done"
    assert AuditEvent.objects.filter(action="checkpoint.export").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_run_asked_for_while_the_reconciler_fails_its_export_gets_an_export_of_its_own(settings, team,
                                                                                       run_with_checkpoints,
                                                                                       export_worker):
    """A member asks for a run from a checkpoint while the reconciler fails its lost export: the request waits for
    the reconciler under the run's row lock, then finds the export failed and queues a new one for its run (not
    left waiting for an export that no one will finish)."""
    from tests.support.races import racing_an_open_transaction

    settings.EXPORT_LOST_AFTER_S, settings.EXPORT_REQUEUES = 3600, 0
    parent = run_with_checkpoints
    run_launch_from_checkpoint_request(actor=team.member, run=parent, step=2, overrides=["trainer.steps=2"])
    _lose(parent, 2, state="running", worker="node-a pid 4242")

    def asked_meanwhile():
        return run_launch_from_checkpoint_request(actor=team.member, run=Run.objects.get(pk=parent.pk), step=2,
                                                  overrides=["trainer.steps=3"])

    answer = racing_an_open_transaction(lambda: checkpoints.checkpoint_exports_reconcile(now=timezone.now()),
                                        asked_meanwhile)
    assert getattr(answer, "state", answer) == "queued"
    assert (_export_row(parent, 2).state, _export_row(parent, 2).attempt) == ("queued", 2)
    assert [p.overrides for p in PendingChildRun.objects.filter(parent=parent)] == [["trainer.steps=3"]]
    assert [kwargs for _, _, kwargs in export_worker.sent] == [{"attempt": 1}, {"attempt": 2}]


def test_an_export_message_queued_before_the_upgrade_still_exports(team, run_with_checkpoints, export_worker):
    """A message queued before exports had attempts carries (run, step, who asked). It runs the export that runs
    waiting for it were recorded as (by migration runs 0007, attempt 0), or an export asked for then with no record;
    an export queued since is left to its own message."""
    from forgeboard.telemetry.models import RunEvent
    from workers.tasks import export_checkpoint

    parent = run_with_checkpoints
    PendingChildRun.objects.create(parent=parent, step=2, actor_kind="user", actor_id=team.member.pk,
                                   overrides=["trainer.steps=3"])
    CheckpointExport.objects.create(run=parent, step=2, state="queued", attempt=checkpoints.ATTEMPT_BEFORE_UPGRADE,
                                    requested_by="user:mateo", updated_at=timezone.now())
    assert export_checkpoint.apply(args=[parent.pk, 2, "user", team.member.pk]).get() == "done"
    [child] = Run.objects.filter(parent=parent)
    assert child.config.parsed["trainer"]["steps"] == 3
    assert RunEvent.objects.filter(run=parent, payload__name="child_run_started", payload__run=child.pk).exists()

    assert export_checkpoint.apply(args=[parent.pk, 4, "user", team.member.pk]).get() == "done", "no record"
    export = AuditEvent.objects.filter(action="checkpoint.export").first()
    assert export.payload["step"] == 4 and export.payload["requested_by"] == "user:mateo"

    _write(run_dir(parent) / "checkpoints" / "step_000006" / STATE_FILE, 10)
    checkpoint_export_request(actor=team.member, run=parent, step=6)
    assert export_checkpoint.apply(args=[parent.pk, 6, "user", team.member.pk]).get() == "queued"
    assert not (run_dir(parent) / "exports" / "step_6").exists(), "attempt 1's message exports it"


# --- any checkpoint starts any recipe: another experiment, another config, the checkpoint as the model ---------

SFT_YAML = """\
recipe: sft
model: {family: qwen3, path: /models/tiny-qwen3}
trainer: {steps: 4, batch_size: 2}
"""


@pytest.fixture
def sft_parent(team, data_dir) -> Run:
    """A finished SFT run with a checkpoint at step 4 (and its export, so a child starts at once)."""
    sft = experiment_create(actor=team.owner, project=team.project, name="warm-start", recipe="sft")
    run = run_launch(actor=team.member, experiment=sft, config_yaml=SFT_YAML, overrides=["trainer.steps=4"], priority=3)
    _write(run_dir(run) / "checkpoints" / "step_000004" / "trainer.pt", 50)
    return run


def test_an_sft_checkpoint_starts_a_grpo_run_in_another_experiment(team, sft_parent, grpo_yaml):
    _fake_export(sft_parent, 4)
    child = run_launch_from_checkpoint_request(actor=team.member, run=sft_parent, step=4, experiment=team.experiment,
                                               config_yaml=grpo_yaml, overrides=["trainer.steps=2"], priority=-5)
    assert isinstance(child, Run)
    assert (child.parent, child.experiment, child.priority) == (sft_parent, team.experiment, -5)
    assert child.config.yaml_text == grpo_yaml, "the chosen config, not the parent's"
    assert child.config.overrides == ["model.path=", f"model.artifact=run:{sft_parent.pk}@step:4",
                                      "checkpoint.resume_from=", "trainer.steps=2"], "not the parent's overrides"
    parsed = child.config.parsed
    assert parsed["recipe"] == "grpo" and parsed["model"]["path"] is None and parsed["trainer"]["steps"] == 2
    assert parsed["grpo"]["group_size"] == 4
    assert child.artifact_paths["model.path"] == str(run_dir(sft_parent) / "exports" / "step_4")


def test_a_checkpoint_starts_runs_only_in_its_own_project_and_for_members(team, sft_parent, grpo_yaml):
    from forgeboard.accounts.services import project_create

    _fake_export(sft_parent, 4)
    other = project_create(actor=team.owner, slug="beta", name="Beta")
    foreign = experiment_create(actor=team.owner, project=other, name="elsewhere", recipe="grpo")
    with pytest.raises(ValidationFailed) as raised:
        run_launch_from_checkpoint_request(actor=team.owner, run=sft_parent, step=4, experiment=foreign,
                                           config_yaml=grpo_yaml)
    assert raised.value.problems[0].field == "experiment" and "its own project" in raised.value.problems[0].message
    for actor in (team.viewer, team.outsider):
        with pytest.raises(PermissionDenied):
            run_launch_from_checkpoint_request(actor=actor, run=sft_parent, step=4, experiment=team.experiment,
                                               config_yaml=grpo_yaml)
    with pytest.raises(ValidationFailed) as raised:  # an SFT config in a GRPO experiment
        run_launch_from_checkpoint_request(actor=team.member, run=sft_parent, step=4, experiment=team.experiment)
    assert raised.value.problems[0].field == "config.recipe"
    with pytest.raises(ValidationFailed) as raised:
        run_launch_from_checkpoint_request(actor=team.member, run=sft_parent, step=4, experiment=team.experiment,
                                           config_yaml=grpo_yaml, priority=500)
    assert raised.value.problems[0].field == "priority"
    assert Run.objects.count() == 1


@pytest.fixture
def checkpoint_form(client, team, sft_parent, export_worker):
    """A member on the launch form of the SFT run's checkpoint; queued tasks recorded instead of sent."""
    client.force_login(team.member)
    return SimpleNamespace(client=client, sent=export_worker.sent, url=f"/runs/{sft_parent.pk}/checkpoints/4/new/")


def test_the_checkpoint_form_is_prefilled_with_the_checkpoint_as_the_model(checkpoint_form, team, sft_parent):
    page = checkpoint_form.client.get(checkpoint_form.url)
    html = page.content.decode()
    assert page.status_code == 200 and 'id="from-checkpoint"' in html
    assert f"<code>model.artifact=run:{sft_parent.pk}@step:4</code>" in html
    assert f'<option value="{sft_parent.experiment_id}" data-recipe="sft" selected' in html, "the parent's experiment"
    assert "trainer.steps=4\nmodel.path=\nmodel.artifact=run:%d@step:4\ncheckpoint.resume_from=</textarea>" % sft_parent.pk \
        in html, "the parent's overrides, then the checkpoint as the model"
    assert "recipe: sft\nmodel: {family: qwen3, path: /models/tiny-qwen3}" in html, "the parent's config"

    grpo = checkpoint_form.client.get(f"{checkpoint_form.url}?experiment={team.experiment.pk}").content.decode()
    assert f'<option value="{team.experiment.pk}" data-recipe="grpo" selected' in grpo
    assert '<option value="cpu_demo_grpo" data-recipe="grpo" selected' in grpo, "another recipe: its first preset"
    assert "# CPU demo, part 2" in grpo and "preset-needs-sft" not in grpo, "the checkpoint is the model, not the artifact"
    assert ">model.path=\nmodel.artifact=run:%d@step:4\ncheckpoint.resume_from=</textarea>" % sft_parent.pk in grpo, \
        "another recipe's config: the parent's overrides stay with the parent's config"


def test_the_checkpoint_form_launches_another_recipe_after_the_export(checkpoint_form, team, sft_parent, grpo_yaml,
                                                                      django_capture_on_commit_callbacks):
    from forgeboard.telemetry.models import RunEvent

    form = {"experiment": str(team.experiment.pk), "config_yaml": grpo_yaml, "priority": "2",
            "overrides": f"model.path=\nmodel.artifact=run:{sft_parent.pk}@step:4\ncheckpoint.resume_from=\ntrainer.steps=3"}
    with django_capture_on_commit_callbacks(execute=True):
        answer = checkpoint_form.client.post(checkpoint_form.url, form)
    assert answer.status_code == 302 and answer.url == f"/runs/{sft_parent.pk}/", "back on the parent: exporting"
    assert "the new run starts when the export is done" in checkpoint_form.client.get(answer.url).content.decode()
    [(name, _, _)] = checkpoint_form.sent
    [pending] = PendingChildRun.objects.filter(parent=sft_parent)
    assert name == "checkpoints.export" and pending.experiment == team.experiment and pending.priority == 2

    _work(checkpoint_form.sent)
    child = Run.objects.get(parent=sft_parent)
    assert (child.experiment, child.priority, child.config.yaml_text) == (team.experiment, 2, grpo_yaml)
    assert child.config.parsed["model"]["artifact"] == f"run:{sft_parent.pk}@step:4"
    assert child.config.parsed["trainer"]["steps"] == 3
    started = RunEvent.objects.get(run=sft_parent, kind="message", payload__name="child_run_started")
    assert started.payload["run"] == child.pk and started.payload["experiment"] == team.experiment.name

    with django_capture_on_commit_callbacks(execute=True):  # exported now: the run starts at once
        again = checkpoint_form.client.post(checkpoint_form.url, form)
    second = Run.objects.filter(parent=sft_parent).order_by("-pk").first()
    assert second != child and again.url == f"/runs/{second.pk}/" and second.experiment == team.experiment


def test_the_checkpoint_form_refuses_viewers_outsiders_and_missing_checkpoints(checkpoint_form, team, sft_parent,
                                                                             grpo_yaml):
    client = checkpoint_form.client
    assert client.get(f"/runs/{sft_parent.pk}/checkpoints/3/new/").status_code == 404
    client.force_login(team.viewer)
    assert client.get(checkpoint_form.url).status_code == 200  # a viewer may look (read-only form)
    refused = client.post(checkpoint_form.url, {"experiment": str(team.experiment.pk), "config_yaml": grpo_yaml})
    assert refused.status_code == 403
    client.force_login(team.outsider)
    assert client.get(checkpoint_form.url).status_code == 404
    assert checkpoint_form.sent == [] and Run.objects.count() == 1


def test_the_checkpoints_table_offers_both_ways_to_start_from_a_checkpoint(client, team, sft_parent):
    client.force_login(team.member)
    html = client.get(f"/runs/{sft_parent.pk}/checkpoints/").content.decode()
    assert "Start a new run from here</button>" in html
    assert f'href="/runs/{sft_parent.pk}/checkpoints/4/new/"' in html and "Choose recipe and config" in html
    client.force_login(team.viewer)
    assert "/checkpoints/4/new/" not in client.get(f"/runs/{sft_parent.pk}/checkpoints/").content.decode()


def test_the_api_starts_any_recipe_from_a_checkpoint(client, team, sft_parent, grpo_yaml, export_worker,
                                                      django_capture_on_commit_callbacks):
    """POST /runs/{id}/checkpoints/{step}/runs: 202 while the export is queued, then the child starts; 201 at once
    when exported; checked (field, reason) before anything is queued."""
    from forgeboard.accounts.services import api_token_create, project_create
    from forgeboard.telemetry.models import RunEvent
    from workers.tasks import export_checkpoint

    _, write = api_token_create(actor=team.member, project=team.project, name="ci-write", scope="write")
    _, read = api_token_create(actor=team.member, project=team.project, name="ci-read", scope="read")
    sent = export_worker.sent
    url = f"/api/v1/runs/{sft_parent.pk}/checkpoints/4/runs"

    def post(body: dict, token: str = write, step_url: str = url):
        with django_capture_on_commit_callbacks(execute=True):
            return client.post(step_url, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")

    body = {"experiment_id": team.experiment.pk, "config_yaml": grpo_yaml, "overrides": ["trainer.steps=2"]}
    foreign = experiment_create(actor=team.owner, project=project_create(actor=team.owner, slug="beta", name="Beta"),
                                name="elsewhere", recipe="grpo")
    refusals = [
        (post({**body, "experiment_id": foreign.pk}), 404),  # the token's project cannot see beta
        (post({"experiment_id": team.experiment.pk}), 400),  # the parent's SFT config in a GRPO experiment
        (post({**body, "overrides": ["trainer.steps=0"]}), 400),
        (post({**body, "priority": 500}), 400),
        (post(body, step_url=f"/api/v1/runs/{sft_parent.pk}/checkpoints/3/runs"), 404),
        (post(body, token=read), 403),
    ]
    assert [answer.status_code for answer, _ in refusals] == [status for _, status in refusals], \
        [answer.content for answer, _ in refusals]
    assert refusals[1][0].json()["errors"][0]["field"] == "config.recipe"
    assert sent == [] and Run.objects.count() == 1, "nothing queued or stored"

    queued = post(body)
    assert queued.status_code == 202 and queued.json()["state"] == "queued", queued.content
    [(name, args, kwargs)] = sent
    export_checkpoint.apply(args=args, kwargs=kwargs)
    child = Run.objects.get(parent=sft_parent)
    assert (child.experiment, child.config.yaml_text) == (team.experiment, grpo_yaml)
    assert child.config.overrides[-1] == "trainer.steps=2"
    assert RunEvent.objects.filter(run=sft_parent, payload__name="child_run_started", payload__run=child.pk).exists()

    at_once = post({**body, "priority": 2})
    assert at_once.status_code == 201, at_once.content
    second = Run.objects.get(pk=at_once.json()["id"])
    assert (second.parent, second.priority, second.experiment) == (sft_parent, 2, team.experiment)


# --- task messages queued before the upgrade -------------------------------------------------------------------

def test_a_run_asked_for_in_an_export_message_of_before_the_upgrade_still_starts(team, sft_parent, grpo_yaml,
                                                                                 export_worker):
    """Before runs waited for exports as PendingChildRun rows, the export's task message carried the run to start
    (launch_child, overrides, experiment_id, config_yaml, priority): a worker of the next version refused those
    keyword arguments (TypeError) and the run asked for was lost. Now the task takes them: the run waits for the
    export like one asked for now (an export that failed since is run again for it) and starts as its asker."""
    from forgeboard.telemetry.models import RunEvent
    from workers.tasks import export_checkpoint

    def old_message(**child) -> str:
        kwargs = {"launch_child": True, "overrides": ["trainer.steps=2"], **child}
        return export_checkpoint.apply(args=[sft_parent.pk, 4, "user", team.member.pk], kwargs=kwargs).get()

    CheckpointExport.objects.create(run=sft_parent, step=4, state="failed", error="out of disk", attempt=1,
                                    requested_by="user:mateo", updated_at=timezone.now())
    assert old_message(experiment_id=team.experiment.pk, config_yaml=grpo_yaml, priority=-5) == "done"
    [child] = Run.objects.filter(parent=sft_parent)
    assert (child.experiment, child.config.yaml_text, child.priority) == (team.experiment, grpo_yaml, -5)
    assert child.config.overrides[-1] == "trainer.steps=2" and child.launched_by == team.member
    assert RunEvent.objects.filter(run=sft_parent, payload__name="child_run_started", payload__run=child.pk).exists()

    assert old_message(experiment_id=team.experiment.pk, config_yaml=grpo_yaml) == "done", "exported: at once"
    assert Run.objects.filter(parent=sft_parent).count() == 2
    assert AuditEvent.objects.filter(action="checkpoint.export").count() == 1

    old_message(experiment_id=999_999, config_yaml=grpo_yaml)
    failed = RunEvent.objects.get(run=sft_parent, payload__name="child_run_failed")
    assert failed.payload["reason"] == "experiment 999999 no longer exists"
    assert Run.objects.filter(parent=sft_parent).count() == 2 and not PendingChildRun.objects.exists()


def test_a_run_asked_for_before_the_upgrade_waits_for_the_export_queued_since(team, run_with_checkpoints,
                                                                              export_worker,
                                                                              django_capture_on_commit_callbacks):
    from workers.tasks import export_checkpoint

    parent = run_with_checkpoints
    with django_capture_on_commit_callbacks(execute=True):
        checkpoint_export_request(actor=team.member, run=parent, step=2)
    old = export_checkpoint.apply(args=[parent.pk, 2, "user", team.member.pk],
                                  kwargs={"launch_child": True, "overrides": ["trainer.steps=3"], "priority": 1})
    assert old.get() == "queued", "the export queued since runs it"
    assert [(p.overrides, p.priority) for p in PendingChildRun.objects.filter(parent=parent)] == [(["trainer.steps=3"], 1)]
    _work(export_worker.sent)
    [child] = Run.objects.filter(parent=parent)
    assert (child.config.parsed["trainer"]["steps"], child.priority) == (3, 1)


@pytest.mark.parametrize("name", ["step_\u0663", "step_\u00b2", "step_", "step_1x"])
def test_a_step_folder_is_named_with_ascii_digits(name: str) -> None:
    from forgeboard.runs.checkpoints import STEP_FOLDER

    assert STEP_FOLDER.match(name) is None and STEP_FOLDER.match("step_30").group(1) == "30"
