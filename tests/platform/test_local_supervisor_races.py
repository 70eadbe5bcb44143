"""A local run's supervisor that another party beats to the run's state: it leaves the run where that party put it,
or moves it on from there, and exits cleanly: 0, nothing above INFO in its log, and only the moves that were made on
the run's timeline.

The supervisor runs here (`supervise`), with a real engine process: one whose model is missing exits with code 2 in a
fraction of a second; the tiny model's trains for as long as asked. The other party (the operator's cancel, the
reconciler, the engine's report of a pause) moves the run through its own service at the moment it would in the race:
just before the supervisor's own move from one state to another (`other_party`), or just after one.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from forgeboard.experiments.services import experiment_create
from forgeboard.runs import services
from forgeboard.runs.folders import run_dir
from forgeboard.runs.models import Run
from forgeboard.runs.reconcile import runs_reconcile
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.services import command_acknowledge, command_create, command_finish, run_cancel, run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from tests.support.configs import sft_yaml
from tests.support.processes import kill_processes_in, platform_env, wait_for
from workers.engine.env import RUN_ID_ENV
from workers.launch import local_supervisor, supervisor_lock
from workers.launch.local import start_local, write_run_files
from workers.launch.local_supervisor import supervise
from workers.tasks import stop_lost_attempt

pytestmark = pytest.mark.django_db

MISSING_MODEL_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: /nonexistent/forgeboard-test-model
"""
RECONCILER_LATER = timedelta(seconds=120)  # past the heartbeat timeout: a run that never reported is silent
SETTLING = "it has exited, but its supervisor has not yet recorded how it ended"  # a stop's answer meanwhile


class OtherParty:
    """Moves made through another party's service just before or just after the supervisor's own move from one
    state to another (each once): the supervisor's `run_transition` is the one it imports from the services."""

    def __init__(self, monkeypatch) -> None:
        self.before: dict[tuple[RunState, RunState], Callable[[], object]] = {}
        self.after: dict[tuple[RunState, RunState], Callable[[], object]] = {}
        real = services.run_transition

        def run_transition(*, run_id: int, from_state, to_state, **kwargs):
            key = (RunState(from_state), RunState(to_state))
            if move := self.before.pop(key, None):
                move()
            run = real(run_id=run_id, from_state=from_state, to_state=to_state, **kwargs)
            if move := self.after.pop(key, None):
                move()
            return run

        monkeypatch.setattr(services, "run_transition", run_transition)

    def all_made(self) -> bool:
        return not self.before and not self.after


@pytest.fixture
def other_party(monkeypatch) -> OtherParty:
    return OtherParty(monkeypatch)


@pytest.fixture(autouse=True)
def supervisor_here(monkeypatch, caplog):
    """Polls often (the tests wait less), and the supervisor's INFO lines kept."""
    monkeypatch.setattr(local_supervisor, "POLL_SECONDS", 0.05)
    caplog.set_level(logging.INFO, logger=local_supervisor.__name__)


@pytest.fixture
def sent(monkeypatch) -> list[str]:
    """The tasks sent to the broker (the machine's edge): the reconciler's asks to stop a lost attempt."""
    from workers.celery import app

    names: list[str] = []
    monkeypatch.setattr(app, "send_task", lambda name, **kw: names.append(name))
    return names


def _stop_ask(asks: list[dict]) -> dict:
    [ask] = [a["kwargs"] for a in asks if a["name"] == "runs.stop_attempt"]
    asks.clear()
    return ask


def _launching(team, yaml: str, *, experiment=None) -> Run:
    """A local run the scheduler claimed, with the files the local backend writes before it starts the supervisor."""
    run = run_launch(actor=team.member, experiment=experiment or team.experiment, config_yaml=yaml)
    assert runs_schedule(now=timezone.now()) == [run.pk]
    run = Run.objects.get(pk=run.pk)
    write_run_files(run=run, folder=run_dir(run))
    return run


def _path(run: Run) -> list[str]:
    return [e.payload["to"] for e in RunEvent.objects.filter(run=run, kind="state_changed").order_by("seq")]


