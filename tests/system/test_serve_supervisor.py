"""`forgeboard serve` supervises: a child that dies is started again (with backoff); the others keep running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from forgeboard.supervisor import FIRST_BACKOFF_S, MAX_BACKOFF_S, STABLE_AFTER_S, Child
from tests.support.processes import REPO_DIR, free_port, platform_env, stop_group, wait_for

START_TIMEOUT_S = 180


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _child(serve: psutil.Process, word: str) -> psutil.Process | None:
    for child in serve.children():
        try:
            if any(word in part for part in child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def test_a_child_that_exits_is_restarted_with_a_doubling_backoff_that_resets_once_stable(tmp_path):
    child = Child("quitter", [sys.executable, "-c", "raise SystemExit(3)"], env=dict(os.environ), cwd=REPO_DIR)
    now = 1000.0
    delays = []
    for _ in range(7):
        child.start(now)
        child.process.wait(timeout=30)
        assert child.exited(now + 0.1)
        delays.append(child.next_start_at - (now + 0.1))
        assert not child.due(child.next_start_at - 0.01) and child.due(child.next_start_at)
        now = child.next_start_at
    assert delays == pytest.approx([1, 2, 4, 8, 16, 30, 30])
    assert child.history == [3] * 7
    child.start(now)
    child.process.wait(timeout=30)
    assert child.exited(now + STABLE_AFTER_S)  # it stayed up a minute: the next restart comes quickly again
    assert child.next_start_at - (now + STABLE_AFTER_S) == FIRST_BACKOFF_S
    assert FIRST_BACKOFF_S < MAX_BACKOFF_S


@pytest.mark.slow
@pytest.mark.timeout(START_TIMEOUT_S + 180)
def test_killed_web_child_is_restarted_and_the_worker_keeps_running(tmp_path, transactional_db):
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "forgeboard.cli", "serve", "--port", str(port), "--worker-concurrency", "1"],
            cwd=REPO_DIR, env=platform_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_for(lambda: _healthy(port) or serve.poll() is not None, timeout=START_TIMEOUT_S, what="serve to answer")
        assert serve.poll() is None, log_path.read_text()[-4000:]
        parent = psutil.Process(serve.pid)
        web = wait_for(lambda: _child(parent, "uvicorn"), timeout=30, what="the web child")
        worker = wait_for(lambda: _child(parent, "celery"), timeout=30, what="the worker child")

        os.kill(web.pid, signal.SIGKILL)
        web.wait(timeout=10)
        wait_for(lambda: _healthy(port), timeout=60, what="the restarted web server")
        new_web = _child(parent, "uvicorn")
        assert new_web is not None and new_web.pid != web.pid
        assert worker.is_running() and _child(parent, "celery").pid == worker.pid, "the worker was not touched"
        assert serve.poll() is None
        text = log_path.read_text()
        assert f"web server (pid {web.pid}) exited with -9" in text and "restarting in 1 s" in text, text[-4000:]
        assert "web server restart 1" in text

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=40) == 0
        for child in (new_web, worker):
            wait_for(lambda c=child: not c.is_running() or c.status() == psutil.STATUS_ZOMBIE, timeout=20,
                     what=f"{child.pid} to stop")
    finally:
        stop_group(serve, timeout=30)
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if f"--port {port}" in cmdline or (proc.pid != os.getpid() and f"127.0.0.1:{port}" in cmdline):
                proc.kill()
