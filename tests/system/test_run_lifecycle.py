"""Runs end to end: a real Celery worker, the web server (uvicorn), the engine, Postgres/SQLite and the layer.

A run launched through the service trains a tiny model, reports every metric exactly once, pushes
updates to a websocket client, obeys cancel, survives a killed web server, and a killed controller
is restarted from its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from django.conf import settings
from django.utils import timezone
from websockets.sync.client import connect

from forgeboard.accounts.services import api_token_create
from forgeboard.runs.models import Command, Run
from forgeboard.runs.reconcile import runs_reconcile
from forgeboard.runs.services import command_create, run_cancel, run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import MetricPoint, MetricSeries, RunEvent
from tests.support.configs import sft_yaml
from tests.support.processes import (
    start_web_server,
    stop_group,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))]


def _launch(team, model: Path, **kwargs) -> Run:
    experiment = team.experiment
    experiment.recipe = "sft"
    experiment.save(update_fields=["recipe"])
    return run_launch(actor=team.member, experiment=experiment, config_yaml=sft_yaml(model, **kwargs))


def _state(run: Run) -> str:
    return Run.objects.filter(pk=run.pk).values_list("state", flat=True).get()


def _loss_points(run: Run) -> int:
    return MetricPoint.objects.filter(series__run=run, series__key="loss").count()


def _until_ended(run: Run, timeout: float = 180) -> str:
    ended = {RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED}
    return wait_for(lambda: (s := _state(run)) in ended and s, timeout=timeout, what=f"run {run.pk} to end")


def test_run_reports_every_metric_once_and_streams_them(platform, team, tiny_model):
    _, token = api_token_create(actor=team.member, project=team.project, name="ws", scope="read")
    run = _launch(team, tiny_model, steps=30)
    received: list[dict] = []

    def listen() -> None:
        url = f"ws://127.0.0.1:{platform['port']}/ws/runs/{run.pk}/?token={token}"
        with connect(url, origin=platform["url"], open_timeout=10) as ws:
            while True:
                message = json.loads(ws.recv(timeout=120))
                received.append(message)
                if any(e["payload"].get("to") == "succeeded" for e in message.get("events", [])):
                    return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert _until_ended(run) == RunState.SUCCEEDED, Run.objects.get(pk=run.pk).exit_reason
    listener.join(timeout=30)
    assert _loss_points(run) == 30
    assert MetricSeries.objects.get(run=run, key="loss").point_count == 30
    streamed_steps = {int(p[0]) for m in received for p in m.get("metrics", {}).get("loss", [])}
    assert streamed_steps and streamed_steps <= set(range(1, 31)) | set(range(0, 30))
    assert any(m["type"] == "run.update" for m in received), "live updates, not only the backlog"
    assert RunEvent.objects.filter(run=run, kind="checkpoint_saved").count() >= 3
    run.refresh_from_db()
    assert run.telemetry_seq > 0 and run.last_heartbeat_at is not None


def test_pause_resume_and_cancel_reach_the_engine(platform, team, tiny_model):
    run = _launch(team, tiny_model, steps=100_000)
    wait_for(lambda: _loss_points(run) > 0, timeout=120, what="first metrics")
    pid = Run.objects.get(pk=run.pk).pid
    assert pid and psutil.pid_exists(pid)

    pause = command_create(actor=team.member, run=Run.objects.get(pk=run.pk), kind="pause")
    wait_for(lambda: _state(run) == RunState.PAUSED, timeout=30, what="the engine to pause")
    time.sleep(1.5)  # let what was recorded before the pause arrive
    held = _loss_points(run)
    time.sleep(2.0)
    assert _loss_points(run) == held, "a paused engine trains no further"
    command_create(actor=team.member, run=Run.objects.get(pk=run.pk), kind="resume")
    wait_for(lambda: _state(run) == RunState.RUNNING and _loss_points(run) > held, timeout=30,
             what="training to go on after resume")

    run_cancel(actor=team.member, run=Run.objects.get(pk=run.pk))
    assert _until_ended(run, timeout=60) == RunState.CANCELLED
    wait_for(lambda: not _alive(pid), timeout=20, what="the engine to exit")
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if f"runs/{run.pk}-" in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
    commands = {c.kind: c for c in Command.objects.filter(run=run)}
    assert commands["pause"].state == "succeeded" and commands["pause"].pk == pause.pk
    assert commands["resume"].state == "succeeded"
    assert commands["cancel"].state == "succeeded", "the engine stopped by itself, after a final checkpoint"
    assert commands["cancel"].result["path"].endswith(f"step_{commands['cancel'].result['step']:06d}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_killed_web_server_loses_and_doubles_nothing(platform, team, tiny_model):
    run = _launch(team, tiny_model, steps=120)
    wait_for(lambda: _loss_points(run) >= 10, timeout=120, what="metrics before the kill")
    os.killpg(platform["web"].pid, signal.SIGKILL)
    platform["web"].wait()
    time.sleep(2)  # the engine keeps training and spools meanwhile
    replacement = start_web_server(platform["tmp"] / "web2.log", port=platform["port"])
    try:
        assert _until_ended(run) == RunState.SUCCEEDED, Run.objects.get(pk=run.pk).exit_reason
    finally:
        stop_group(replacement)
    assert _loss_points(run) == 120
    assert MetricSeries.objects.get(run=run, key="loss").point_count == 120
    seqs = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))


def test_killed_controller_is_restarted_from_its_checkpoint(platform, team, tiny_model):
    run = _launch(team, tiny_model, steps=60, max_restarts=1)
    wait_for(lambda: RunEvent.objects.filter(run=run, kind="checkpoint_saved").count() >= 2, timeout=120,
             what="two checkpoints")
    engine_pid = Run.objects.get(pk=run.pk).pid
    os.kill(engine_pid, signal.SIGKILL)
    wait_for(lambda: _state(run) == RunState.LOST, timeout=30, what="the run to be marked lost")
    report = runs_reconcile(now=timezone.now())
    assert report.restarted == [run.pk]
    assert _until_ended(run) == RunState.SUCCEEDED, Run.objects.get(pk=run.pk).exit_reason
    run.refresh_from_db()
    assert run.restart_count == 1 and run.pid != engine_pid
    assert RunEvent.objects.filter(run=run, kind="restarted").count() == 1
    resumed = [e for e in RunEvent.objects.filter(run=run, kind="message") if e.payload.get("name") == "resumed"]
    assert len(resumed) == 1 and resumed[0].payload["step"] >= 20
    assert _loss_points(run) == 60
