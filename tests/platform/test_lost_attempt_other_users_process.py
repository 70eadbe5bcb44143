"""A lost local run's engine pid held now by another user's process. The worker may neither read its environment (where
an engine carries its run's id) nor signal it, and a worker's engines run as the worker's user: the pid was reused, the
process is left alone, the engine is said to have exited and the run restarts. Root reads and signals every process,
so under root (CI) that process is `nobody`'s and the stop's process checks run in a child dropped to another uid.

A process the stop may not read that is owned by a user of the run's (this worker's own, non-dumpable; or a former
worker account's, which owns what the run's attempts wrote in its folder) may be its live engine: it is not taken as
exited, the stop says it cannot tell, and the run is not restarted beside it."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from forgeboard.runs.folders import run_dir
from forgeboard.runs.models import Run
from forgeboard.runs.reconcile import PREVIOUS_ATTEMPT_NOT_STOPPED, PREVIOUS_ATTEMPT_STOPPED, runs_reconcile
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


def _taken_for_lost(run, *, pid: int, host: str, asks: list[dict]) -> dict:
    """The run, running with its engine at `pid` on `host` and silent for two minutes, taken for lost by the
    reconciler: the kwargs of the stop of its attempt it asks for."""
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, max_restarts=2, pid=pid, host=host,
                                         last_heartbeat_at=timezone.now() - timedelta(seconds=120))
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    [ask] = [a for a in asks if a["name"] == "runs.stop_attempt"]
    return ask["kwargs"]


def test_a_pid_reused_by_another_users_process_is_left_alone_and_the_run_restarts(team, grpo_yaml, asks, monkeypatch):
    stopper = OTHER_USER if suite_is_root() else os.geteuid()
    host = socket.gethostname()
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    with _other_users_process() as pid:
        with pytest.raises(PermissionError):
            call_as(stopper, _environ, pid)  # the stop really cannot tell whose engine it is
        # the stop's process checks and signals (workers/launch/local.py) run as `stopper`; the rest as the suite
        monkeypatch.setattr(local, "stop_local_engine", functools.partial(call_as, stopper, local.stop_local_engine))
        ask = _taken_for_lost(run, pid=pid, host=host, asks=asks)
        assert ask["pid"] == pid

        assert stop_attempt(**ask) == f"its engine (pid {pid} on {host}) had exited; restarted"
        assert _alive(pid), "another user's process is left alone"
        run.refresh_from_db()
        assert (run.state, run.restart_count, run.pid) == (RunState.QUEUED, 1, None)
        [stopped] = [e.payload for e in RunEvent.objects.filter(run=run, kind="message",
                                                                  payload__name=PREVIOUS_ATTEMPT_STOPPED)]
        assert stopped["detail"] == f"its engine (pid {pid} on {host}) had exited"


PR_SET_DUMPABLE = 4  # <linux/prctl.h>


@contextmanager
def _unreadable_process(uid: int) -> Iterator[int]:
    """The pid of a live process of `uid` that leads its process group and has made itself non-dumpable, as an engine
    may: its /proc/<pid>/environ is then root's, and only root reads it. A fork of this process (no program of the
    suite's need be runnable by `uid`); killed afterwards."""
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_read)
            os.setsid()
            if uid != os.geteuid():
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0:
                os.write(ready_write, b"ready")
            os.close(ready_write)
            while True:
                time.sleep(600)
        finally:
            os._exit(1)
    os.close(ready_write)
    try:
        with os.fdopen(ready_read, "rb") as ready:
            assert ready.read(5) == b"ready", "the process made itself non-dumpable"
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("engines_user", ["this worker's", "a former worker account's"])
def test_an_unreadable_process_of_the_runs_user_is_not_taken_as_exited_and_the_run_waits(
        team, grpo_yaml, asks, monkeypatch, engines_user):
    """Old code said such an engine had exited (it could not read it) and restarted the run beside it."""
    stopper = OTHER_USER if suite_is_root() else os.geteuid()
    # a former account's engine: under root `nobody`'s, the stop another uid; else both the suite's, as far as it goes
    owner = stopper if engines_user == "this worker's" or not suite_is_root() else NOBODY
    host = socket.gethostname()
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    if engines_user == "a former worker account's":  # what its attempt wrote in the run's folder is that account's
        folder = run_dir(run)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text("written when its engine was started\n")
        if owner != os.geteuid():
            os.chown(folder / "config.yaml", owner, owner)
    with _unreadable_process(owner) as pid:
        assert os.stat(f"/proc/{pid}").st_uid == owner
        with pytest.raises(PermissionError):
            call_as(stopper, _environ, pid)  # the stop really cannot tell whether it is the run's engine
        monkeypatch.setattr(local, "stop_local_engine", functools.partial(call_as, stopper, local.stop_local_engine))
        ask = _taken_for_lost(run, pid=pid, host=host, asks=asks)

        problem = (f"the process at its engine's pid {pid} is of uid {owner}, a user of the run's, and this worker "
                   f"(uid {stopper}) may not read it: whether it is the run's engine cannot be told")
        assert stop_attempt(**ask) == f"not stopped: {problem}"
        assert _alive(pid), "left alone"
        run.refresh_from_db()
        assert (run.state, run.restart_count, run.pid) == (RunState.LOST, 0, pid), "not restarted beside it"
        [said] = [e.payload for e in RunEvent.objects.filter(run=run, kind="message",
                                                               payload__name=PREVIOUS_ATTEMPT_NOT_STOPPED)]
        assert said["problem"] == problem
        assert not RunEvent.objects.filter(run=run, kind="message", payload__name=PREVIOUS_ATTEMPT_STOPPED).exists()