def _cancel(run: Run, team):
    return lambda: run_cancel(actor=team.member, run=Run.objects.get(pk=run.pk))


def _reconcile():
    return lambda: runs_reconcile(now=timezone.now() + RECONCILER_LATER)


def _engine_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _no_error_logged(caplog) -> bool:
    return not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


def test_a_run_cancelled_before_its_engine_starts_ends_cancelled_and_none_starts(team, caplog):
    run = _launching(team, MISSING_MODEL_YAML)
    run_cancel(actor=team.member, run=run)

    assert supervise(run.pk) == 0

    run.refresh_from_db()
    assert (run.state, run.exit_reason) == (RunState.CANCELLED, "cancelled before it was submitted")
    assert run.pid is None and not (run_dir(run) / "engine.log").exists(), "no engine was started"
    assert _path(run) == ["queued", "launching", "cancelling", "cancelled"]
    assert _no_error_logged(caplog)


def test_a_launch_the_reconciler_gave_up_on_and_restarted_starts_no_engine(team, caplog):
    """The supervisor came too late (a slow host, a worker busy for minutes): the reconciler lost the launch and
    queued the run again. The restart gets a supervisor of its own; this one starts nothing."""
    run = _launching(team, MISSING_MODEL_YAML)
    Run.objects.filter(pk=run.pk).update(max_restarts=1)
    report = runs_reconcile(now=timezone.now() + timedelta(seconds=400))
    assert (report.lost, report.restarted) == ([run.pk], [run.pk])

    assert supervise(run.pk) == 0

    run.refresh_from_db()
    assert run.state == RunState.QUEUED and run.pid is None
    assert not (run_dir(run) / "engine.log").exists(), "no engine was started"
    assert _path(run) == ["queued", "launching", "lost", "queued"]
    assert _no_error_logged(caplog)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))
def test_a_local_run_cancelled_after_its_launch_but_before_its_engine_starts_gets_no_engine(team, monkeypatch):
    """The launch's check passed and it started the supervisor; the cancel is committed before the supervisor gets to
    its own check (under the row lock, with the engine's start): it starts no engine, rather than start one and
    stop it again, and exits cleanly."""
    monkeypatch.setenv("DATABASE_URL", platform_env()["DATABASE_URL"])  # the worker's, which its supervisors get
    run = _launching(team, MISSING_MODEL_YAML)
    _cancel(run, team)()
    folder = run_dir(run)
    try:
        start_local(run=Run.objects.select_related("config").get(pk=run.pk))
        wait_for(lambda: Run.objects.get(pk=run.pk).state in (RunState.CANCELLED, RunState.FAILED), timeout=60,
                 what="the supervisor to end the run")
        run.refresh_from_db()
        assert (run.state, run.exit_reason, run.pid) == (RunState.CANCELLED, "cancelled before it was submitted", None)
        assert not (folder / "engine.log").exists(), "no engine was started"
        assert _path(run) == ["queued", "launching", "cancelling", "cancelled"]
        log = wait_for(lambda: "cancelled before it was submitted" in (text := (folder / "supervisor.log").read_text())
                       and text, timeout=10, what="the supervisor's log")
        assert "Traceback" not in log and "ERROR" not in log, log
    finally:
        kill_processes_in(folder)


