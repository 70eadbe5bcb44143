"""Start real platform processes (Celery worker, web server) against the test database."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.db import connection

from forgeboard.cli import web_server_argv

REPO_DIR = Path(__file__).resolve().parents[2]


def test_database_url() -> str:
    """A DATABASE_URL naming the database that this pytest run uses (its test database)."""
    params = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite://{Path(params['NAME']).resolve()}"
    user = params["USER"] or ""
    auth = f"{user}:{params['PASSWORD']}@" if params["PASSWORD"] else (f"{user}@" if user else "")
    return f"postgres://{auth}{params['HOST'] or '127.0.0.1'}:{params['PORT'] or 5432}/{params['NAME']}"


def platform_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["DATABASE_URL"] = test_database_url()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR / "platform"), str(REPO_DIR)])
    env["DJANGO_SETTINGS_MODULE"] = "forgeboard.settings"
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_group(process: subprocess.Popen, timeout: float = 15) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, 15)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()


@contextmanager
def celery_worker(log_path: Path, *, ready_timeout: float = 60, **env: str) -> Iterator[subprocess.Popen]:
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.celery", "worker", "--pool", "solo",
             "--queues", "default,launch", "--purge", "--loglevel", "info", "--without-mingle", "--without-gossip"],
            cwd=REPO_DIR, env=platform_env(**env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + ready_timeout
        while b"ready." not in log_path.read_bytes():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"celery worker did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield process
    finally:
        stop_group(process)


def wait_for(predicate, *, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextmanager
def web_server(log_path: Path, *, port: int, ready_timeout: float = 60, **env: str) -> Iterator[subprocess.Popen]:
    """The platform's web server (HTTP and websockets, `forgeboard serve`'s) on 127.0.0.1:port."""
    process = start_web_server(log_path, port=port, ready_timeout=ready_timeout, **env)
    try:
        yield process
    finally:
        stop_group(process)


def start_web_server(log_path: Path, *, port: int, ready_timeout: float = 60, **env: str) -> subprocess.Popen:
    import httpx

    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            web_server_argv(host="127.0.0.1", port=port),
            cwd=REPO_DIR, env=platform_env(**({"FORGEBOARD_DB_POOL_SIZE": "4"} | env)), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    deadline = time.monotonic() + ready_timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            stop_group(process)
            raise RuntimeError(f"web server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)


def kill_processes_in(folder: Path) -> int:
    """Kill every process whose working directory or command line is inside `folder` (cleanup after a test)."""
    import psutil

    killed = 0
    for proc in psutil.process_iter(["pid", "cwd", "cmdline"]):
        try:
            cwd = proc.info["cwd"] or ""
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.pid != os.getpid() and (cwd.startswith(str(folder)) or str(folder) in cmdline):
                proc.kill()
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed
