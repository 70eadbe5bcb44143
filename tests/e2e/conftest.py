"""Browser tests: Debian's Chromium driven by Playwright against the real web server and a Celery worker.

Run in their own pytest invocation (scripts/test.sh does): Playwright's event loop breaks later
pytest-asyncio tests in the same process. Screenshots go to test-artifacts/e2e/.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from tests.platform.conftest import team  # noqa: F401 - shared fixture
from tests.support.processes import REPO_DIR, celery_worker, free_port, kill_processes_in, web_server

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # ORM calls from tests that also drive a browser
ARTIFACTS = REPO_DIR / "test-artifacts" / "e2e"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
PASSWORDS = {"olivia": "pw-olivia-1", "mateo": "pw-mateo-1", "vera": "pw-vera-1", "oscar": "pw-oscar-1",
             "opal": "pw-opal-1"}


def pytest_collection_modifyitems(items) -> None:
    # The browser talks to a server process: what a test stores must be committed for it to see.
    for item in items:
        item.add_marker(pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES)))


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    return {**browser_type_launch_args, "executable_path": CHROMIUM, "args": CHROMIUM_ARGS}


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1280, "height": 900}}


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker, tmp_path_factory):
    """The web server and a Celery worker on the test database; engines they start are killed afterwards."""
    tmp = tmp_path_factory.mktemp("e2e-server")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with django_db_blocker.unblock():
        try:
            with web_server(tmp / "web.log", port=port) as web, \
                    celery_worker(tmp / "worker.log", FORGEBOARD_PUBLIC_URL=url):
                yield {"url": url, "web": web, "tmp": tmp}
        finally:
            kill_processes_in(Path(settings.DATA_DIR) / "runs")


@pytest.fixture
def demo_model(tiny_model) -> Path:
    """The CPU demo presets' model folder (DATA_DIR/models/tiny-qwen3), built like seed_demo --launch does."""
    folder = Path(settings.DATA_DIR) / "models" / "tiny-qwen3"
    if not (folder / "config.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(tiny_model, folder)
    return folder


@pytest.fixture(autouse=True)
def quiet_database_after_test(django_db_blocker):
    """Before the database is flushed for the next test, stop this test's engines and wait until no other
    session is inside a query: a TRUNCATE racing a late telemetry write once deadlocked the flush."""
    yield
    kill_processes_in(Path(settings.DATA_DIR) / "runs")
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        for _ in range(100):
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND pid <> pg_backend_pid() AND state NOT IN ('idle')")
            if cursor.fetchone()[0] == 0:
                return
            time.sleep(0.1)


@pytest.fixture(autouse=True)
def no_script_errors(page):
    """Every browser test fails on an uncaught error in the page's scripts."""
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(f"{error}\n{error.stack}"))
    yield errors
    assert not errors, f"script errors in the page: {errors}"


def login(page, server, username: str) -> None:
    page.goto(f"{server['url']}/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORDS[username])
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{server['url']}/")


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def outside_the_browser_loop(fn, **kwargs):
    """Call a service in a thread of its own: Playwright's event loop in this one stops the websocket push."""
    def call():
        try:
            return fn(**kwargs)
        finally:
            connection.close()
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(call).result()
