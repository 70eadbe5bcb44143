"""A poison item in the middle of a live run's telemetry: a real web server, a real engine-side process.

The engine-side process reports through ControlPlaneSink (spool, batches, retries) with the run's own
token; the control plane refuses two of its points by position, the sink drops them, says so, and
carries on: every later batch is applied, and what is stored is what it produced minus what it was told
was dropped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import httpx
import pytest
from django.conf import settings

from forgeboard.runs.models import Run
from forgeboard.telemetry.models import MetricPoint, RunEvent
from tests.support.processes import REPO_DIR, free_port, platform_env, web_server
from workers.engine.wire_limits import MAX_REQUEST_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))]

ENGINE = textwrap.dedent("""
    import json, sys, time
    from workers.engine.control_plane import ControlPlaneSink, ControlPlaneTarget
    from workers.engine.metrics import Recorder

    sink = ControlPlaneSink(ControlPlaneTarget.from_environment(), spool_dir=sys.argv[1], flush_seconds=0.05,
                            max_backoff_s=0.5)
    recorder = Recorder([sink])
    produced = 0
    for step in range(300):
        recorder.log("loss", 1.0 / (step + 1), step=step)
        produced += 1
        if step == 150:
            recorder.log("loss", 0.0, step=-1)        # refused: a negative step
            recorder.log("bad\\x07key", 1.0, step=step)  # refused: a control character in the key
            produced += 2
        if step % 50 == 49:
            time.sleep(0.2)                           # several batches, before and after the poison
    closed = sink.close(timeout_s=60)
    print(json.dumps({"produced": produced, "dropped_metrics": sink.dropped_by_section["metrics"],
                      "dropped": sink.dropped, "closed": closed}))
""")


def test_a_poison_item_does_not_stop_a_live_runs_telemetry(running_run, tmp_path):
    run, token = running_run
    port = free_port()
    token_file = tmp_path / "run.token"
    token_file.write_text(token)
    with web_server(tmp_path / "web.log", port=port):
        engine = subprocess.run(
            [sys.executable, "-c", ENGINE, str(tmp_path / "spool")], cwd=REPO_DIR, capture_output=True, text=True,
            timeout=120, env=platform_env(FORGEBOARD_URL=f"http://127.0.0.1:{port}", FORGEBOARD_RUN_ID=str(run.pk),
                                          FORGEBOARD_RUN_TOKEN_FILE=str(token_file)))
        assert engine.returncode == 0, engine.stderr[-3000:]
        report = json.loads(engine.stdout.strip().splitlines()[-1])

        chunks = (b" " * (1024 * 1024) for _ in range(9))  # over the limit, no Content-Length (chunked)
        try:
            refused = httpx.post(f"http://127.0.0.1:{port}/api/v1/controller/runs/{run.pk}/telemetry",
                                 content=chunks, headers={"Authorization": f"Bearer {token}",
                                                          "Content-Type": "application/json"}, timeout=30)
            assert refused.status_code == 413 and refused.json()["code"] == "payload_too_large"
        except httpx.WriteError:
            pass  # the server answered 413 and closed before the client finished sending; never a 500
        assert MAX_REQUEST_BYTES < 9 * 1024 * 1024
    assert "Traceback" not in (tmp_path / "web.log").read_text()

    assert report["closed"] is True and report["dropped_metrics"] == 2 == report["dropped"]
    points = MetricPoint.objects.filter(series__run=run).exclude(series__key="telemetry/dropped")
    assert points.count() == report["produced"] - report["dropped_metrics"] == 300
    assert sorted(points.values_list("step", flat=True)) == list(range(300)), "the batches after the poison applied"
    assert list((tmp_path / "spool").glob("batch-*.json")) == []
    dropped = [e.payload for e in RunEvent.objects.filter(run=run, kind="message") if
               e.payload.get("name") == "telemetry_dropped"]
    assert sum(e["items"] for e in dropped) == 2
    totals = MetricPoint.objects.filter(series__run=run, series__key="telemetry/dropped").values_list("value", flat=True)
    assert max(totals) == 2.0
    run.refresh_from_db()
    assert run.telemetry_seq >= 6
    assert Run.objects.get(pk=run.pk).last_heartbeat_at is not None
