"""Watches one local engine process: marks the run running, then succeeded, failed or cancelled.

`python -m workers.launch.local_supervisor RUN_ID`, started by the local backend. It polls the run's
state so that a cancel from the dashboard stops the engine's whole process group.

Others move the run too, and may move it first: its operator (a cancel; a pause or resume its engine reported), the
reconciler (a silent run lost, a cancel it ended itself, a launch that took too long). The engine is started only
while the run is launching, checked under the run's row lock, which is held until the run is marked running: a cancel
finds the run either not started (it ends cancelled at once, and no engine starts) or running. Once the engine exits
(or is stopped for a cancel) the supervisor moves the run by the state it reads; a move that loses its race is decided
again from the state the other party left, and a run that others ended is theirs: the supervisor says so in its log
and exits cleanly.

A run the reconciler took for lost (silent: a long final checkpoint save, say) while its engine ran on is the
supervisor's to end as long as it still records this engine: an engine that then exits 0 finished the run, and one
that exits with an error failed it (`lost_attempt_finished`), rather than have the reconciler restart a finished run
from its last checkpoint; one stopped by a signal (the reconciler's stop, the OOM killer) is left to the reconciler to
restart. The reconciler restarts a lost run once its engine is confirmed stopped, which for an engine that has exited
waits for its supervisor to exit (`supervisor_lock.supervisor_gone_within`): until then the supervisor may still end the run.
One stuck past `supervisor_lock.STALL_SECONDS` without progress (marked at each poll and each move it tries) is killed
by that stop, so a hung supervisor does not keep a lost run from restarting.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from workers.launch.supervisor_lock import Supervising, supervising

POLL_SECONDS = 1.0
STOP_GRACE_SECONDS = 10.0
CANCEL_GRACE_SECONDS = 20.0
LOG_TAIL_LINES = 20

logger = logging.getLogger(__name__)


def _log_tail(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(deque(handle, maxlen=LOG_TAIL_LINES)).strip()
    except OSError:
        return ""


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def engine_overrides(folder: Path) -> list[str]:
    """Its telemetry file in the run's folder. (Its checkpoints are there too, and a restarted run resumes from its
    newest: the config.yaml says so, as for every backend: workers/launch/local.py `engine_config_yaml`.)"""
    return [f"telemetry.jsonl_path={folder / 'metrics.jsonl'}", "telemetry.console=false"]


@dataclass(frozen=True)
class Outcome:
    """Where the supervisor moves a run whose engine has exited: its state, the reason, and fields to set with it."""

    state: str
    reason: str
    fields: dict[str, object] = field(default_factory=dict)


def engine_outcome(*, state: str, returncode: int, log_path: Path, exited_at: datetime) -> Outcome:
    """Where a run in `state` (running, paused, cancelling, or lost meanwhile) goes once its engine exited with
    `returncode` at `exited_at`."""
    from forgeboard.runs.states import RunState

    if state == RunState.CANCELLING:
        return Outcome(RunState.CANCELLED, "cancelled by operator")
    if state == RunState.LOST:
        at = exited_at.strftime("%Y-%m-%d %H:%M:%S UTC")
        if returncode < 0:  # stopped: by the reconciler's stop before its restart, or killed as below
            return Outcome(RunState.LOST, f"engine killed by signal {-returncode} at {at}")
        if returncode == 0:
            return Outcome(RunState.SUCCEEDED, f"its engine exited 0 at {at}")
        return Outcome(RunState.FAILED, f"its engine exited with code {returncode} at {at}\n{_log_tail(log_path)}")
    if returncode < 0:
        # Killed by a signal (SIGKILL, OOM killer): not the run's own fault, so the reconciler may restart it, at once:
        # nothing of it is left to stop (pid None).
        return Outcome(RunState.LOST, f"engine killed by signal {-returncode}", {"pid": None})
    if returncode == 0 and state == RunState.PAUSED:
        # A paused engine waits for a resume or a cancel (workers/engine/run_control.py), and a cancel moves the run to
        # cancelling first: one that exited 0 was resumed and trained to its end before its resume was reported.
        return Outcome(RunState.SUCCEEDED, "finished; its engine exited 0 while the run was paused (resumed, "
                                           "before it reported the resume)")
    if returncode == 0:
        return Outcome(RunState.SUCCEEDED, "finished")
    return Outcome(RunState.FAILED, f"engine exited with code {returncode}\n{_log_tail(log_path)}")


def _start_engine(*, run_id: int, folder: Path, log_path: Path) -> subprocess.Popen | None:
    """Start the run's engine and mark the run running, holding its row lock from the check that it is still to be
    started until it is marked (a process starts at once); None when it is not to be started (see
    workers/launch/backends.py `submission_wanted`: one cancelled meanwhile ends cancelled there)."""
    from django.db import transaction

    from forgeboard.runs.services import run_transition
    from forgeboard.runs.states import RunState
    from workers.launch.backends import submission_wanted
    from workers.launch.local import REPO_DIR

    with transaction.atomic():
        if not submission_wanted(run_id=run_id):
            return None
        try:
            with open(log_path, "ab") as log:
                engine = subprocess.Popen(
                    [sys.executable, "-m", "workers.engine", "train", "--config", str(folder / "config.yaml"),
                     *engine_overrides(folder)],
                    cwd=REPO_DIR, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        except OSError as exc:
            run_transition(run_id=run_id, from_state=RunState.LAUNCHING, to_state=RunState.FAILED,
                           reason=f"the engine could not be started: {exc}")
            return None
        try:
            run_transition(run_id=run_id, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING,
                           host=socket.gethostname(), pid=engine.pid, log_path=str(log_path))
        except BaseException:
            _stop(engine)  # the run does not record it: nobody else would ever stop it
            raise
    return engine


def _watch(*, run_id: int, engine: subprocess.Popen, marks: Supervising) -> None:
    """Until the engine exits, or the run is being cancelled and its engine stopped."""
    from forgeboard.runs.models import Run
    from forgeboard.runs.states import RunState

    while engine.poll() is None:
        marks.progressed(engine_pid=engine.pid)
        time.sleep(POLL_SECONDS)
        state = Run.objects.filter(pk=run_id).values_list("state", flat=True).first()
        if state == RunState.CANCELLING:
            # The controller gets the cancel command too: let it checkpoint and exit on its own first.
            try:
                engine.wait(timeout=CANCEL_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                _stop(engine)
            return


def _settle(*, run_id: int, engine: subprocess.Popen, log_path: Path, exited_at: datetime, marks: Supervising) -> None:
    """Move the run by how its engine exited (`engine_outcome`), from the state it is in now. Another party may move
    it first (a cancel, a pause or resume reported, the reconciler): the move is then decided again from the state
    that party left, until it is made or the run is no longer this supervisor's to move (ended, restarted, or lost
    with its engine stopped by a signal). Each lost race is a move by someone else, and an exited engine leaves few
    to make: this ends."""
    from forgeboard.runs.models import Run
    from forgeboard.runs.reconcile import lost_attempt_finished
    from forgeboard.runs.services import IllegalTransition, run_transition
    from forgeboard.runs.states import RunState

    while True:
        marks.progressed(engine_pid=engine.pid)
        found = Run.objects.filter(pk=run_id).values_list("state", "pid", "exit_reason").first()
        if found is None:
            logger.info("run %s no longer exists", run_id)
            return
        state, pid, exit_reason = found
        if pid != engine.pid:
            logger.info("run %s no longer records this engine (it is %s): left as it is", run_id, state)
            return
        if state == RunState.FAILED and engine.returncode == 0:
            # Failed by the reconciler as lost with no restart left while its engine was only silent: it finished.
            at = exited_at.strftime("%Y-%m-%d %H:%M:%S UTC")
            if lost_attempt_finished(run_id=run_id, job_id="", pid=engine.pid, to_state=RunState.SUCCEEDED,
                                     how=f"its engine exited 0 at {at}"):
                return
        if state not in (RunState.RUNNING, RunState.PAUSED, RunState.CANCELLING, RunState.LOST):
            # Someone else ended it (a cancel the reconciler ended, a lost run it gave up on): theirs to say, and said
            # on the run's timeline.
            logger.info("run %s is already %s (%s): left as it is", run_id, state, exit_reason or "no reason given")
            return
        outcome = engine_outcome(state=state, returncode=engine.returncode, log_path=log_path, exited_at=exited_at)
        if state == RunState.LOST:
            if outcome.state == RunState.LOST:
                # Stopped by a signal: the reconciler restarts it once it finds this engine (and this supervisor) gone.
                logger.info("run %s is already lost (%s), and its %s: left as it is", run_id,
                            exit_reason or "no reason given", outcome.reason)
                return
            # The reconciler took it for lost, but its engine ended by itself: the run ends as its engine did, unless
            # its stop was confirmed first and it is being restarted.
            if lost_attempt_finished(run_id=run_id, job_id="", pid=engine.pid, to_state=outcome.state,
                                     how=outcome.reason):
                return
            logger.info("run %s moved from lost before it could go to %s: deciding again", run_id, outcome.state)
            continue
        if outcome.state == RunState.LOST:
            try:
                os.killpg(engine.pid, signal.SIGKILL)  # what it started in its group may outlive it
            except ProcessLookupError:
                pass
        try:
            run_transition(run_id=run_id, from_state=state, to_state=outcome.state, reason=outcome.reason,
                           **outcome.fields)
            return
        except IllegalTransition:
            logger.info("run %s moved from %s before it could go to %s: deciding again", run_id, state, outcome.state)


def supervise(run_id: int) -> int:
    from django.utils import timezone

    from forgeboard.logs import run_log_context
    from forgeboard.runs.models import Run
    from workers.launch.local import run_dir

    folder = run_dir(Run.objects.get(pk=run_id))
    log_path = folder / "engine.log"
    with run_log_context(run_id), supervising(folder) as marks:
        engine = _start_engine(run_id=run_id, folder=folder, log_path=log_path)
        if engine is not None:
            _watch(run_id=run_id, engine=engine, marks=marks)
            _settle(run_id=run_id, engine=engine, log_path=log_path, exited_at=timezone.now(), marks=marks)
    return 0


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "forgeboard.settings")
    import django

    django.setup()
    return supervise(int(sys.argv[1]))


if __name__ == "__main__":
    sys.exit(main())
