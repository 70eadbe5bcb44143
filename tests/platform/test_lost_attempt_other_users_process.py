"""A lost local run's engine pid held now by another user's process. The worker may neither read its environment (where
an engine carries its run's id) nor signal it, and a worker's engines run as the worker's user: the pid was reused, the
process is left alone, the engine is said to have exited and the run restarts. Root reads and signals every process,
so under root (CI) that process is `nobody`'s and the stop's process checks run in a child dropped to another uid."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from forgeboard.runs.models import Run
from forgeboard.runs.reconcile import PREVIOUS_ATTEMPT_STOPPED, runs_reconcile
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from tests.support.unprivileged import NOBODY, OTHER_USER, call_as, other_users_group_leader, start_as, suite_is_root
from workers.launch import local
from workers.launch.backends import stop_attempt

pytestmark = pytest.mark.django_db


@contextmanager
def _other_users_process() -> Iterator[int]:
    """The pid of a live process of another user than the stop's, leading its process group as an engine does: under
    root one started as `nobody` (and killed afterwards), else one found (init, usually), which is only looked at."""
    if not suite_is_root():
        yield other_users_group_leader()
        return
    stranger = start_as(NOBODY, [shutil.which("sleep"), "600"])
    try:
        yield stranger.pid
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait()


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_pid_reused_by_another_users_process_is_left_alone_and_the_run_restarts(team, grpo_yaml, asks, monkeypatch):
    stopper = OTHER_USER if suite_is_root() else os.geteuid()
    host = socket.gethostname()
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    with _other_users_process() as pid:
        with pytest.raises(PermissionError):
            call_as(stopper, _environ, pid)  # the stop really cannot tell whose engine it is
        # the stop's process checks and signals (workers/launch/local.py) run as `stopper`; the rest as the suite
        monkeypatch.setattr(local, "stop_local_engine", functools.partial(call_as, stopper, local.stop_local_engine))
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, max_restarts=2, pid=pid, host=host,
                                             last_heartbeat_at=timezone.now() - timedelta(seconds=120))
        assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
        [ask] = [a for a in asks if a["name"] == "runs.stop_attempt"]
        assert ask["kwargs"]["pid"] == pid

        assert stop_attempt(**ask["kwargs"]) == f"its engine (pid {pid} on {host}) had exited; restarted"
        assert _alive(pid), "another user's process is left alone"
        run.refresh_from_db()
        assert (run.state, run.restart_count, run.pid) == (RunState.QUEUED, 1, None)
        [stopped] = [e.payload for e in RunEvent.objects.filter(run=run, kind="message",
                                                                  payload__name=PREVIOUS_ATTEMPT_STOPPED)]
        assert stopped["detail"] == f"its engine (pid {pid} on {host}) had exited"