def test_an_engine_group_left_with_only_processes_the_worker_may_not_signal_is_said_and_the_run_waits(
        team, grpo_yaml, asks, monkeypatch):
    """The engine (its group's leader) has exited; what is left in its group is another user's, which this worker may
    not signal: killpg refuses (EPERM) at every ask. The stop names what is left and whose, and the run waits.
    Old code answered a bare "[Errno 1] Operation not permitted". Another user's processes are started by root only."""
    host = socket.gethostname()
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    leader = start_as(NOBODY, ["/bin/sh", "-c", "sleep 600 >/dev/null & echo $!"], stdout=subprocess.PIPE)
    try:
        left = int(leader.stdout.readline())
        leader.wait()  # exited and reaped: its group lives on in `left`
        assert not _alive(leader.pid) and _alive(left) and os.getpgid(left) == leader.pid
        monkeypatch.setattr(local, "stop_local_engine", functools.partial(call_as, OTHER_USER, local.stop_local_engine))
        ask = _taken_for_lost(run, pid=leader.pid, host=host, asks=asks)

        problem = (f"its engine's process group {leader.pid} has processes this worker (uid {OTHER_USER}) may not "
                   f"signal: pid {left} (uid {NOBODY})")
        assert stop_attempt(**ask) == f"not stopped: {problem}"
        assert _alive(left)
        assert Run.objects.get(pk=run.pk).state == RunState.LOST
        [said] = [e.payload for e in RunEvent.objects.filter(run=run, kind="message",
                                                               payload__name=PREVIOUS_ATTEMPT_NOT_STOPPED)]
        assert said["problem"] == problem
    finally:
        os.killpg(leader.pid, signal.SIGKILL)


def test_a_run_folder_the_worker_may_not_read_tells_no_engine_apart(tmp_path):
    """Whose processes the run's engines are is told by the owners of its folder's files: a folder this worker may not
    list leaves it unknown, so no process at the engine's pid is taken for exited (or stopped) on a guess."""
    stopper = OTHER_USER if suite_is_root() else os.geteuid()
    folder = tmp_path / "run"
    folder.mkdir(mode=0o000)
    try:
        with pytest.raises(PermissionError, match=f"may not read the run's folder {folder}"):
            call_as(stopper, local.stop_local_engine, run_id=1, pid=os.getpid(), host=socket.gethostname(),
                    folder=folder)
    finally:
        folder.chmod(0o700)