@pytest.mark.parametrize("party", ["operator cancels", "reconciler finds it silent", "engine reported a pause"])
def test_a_failed_engines_run_moved_by_another_party_first_is_moved_on_from_there(
        team, other_party, sent, caplog, party):
    """The engine failed (exit 2); as the supervisor reads the run, another party moves it, so its running ->
    failed loses. A cancel wins (the operator asked it to stop); a run the reconciler took for lost still records
    this engine, so it fails with the engine's reason rather than restart to fail again (the reconciler's ask to stop
    it then touches nothing); a pause reported just before the engine failed still leaves it failed."""
    run = _launching(team, MISSING_MODEL_YAML)
    Run.objects.filter(pk=run.pk).update(max_restarts=1)  # lost, it waits for its engine to be found stopped

    def pause_reported() -> None:
        pause = command_create(actor=team.member, run=Run.objects.get(pk=run.pk), kind="pause")
        command_acknowledge(run=run, command_id=pause.pk)
        command_finish(run=Run.objects.get(pk=run.pk), command_id=pause.pk, ok=True, result={"paused_at_step": 0})

    moves = {"operator cancels": _cancel(run, team), "reconciler finds it silent": _reconcile(),
             "engine reported a pause": pause_reported}
    other_party.before[(RunState.RUNNING, RunState.FAILED)] = moves[party]

    assert supervise(run.pk) == 0

    assert other_party.all_made()
    run.refresh_from_db()
    if party == "operator cancels":
        assert (run.state, run.exit_reason) == (RunState.CANCELLED, "cancelled by operator")
        assert _path(run) == ["queued", "launching", "running", "cancelling", "cancelled"]
    elif party == "reconciler finds it silent":
        assert run.state == RunState.FAILED
        assert run.exit_reason.startswith("failed after it was taken for lost (no heartbeat for "), run.exit_reason
        assert "): its engine exited with code 2 at " in run.exit_reason and "model.path" in run.exit_reason
        assert _path(run) == ["queued", "launching", "running", "lost", "failed"]
        assert sent == ["runs.stop_attempt"], "the reconciler asked to stop what it left before a restart"
    else:
        assert run.state == RunState.FAILED and run.exit_reason.startswith("engine exited with code 2\n")
        assert "model.path" in run.exit_reason
        assert _path(run) == ["queued", "launching", "running", "paused", "failed"]
    assert _engine_gone(run.pid)
    assert _no_error_logged(caplog)


def test_an_engine_killed_by_a_signal_as_its_run_is_cancelled_ends_the_run_cancelled(team, other_party, caplog):
    """Killed (the OOM killer, say) just as the operator cancels: the run is not lost and restarted, it ends as its
    owner asked."""
    run = _launching(team, MISSING_MODEL_YAML)
    other_party.after[(RunState.LAUNCHING, RunState.RUNNING)] = \
        lambda: os.kill(Run.objects.get(pk=run.pk).pid, signal.SIGKILL)
    other_party.before[(RunState.RUNNING, RunState.LOST)] = _cancel(run, team)

    assert supervise(run.pk) == 0

    assert other_party.all_made()
    run.refresh_from_db()
    assert (run.state, run.exit_reason) == (RunState.CANCELLED, "cancelled by operator")
    assert _path(run) == ["queued", "launching", "running", "cancelling", "cancelled"]
    assert _no_error_logged(caplog)


@pytest.fixture
def sft(team):
    return experiment_create(actor=team.owner, project=team.project, name="warm-start", recipe="sft")


@pytest.mark.slow
def test_a_cancel_the_reconciler_ends_while_the_supervisor_stops_its_engine_leaves_the_reconcilers_word(
        team, sft, tiny_model, other_party, monkeypatch, caplog):
    """The engine does not take the cancel (it cannot reach the control plane) and is stopped past the grace; the
    reconciler ended the cancel meanwhile. The run ends once, with the reconciler's reason, and the supervisor exits
    cleanly instead of failing on its own cancelling -> cancelled."""
    monkeypatch.setattr(local_supervisor, "CANCEL_GRACE_SECONDS", 0.5)
    run = _launching(team, sft_yaml(tiny_model, steps=100_000), experiment=sft)
    other_party.after[(RunState.LAUNCHING, RunState.RUNNING)] = _cancel(run, team)
    other_party.before[(RunState.CANCELLING, RunState.CANCELLED)] = _reconcile()

    assert supervise(run.pk) == 0

    assert other_party.all_made()
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED
    assert run.exit_reason.startswith("cancelled; its controller never reported in"), run.exit_reason
    assert _path(run) == ["queued", "launching", "running", "cancelling", "cancelled"]
    assert _engine_gone(run.pid), "the supervisor stopped its engine"
    assert any(f"run {run.pk} is already cancelled" in r.getMessage() for r in caplog.records)
    assert _no_error_logged(caplog)


@pytest.mark.slow
def test_a_run_cancelled_as_its_engine_finishes_ends_cancelled(team, sft, tiny_model, other_party, caplog):
    """The engine trained its steps and exited 0; the operator's cancel came as the supervisor read the run: its
    running -> succeeded loses, and the run ends as its owner asked."""
    run = _launching(team, sft_yaml(tiny_model, steps=2), experiment=sft)
    other_party.before[(RunState.RUNNING, RunState.SUCCEEDED)] = _cancel(run, team)

    assert supervise(run.pk) == 0

    assert other_party.all_made(), (run_dir(run) / "engine.log").read_text()[-2000:]
    run.refresh_from_db()
    assert (run.state, run.exit_reason) == (RunState.CANCELLED, "cancelled by operator")
    assert _path(run) == ["queued", "launching", "running", "cancelling", "cancelled"]
    assert _no_error_logged(caplog)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))
def test_a_cancel_while_the_supervisor_starts_the_engine_finds_it_running_and_the_engine_stopped(
        team, sft, tiny_model, other_party, monkeypatch, caplog):
    """The supervisor holds the run's row from its check that the run is launching until it is marked running with
    its engine's pid: a cancel that comes meanwhile waits, then finds a running run whose engine the supervisor stops
    (never a cancelled run with an engine that nobody stops)."""
    monkeypatch.setattr(local_supervisor, "CANCEL_GRACE_SECONDS", 0.5)
    run = _launching(team, sft_yaml(tiny_model, steps=100_000), experiment=sft)

    def cancel() -> None:
        try:
            _cancel(run, team)()
        finally:
            connection.close()

    operator = threading.Thread(target=cancel)
    waited: list[bool] = []

    def cancel_comes() -> None:  # the supervisor's transaction is still open
        operator.start()
        operator.join(timeout=1.0)
        waited.append(operator.is_alive())

    other_party.after[(RunState.LAUNCHING, RunState.RUNNING)] = cancel_comes

    assert supervise(run.pk) == 0

    operator.join(timeout=30)
    assert waited == [True], "the cancel waited for the supervisor to mark the run running"
    run.refresh_from_db()
    assert (run.state, run.exit_reason) == (RunState.CANCELLED, "cancelled by operator")
    assert _path(run) == ["queued", "launching", "running", "cancelling", "cancelled"]
    assert _engine_gone(run.pid), "the supervisor stopped its engine"
    assert _no_error_logged(caplog)


def _supervisor_said_nothing_wrong(caplog) -> bool:
    """Nothing above INFO from the supervisor itself (the reconciler's worker warns of a stop not yet confirmed)."""
    return not [r for r in caplog.records if r.name == local_supervisor.__name__
                and (r.levelno >= logging.WARNING or r.exc_info)]


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["not yet asked", "asked before the supervisor settles"])
def test_a_run_taken_for_lost_as_its_engine_finishes_succeeds_and_is_not_restarted(
        team, sft, tiny_model, other_party, asks, monkeypatch, caplog, stop):
    """The engine trained its steps and exited 0, but had been silent past the heartbeat timeout (a long final
    checkpoint save): the reconciler takes the run for lost as the supervisor reads it, and asks a worker on this host
    to stop the engine before a restart. The supervisor, whose run still records its engine, ends the run succeeded,
    saying so; the worker's stop, which finds the engine gone, is not confirmed while the supervisor may still do
    that, so the run is not restarted to train again from its last checkpoint."""
    monkeypatch.setattr(supervisor_lock, "SETTLE_GRACE_SECONDS", 0.5)
    run = _launching(team, sft_yaml(tiny_model, steps=2, max_restarts=1), experiment=sft)
    monkeypatch.setenv(RUN_ID_ENV, str(run.pk))  # as the local backend starts the supervisor: its engine's is checked
    answers: list[str] = []

    def taken_for_lost() -> None:
        runs_reconcile(now=timezone.now() + RECONCILER_LATER)
        if stop == "asked before the supervisor settles":
            answers.append(stop_lost_attempt(**_stop_ask(asks)))

    other_party.before[(RunState.RUNNING, RunState.SUCCEEDED)] = taken_for_lost

    assert supervise(run.pk) == 0

    assert other_party.all_made(), (run_dir(run) / "engine.log").read_text()[-2000:]
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED, run.exit_reason
    assert re.fullmatch(r"finished after it was taken for lost \(no heartbeat for \d+ s \(timeout 60 s\)\): "
                        r"its engine exited 0 at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", run.exit_reason), run.exit_reason
    assert run.restart_count == 0 and run.pid is not None, "not restarted, and it still records its engine"
    assert _path(run) == ["queued", "launching", "running", "lost", "succeeded"]
    if stop == "asked before the supervisor settles":
        assert answers == [f"still stopping: {SETTLING}"]
        said = RunEvent.objects.filter(run=run, kind="message", payload__name="previous_attempt_not_stopped")
        assert [(e.payload["attempt"], e.payload["problem"]) for e in said] == [
            (f"its engine (pid {run.pid} on {socket.gethostname()})", SETTLING)]
    else:
        assert stop_lost_attempt(**_stop_ask(asks)) == "skipped: the run no longer records that attempt"
    report = runs_reconcile(now=timezone.now() + RECONCILER_LATER)
    assert (report.lost, report.restarted, report.stopping) == ([], [], [])
    assert Run.objects.get(pk=run.pk).state == RunState.SUCCEEDED
    assert not RunEvent.objects.filter(run=run, kind="message", payload__name="previous_attempt_stopped").exists()
    assert _supervisor_said_nothing_wrong(caplog)


