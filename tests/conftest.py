"""What every test directory shares."""

import pytest

from tests.support.flush import retry_flush_on_deadlock


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

