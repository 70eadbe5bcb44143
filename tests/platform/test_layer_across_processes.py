"""The channel layer carries a message from another process (a worker) to a websocket in this one.

Runs on both configurations: Redis, and the embedded SQLite layer.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings

from forgeboard.accounts.services import api_token_create
from forgeboard.asgi import application
from tests.support.processes import REPO_DIR, platform_env

pytestmark = [pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES)), pytest.mark.asyncio]

SEND = """
import django, json, sys
django.setup()
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
update = {"type": "run.update", "run": int(sys.argv[1]), "events": [{"seq": 10**9, "kind": "message",
          "payload": {"from": "worker"}, "time": "2026-01-01T00:00:00+00:00"}], "metrics": {}, "logs": []}
async_to_sync(get_channel_layer().group_send)(f"run-{sys.argv[1]}", {"type": "run.update", "update": update})
"""


async def test_a_message_from_another_process_reaches_the_websocket(running_run, team):
    run, _ = running_run
    _, token = await database_sync_to_async(api_token_create)(actor=team.member, project=team.project,
                                                               name="ws", scope="read")
    communicator = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/?token={token}",
                                         headers=[(b"origin", b"http://127.0.0.1")])
    connected, _ = await communicator.connect(timeout=10)
    assert connected
    await communicator.receive_from(timeout=10)  # backlog
    sent = await database_sync_to_async(subprocess.run)(
        [sys.executable, "-c", SEND, str(run.pk)], cwd=REPO_DIR, env=platform_env(), capture_output=True,
        text=True, timeout=120)
    assert sent.returncode == 0, sent.stderr
    message = json.loads(await communicator.receive_from(timeout=15))
    assert message["events"][0]["payload"] == {"from": "worker"}
    await communicator.disconnect()
