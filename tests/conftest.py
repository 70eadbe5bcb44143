"""What every test directory shares."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.flush import retry_flush_on_deadlock
from tests.support.processes import REPO_DIR


def pytest_configure(config) -> None:
    retry_flush_on_deadlock()


@pytest.fixture
def asks(monkeypatch) -> list[dict]:
    """The tasks sent to the broker (the machine's edge), each as its name, kwargs and queue: the reconciler's asks to
    stop a lost attempt, a restart's relaunch. A worker on the engine's host would run them; a test runs what it needs."""
    from workers.celery import app

    sent: list[dict] = []
    monkeypatch.setattr(app, "send_task", lambda name, **kw: sent.append({"name": name, **kw}))
    return sent


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen3 folder that runs train on in seconds (read only: tests share it)."""
    out = tmp_path_factory.mktemp("tiny-model") / "tiny-qwen3"
    subprocess.run([sys.executable, "-m", "workers.engine", "make-tiny-model", "--family", "qwen3", "--out", str(out)],
                   cwd=REPO_DIR, check=True, capture_output=True, timeout=300)
    return out