@pytest.mark.slow
def test_a_lost_runs_engine_stopped_for_its_restart_is_confirmed_stopped_once_its_supervisor_has_exited(
        team, sft, tiny_model, other_party, asks, monkeypatch, caplog):
    """The reconciler takes a run for lost while its engine trains on, and a worker on this host stops the engine
    (SIGTERM): an engine stopped by a signal did not finish, so its supervisor leaves the run lost, and the stop is
    confirmed, and the run restarted, only once the supervisor has exited (before, it answers that it waits)."""
    monkeypatch.setattr(supervisor_lock, "SETTLE_GRACE_SECONDS", 0.5)
    run = _launching(team, sft_yaml(tiny_model, steps=100_000, max_restarts=1), experiment=sft)
    monkeypatch.setenv(RUN_ID_ENV, str(run.pk))  # as the local backend starts the supervisor: its engine's is checked
    answers: list[str] = []

    def lost_and_stopped() -> None:
        runs_reconcile(now=timezone.now() + RECONCILER_LATER)
        answers.append(stop_lost_attempt(**_stop_ask(asks)))

    other_party.after[(RunState.LAUNCHING, RunState.RUNNING)] = lost_and_stopped

    assert supervise(run.pk) == 0

    assert other_party.all_made()
    pid, host = Run.objects.get(pk=run.pk).pid, socket.gethostname()
    assert answers == [f"still stopping: {SETTLING}"]
    assert _engine_gone(pid)
    lost = Run.objects.get(pk=run.pk)
    assert (lost.state, lost.pid) == (RunState.LOST, pid), "left to the reconciler"
    assert any(f"run {run.pk} is already lost" in r.getMessage() and "engine killed by signal 15" in r.getMessage()
               for r in caplog.records)

    runs_reconcile(now=timezone.now() + RECONCILER_LATER)  # the next pass asks again
    assert stop_lost_attempt(**_stop_ask(asks)) == f"its engine (pid {pid} on {host}) had exited; restarted"
    run.refresh_from_db()
    assert (run.state, run.restart_count, run.pid) == (RunState.QUEUED, 1, None)
    assert _path(run) == ["queued", "launching", "running", "lost", "queued"]
    assert _supervisor_said_nothing_wrong(caplog)


@pytest.mark.slow
def test_a_run_failed_as_lost_with_no_restart_left_as_its_engine_finishes_succeeds(
        team, sft, tiny_model, other_party, asks, monkeypatch, caplog):
    """The engine trained its steps and exited 0 after a silence past the heartbeat timeout; the run had no restart
    left, so the reconciler took it for lost and failed it as the supervisor read it. Its engine finished: the run
    ends succeeded, saying it had failed first and why (on the old code it stayed failed, the supervisor saying
    'already failed: left as it is'), and its engine is no longer followed."""
    monkeypatch.setattr(supervisor_lock, "SETTLE_GRACE_SECONDS", 0.5)
    run = _launching(team, sft_yaml(tiny_model, steps=2, max_restarts=0), experiment=sft)
    monkeypatch.setenv(RUN_ID_ENV, str(run.pk))

    def failed_as_lost() -> None:
        report = runs_reconcile(now=timezone.now() + RECONCILER_LATER)
        assert (report.lost, report.failed) == ([run.pk], [run.pk])

    other_party.before[(RunState.RUNNING, RunState.SUCCEEDED)] = failed_as_lost

    assert supervise(run.pk) == 0

    assert other_party.all_made(), (run_dir(run) / "engine.log").read_text()[-2000:]
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED, run.exit_reason
    assert re.fullmatch(r"finished after all: it had failed \(lost \(no heartbeat for \d+ s \(timeout 60 s\)\) after 0 "
                        r"of 0 restarts\), then its engine exited 0 at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC",
                        run.exit_reason), run.exit_reason
    assert run.leftover_stop_since is None
    assert _path(run) == ["queued", "launching", "running", "lost", "failed", "succeeded"]
    assert not list(run_dir(run).glob("supervisor-*.progress")), "its progress mark goes with it"
    assert stop_lost_attempt(**_stop_ask(asks)) == "skipped: the run no longer records that attempt"
    report = runs_reconcile(now=timezone.now() + RECONCILER_LATER)
    assert (report.leftover_stopping, report.leftover_unconfirmed) == ([], [])
    assert _supervisor_said_nothing_wrong(caplog)


@pytest.mark.slow
@pytest.mark.parametrize("then", ["read paused", "taken for lost while paused"])
def test_a_paused_runs_engine_that_exits_0_finished_the_run_whether_or_not_it_was_taken_for_lost(
        team, sft, tiny_model, other_party, asks, monkeypatch, caplog, then):
    """An engine leaves its pause only for a resume or a cancel (workers/engine/run_control.py), and a cancel moves
    the run to cancelling first: one that exits 0 while its run reads paused was resumed and trained to its end before
    its resume was reported. The run succeeded either way: read paused by its supervisor (on the old code it failed,
    'engine exited with code 0 while the run was paused') or taken for lost meanwhile (it succeeded already)."""
    monkeypatch.setattr(supervisor_lock, "SETTLE_GRACE_SECONDS", 0.5)
    run = _launching(team, sft_yaml(tiny_model, steps=2, max_restarts=1), experiment=sft)
    monkeypatch.setenv(RUN_ID_ENV, str(run.pk))

    def paused() -> None:
        pause = command_create(actor=team.member, run=Run.objects.get(pk=run.pk), kind="pause")
        command_acknowledge(run=run, command_id=pause.pk)
        command_finish(run=Run.objects.get(pk=run.pk), command_id=pause.pk, ok=True, result={"paused_at_step": 1})
        if then == "taken for lost while paused":
            assert runs_reconcile(now=timezone.now() + RECONCILER_LATER).lost == [run.pk]

    other_party.before[(RunState.RUNNING, RunState.SUCCEEDED)] = paused

    assert supervise(run.pk) == 0

    assert other_party.all_made(), (run_dir(run) / "engine.log").read_text()[-2000:]
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED, run.exit_reason
    if then == "read paused":
        assert run.exit_reason == ("finished; its engine exited 0 while the run was paused (resumed, before it "
                                   "reported the resume)")
        assert _path(run) == ["queued", "launching", "running", "paused", "succeeded"]
    else:
        assert run.exit_reason.startswith("finished after it was taken for lost"), run.exit_reason
        assert _path(run) == ["queued", "launching", "running", "paused", "lost", "succeeded"]
    assert _supervisor_said_nothing_wrong(caplog)
