"""Benchmarks: emit -> websocket client latency with 1 and 100 subscribers; enqueue -> controller start.

The emitter posts telemetry over HTTP as an engine does; the subscribers run in a process of their own.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/forgeboard REDIS_URL=redis://127.0.0.1:6379/15 \
        FORGEBOARD_ENV=test .venv/bin/python -m pytest tests/bench/test_bench_streams.py -s
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from forgeboard.accounts.services import api_token_create
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from tests.support.processes import REPO_DIR, celery_worker, free_port, wait_for, web_server

pytestmark = pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))
MESSAGES = int(__import__("os").environ.get("BENCH_MESSAGES", "100"))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _measure(port: int, run, run_token: str, read_token: str, subscribers: int, first_seq: int) -> list[float]:
    run.refresh_from_db()
    url = f"ws://127.0.0.1:{port}/ws/runs/{run.pk}/?token={read_token}&after_seq={run.last_event_seq}"
    listener = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("ws_subscribers.py")), url, f"http://127.0.0.1:{port}",
         str(subscribers), str(MESSAGES)], stdout=subprocess.PIPE, text=True)
    assert listener.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {run_token}"}) as c:
        for i in range(MESSAGES):
            body = {"batches": [{"seq": first_seq + i, "events": [
                {"kind": "message", "payload": {"emitted": time.time()}, "time": time.time()}]}]}
            assert c.post(f"/api/v1/controller/runs/{run.pk}/telemetry", json=body).status_code == 200
            time.sleep(0.02)
    out, _ = listener.communicate(timeout=300)
    latencies = json.loads(out)
    assert len(latencies) == MESSAGES * subscribers
    return latencies


def test_emit_to_websocket_latency(tmp_path, running_run, team):
    run, run_token = running_run
    _, read_token = api_token_create(actor=team.member, project=team.project, name="ws", scope="read")
    layers = ["pubsub", "core"] if settings.CHANNEL_LAYERS["default"]["BACKEND"].startswith("channels_redis") else [""]
    rows = []
    seq = 1
    for layer in layers:  # Redis: both channel layers, one after the other, in this run
        port = free_port()
        with web_server(tmp_path / f"web-{layer}.log", port=port, **({"FORGEBOARD_CHANNEL_LAYER": layer} if layer else {})):
            for subscribers in (1, 100):
                latencies = _measure(port, run, run_token, read_token, subscribers, seq)
                seq += MESSAGES
                rows.append((layer or "sqlite", subscribers, statistics.median(latencies), _percentile(latencies, 0.99)))
    print(f"\nemit -> websocket client ({MESSAGES} messages, one web server process)")
    for layer, subscribers, p50, p99 in rows:
        print(f"  {layer:7s} {subscribers:4d} subscribers: p50 {p50 * 1000:7.1f} ms   p99 {p99 * 1000:7.1f} ms")
    if len(layers) == 2:
        print(f"  p99 with 100 subscribers, core / pubsub: {rows[3][3] / rows[1][3]:.1f}x")


def test_enqueue_to_controller_start(tmp_path, team):
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "workers.engine", "make-tiny-model", "--out", str(model)], cwd=REPO_DIR,
                   check=True, capture_output=True)
    experiment = team.experiment
    experiment.recipe = "sft"
    experiment.save()
    yaml = (f"recipe: sft\nmodel: {{path: {model}}}\ntrainer: {{steps: 3, batch_size: 4, micro_batch_size: 4}}\n"
            "eval: {every_steps: 0}\ntelemetry: {console: false, flush_seconds: 0.1}\n")
    port = free_port()
    rows = []
    with web_server(tmp_path / "web.log", port=port), \
            celery_worker(tmp_path / "worker.log", FORGEBOARD_PUBLIC_URL=f"http://127.0.0.1:{port}"):
        for _ in range(3):
            started = time.perf_counter()
            run = run_launch(actor=team.member, experiment=experiment, config_yaml=yaml)
            wait_for(lambda: Run.objects.filter(pk=run.pk, state=RunState.RUNNING).exists()
                     or Run.objects.get(pk=run.pk).telemetry_seq > 0, timeout=120, interval=0.01, what="running")
            to_running = time.perf_counter() - started
            wait_for(lambda: Run.objects.get(pk=run.pk).last_heartbeat_at is not None, timeout=120, interval=0.01,
                     what="first report")
            to_report = time.perf_counter() - started
            wait_for(lambda: Run.objects.get(pk=run.pk).state == RunState.SUCCEEDED, timeout=120, what="end")
            rows.append((to_running, to_report))
    print("\nenqueue -> controller start (local backend, Celery worker, 3 launches)")
    for i, (to_running, to_report) in enumerate(rows, 1):
        print(f"  launch {i}: enqueue->running {to_running * 1000:7.0f} ms   enqueue->first report {to_report:5.1f} s")
    print(f"  median enqueue->running {statistics.median(r[0] for r in rows) * 1000:.0f} ms; the rest is the "
          f"engine importing torch and loading the model")
