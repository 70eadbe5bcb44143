"""Fixtures for tests that run the real platform: web server, Celery worker and engine processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.conf import settings

from tests.platform.conftest import grpo_yaml, running_run, team  # noqa: F401 - shared fixtures
from tests.support.processes import celery_worker, free_port, kill_processes_in, web_server
from tests.support.slurm_cluster import SlurmTestCluster


@pytest.fixture
def platform(tmp_path, team):  # noqa: F811 - the team fixture
    """A web server and a worker whose engines report to it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        with web_server(tmp_path / "web.log", port=port) as web, \
                celery_worker(tmp_path / "worker.log", FORGEBOARD_PUBLIC_URL=url):
            yield {"port": port, "url": url, "web": web, "tmp": tmp_path}
    finally:
        # Engines run detached from the worker (they outlive it by design); a test leaves none behind.
        kill_processes_in(Path(settings.DATA_DIR) / "runs")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real SLURM cluster of two nodes on this machine (tests/support/slurm_cluster.py), for the session."""
    cluster = SlurmTestCluster(folder=tmp_path_factory.mktemp("slurm")).start()
    before = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)  # SLURM's commands, here and in the processes the tests start, find it
    try:
        yield cluster
    finally:
        cluster.stop()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
