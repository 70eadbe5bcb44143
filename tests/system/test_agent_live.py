"""`forgeboard agent --once` registers this machine with a running control plane, over real HTTP."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.conf import settings

from forgeboard.cluster.models import Host
from forgeboard.cluster.services import agent_token_create
from tests.support.processes import REPO_DIR, free_port, platform_env, web_server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))]


def test_agent_registers_the_host_and_its_cpu(tmp_path, team):
    _, raw = agent_token_create(actor=team.operator, name="node-agents")
    token_file = tmp_path / "agent-token"
    token_file.write_text(raw)
    port = free_port()
    with web_server(tmp_path / "web.log", port=port):
        result = subprocess.run(
            [sys.executable, "-m", "forgeboard.cli", "agent", "--server", f"http://127.0.0.1:{port}",
             "--token-file", str(token_file), "--hostname", "ci-node-1", "--pool", "cpu", "--label", "rack=a1",
             "--once"],
            cwd=REPO_DIR, env=platform_env(), capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    host = Host.objects.get(hostname="ci-node-1")
    assert host.pool == "cpu" and host.labels == {"rack": "a1"} and host.cpu_count > 0 and host.memory_bytes > 0
    assert host.last_heartbeat_at is not None and host.state == "up"
