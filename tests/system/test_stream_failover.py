"""A websocket client whose web server dies reconnects to another web process and misses nothing."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from django.conf import settings
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from forgeboard.accounts.services import api_token_create
from tests.support.processes import free_port, stop_group, web_server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))]
BATCHES = 30


def _post(port: int, run, token: str, seq: int) -> None:
    body = {"batches": [{"seq": seq, "metrics": [{"key": "loss", "step": seq, "value": 1.0 / seq, "time": 1.7e9}],
                         "events": [{"kind": "message", "payload": {"batch": seq}, "time": 1.7e9}]}]}
    response = httpx.post(f"http://127.0.0.1:{port}/api/v1/controller/runs/{run.pk}/telemetry", json=body,
                          headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert response.status_code == 200, response.text


def _batches_in(message: dict) -> list[int]:
    return [e["payload"]["batch"] for e in message.get("events", []) if e["kind"] == "message"]


def test_reconnect_to_a_second_web_process_resumes_without_a_gap(tmp_path, running_run, team):
    run, run_token = running_run
    _, read_token = api_token_create(actor=team.member, project=team.project,
                                     name="ws", scope="read")
    port_a, port_b = free_port(), free_port()
    seen: list[int] = []
    last_seq = 0
    with web_server(tmp_path / "a.log", port=port_a) as server_a, web_server(tmp_path / "b.log", port=port_b):
        ws = connect(f"ws://127.0.0.1:{port_a}/ws/runs/{run.pk}/?token={read_token}",
                     origin=f"http://127.0.0.1:{port_a}", open_timeout=10)
        backlog = json.loads(ws.recv(timeout=10))
        assert backlog["type"] == "run.backlog"
        last_seq = backlog["events"][-1]["seq"] if backlog["events"] else 0
        for seq in range(1, 11):  # the controller reports to B; A's subscriber hears it through the layer
            _post(port_b, run, run_token, seq)
        deadline = time.monotonic() + 20
        while len(seen) < 10 and time.monotonic() < deadline:
            message = json.loads(ws.recv(timeout=20))
            seen.extend(_batches_in(message))
            if message.get("events"):
                last_seq = message["events"][-1]["seq"]
        assert seen == list(range(1, 11))

        os.killpg(server_a.pid, signal.SIGKILL)
        server_a.wait()
        with pytest.raises((ConnectionClosed, TimeoutError, OSError)):
            ws.recv(timeout=5)
        for seq in range(11, 21):  # missed while reconnecting
            _post(port_b, run, run_token, seq)

        with connect(f"ws://127.0.0.1:{port_b}/ws/runs/{run.pk}/?token={read_token}&after_seq={last_seq}",
                     origin=f"http://127.0.0.1:{port_b}", open_timeout=10) as ws_b:
            resumed = json.loads(ws_b.recv(timeout=10))
            assert resumed["type"] == "run.backlog"
            seen.extend(_batches_in(resumed))
            for seq in range(21, BATCHES + 1):
                _post(port_b, run, run_token, seq)
            deadline = time.monotonic() + 20
            while len(seen) < BATCHES and time.monotonic() < deadline:
                seen.extend(_batches_in(json.loads(ws_b.recv(timeout=20))))
        stop_group(server_a)
    assert seen == list(range(1, BATCHES + 1)), "every batch once, in order, across the failover"
    logged = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    assert f"/ws/runs/{run.pk}/?token=[redacted]" in logged and read_token not in logged, "uvicorn logs handshakes"
