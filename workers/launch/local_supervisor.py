"""Watches one local engine process: marks the run running, then succeeded, failed or cancelled.

`python -m workers.launch.local_supervisor RUN_ID`, started by the local backend. It polls the run's
state so that a cancel from the dashboard stops the engine's whole process group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

POLL_SECONDS = 1.0
STOP_GRACE_SECONDS = 10.0
CANCEL_GRACE_SECONDS = 20.0
LOG_TAIL_LINES = 20


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
    """Per-run paths; a restarted run resumes from its newest checkpoint."""
    checkpoints = folder / "checkpoints"
    overrides = [f"checkpoint.folder={checkpoints}", f"telemetry.jsonl_path={folder / 'metrics.jsonl'}",
                 "telemetry.console=false"]
    if any(checkpoints.glob("step_*/trainer.pt")):
        overrides.append(f"checkpoint.resume_from={checkpoints}")
    return overrides


def supervise(run_id: int) -> int:
    from forgeboard.logs import run_log_context
    from forgeboard.runs.models import Run
    from forgeboard.runs.services import IllegalTransition, run_transition
    from forgeboard.runs.states import RunState
    from workers.launch.local import REPO_DIR, run_dir

    folder = run_dir(Run.objects.get(pk=run_id))
    log_path = folder / "engine.log"
    with run_log_context(run_id), open(log_path, "ab") as log:
        engine = subprocess.Popen(
            [sys.executable, "-m", "workers.engine", "train", "--config", str(folder / "config.yaml"),
             *engine_overrides(folder)],
            cwd=REPO_DIR, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            run_transition(run_id=run_id, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING,
                           host=socket.gethostname(), pid=engine.pid, log_path=str(log_path))
        except IllegalTransition:
            _stop(engine)  # cancelled while launching
            state = Run.objects.filter(pk=run_id).values_list("state", flat=True).get()
            if state == RunState.CANCELLING:
                run_transition(run_id=run_id, from_state=RunState.CANCELLING, to_state=RunState.CANCELLED,
                               reason="cancelled by operator")
            return 1
        while engine.poll() is None:
            time.sleep(POLL_SECONDS)
            state = Run.objects.filter(pk=run_id).values_list("state", flat=True).first()
            if state == RunState.CANCELLING:
                # The controller gets the cancel command too: let it checkpoint and exit on its own first.
                try:
                    engine.wait(timeout=CANCEL_GRACE_SECONDS)
                except subprocess.TimeoutExpired:
                    _stop(engine)
                run_transition(run_id=run_id, from_state=RunState.CANCELLING, to_state=RunState.CANCELLED,
                               reason="cancelled by operator")
                return 0
        state, recorded_pid = Run.objects.filter(pk=run_id).values_list("state", "pid").get()
        state = RunState(state)
        if state not in (RunState.RUNNING, RunState.PAUSED, RunState.CANCELLING) or recorded_pid != engine.pid:
            return 0  # lost (and its engine stopped by the reconciler's ask), maybe restarted: not this attempt's
        if state == RunState.CANCELLING:
            run_transition(run_id=run_id, from_state=state, to_state=RunState.CANCELLED, reason="cancelled by operator")
        elif engine.returncode == 0:
            run_transition(run_id=run_id, from_state=state, to_state=RunState.SUCCEEDED, reason="finished")
        elif engine.returncode < 0:
            # Killed by a signal (SIGKILL, OOM killer): not the run's own fault, so the reconciler may restart it.
            reason = f"engine killed by signal {-engine.returncode}"
            try:
                os.killpg(engine.pid, signal.SIGKILL)  # what it started in its group may outlive it
            except ProcessLookupError:
                pass
            # Nothing of it is left to stop: the reconciler restarts the run at once.
            run_transition(run_id=run_id, from_state=state, to_state=RunState.LOST, reason=reason, pid=None)
        else:
            reason = f"engine exited with code {engine.returncode}\n{_log_tail(log_path)}"
            run_transition(run_id=run_id, from_state=state, to_state=RunState.FAILED, reason=reason)
    return 0


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "forgeboard.settings")
    import django

    django.setup()
    return supervise(int(sys.argv[1]))


if __name__ == "__main__":
    sys.exit(main())
