"""The README's start command, run in a fresh clone, serves the login page (embedded default, no services) and runs
the demo's SFT-then-GRPO chain, printing the GRPO run's held-out reward at its start and end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.processes import REPO_DIR, free_port, kill_processes_in, stop_group

START_TIMEOUT_S = 240
DEMO_RUN_TIMEOUT_S = 300
DEMO_CHAIN_TIMEOUT_S = 300  # after the SFT run: its export, then the GRPO run (200 steps)
CHAIN_DONE = re.compile(rb"GRPO run arithmetic-grpo #1 \(from SFT step \d+\) done, held-out reward (-?[0-9.]+) -> (-?[0-9.]+)")


def _readme_start_command() -> str:
    lines = (REPO_DIR / "README.md").read_text().splitlines()
    commands = [line.strip() for line in lines if line.startswith("    bash scripts/")]
    assert commands[:2] == ["bash scripts/start.sh", "bash scripts/test.sh"], commands
    return commands[0]


@pytest.mark.slow
@pytest.mark.timeout(START_TIMEOUT_S + DEMO_RUN_TIMEOUT_S + DEMO_CHAIN_TIMEOUT_S + 120)
def test_fresh_clone_starts_and_serves_the_login_page(tmp_path):
    clone = tmp_path / "forgeboard"
    subprocess.run(["git", "clone", "--quiet", str(REPO_DIR), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "REDIS_URL", "FORGEBOARD_ENV", "FORGEBOARD_DATA_DIR", "PYTHONPATH",
                        "DJANGO_SETTINGS_MODULE"}}
    # Reuse the environment that this test run already built, so CI does not install twice.
    env["FORGEBOARD_VENV"] = os.environ.get("FORGEBOARD_TEST_VENV", str(Path(sys.executable).parents[1]))
    port = free_port()
    env["FORGEBOARD_PORT"] = str(port)
    log_path = tmp_path / "start.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(_readme_start_command().split(), cwd=clone, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        response = None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/login/", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(1)
        assert response is not None, f"no answer on port {port}:\n{log_path.read_text()[-4000:]}"
        assert response.status_code == 200
        assert "Log in" in response.text
        login = httpx.Client(base_url=f"http://127.0.0.1:{port}", follow_redirects=True)
        page = login.get("/login/")
        csrf = page.cookies["csrftoken"]
        home = login.post("/login/", data={"username": "demo", "password": "forgeboard-demo",
                                           "csrfmiddlewaretoken": csrf})
        assert home.status_code == 200 and "Demo project" in home.text, home.text[:2000]
        assert (clone / "var" / "forgeboard.sqlite3").exists(), "the embedded default keeps its data in var/"
        # The start command also queued the CPU demo run: the worker launches it and the engine trains it.
        deadline = time.monotonic() + DEMO_RUN_TIMEOUT_S
        page = ""
        while time.monotonic() < deadline:
            page = login.get("/p/demo/").text
            if "state-succeeded" in page or "state-failed" in page:
                break
            time.sleep(2)
        assert "arithmetic-sft #1" in page and "state-succeeded" in page, log_path.read_text()[-4000:]
        assert b"celery@" in log_path.read_bytes() or _wait_worker_ready(log_path)
        # Then the GRPO run from the SFT run's export: the start command prints both held-out figures.
        deadline = time.monotonic() + DEMO_CHAIN_TIMEOUT_S
        done = None
        while time.monotonic() < deadline and done is None and process.poll() is None:
            done = CHAIN_DONE.search(log_path.read_bytes())
            time.sleep(2)
        assert done is not None, log_path.read_text()[-4000:]
        start, end = float(done.group(1)), float(done.group(2))
        assert end > start, done.group(0)
        assert "arithmetic-grpo #1" in login.get("/p/demo/").text
        # The console says what happened (the runs, the worker's real tasks) without beat's housekeeping every few
        # seconds, which ran all along: the runs were scheduled and the demo's runs reconciled.
        console = log_path.read_text()
        assert "Task runs.launch[" in console and "run 1 scheduled" in console, console[-4000:]
        for routine in ("Sending due task", "Task runs.schedule[", "Task runs.reconcile[", "No hostname was supplied"):
            assert routine not in console, routine
    finally:
        stop_group(process, timeout=45)  # serve stops its web server and worker first
        kill_processes_in(clone)


def _wait_worker_ready(log_path: Path, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if b"ready." in log_path.read_bytes():
            return True
        time.sleep(1)
    return False
