"""The engine's client against a live control plane: nothing lost while it is down, nothing doubled."""

from __future__ import annotations

import time

import pytest

from forgeboard.runs.models import Command
from forgeboard.runs.services import command_create
from forgeboard.telemetry.models import MetricPoint, RunEvent
from tests.support.processes import free_port
from workers.engine.control_plane import CommandChannel, ControlPlaneSink, ControlPlaneTarget
from workers.engine.metrics import Recorder


def _record(recorder: Recorder, steps: range) -> None:
    for step in steps:
        recorder.log("loss", 1.0 / (step + 1), step=step)
        recorder.log("reward/mean", step / 100, step=step)
    recorder.event("checkpoint_saved", step=steps[-1], path="/ckpt")
    recorder.event("custom_thing", step=steps[-1], detail="x")
    recorder.rollout(step=steps[-1], prompt="1+2=", completion="3", reward=1.0, advantage=0.5)


@pytest.mark.django_db(transaction=True)
def test_sink_ships_everything_once(live_server, running_run, tmp_path):
    run, token = running_run
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    sink = ControlPlaneSink(target, spool_dir=tmp_path / "spool", flush_seconds=0.05)
    recorder = Recorder([sink])
    _record(recorder, range(0, 50))
    time.sleep(0.3)
    _record(recorder, range(50, 100))
    assert sink.close(timeout_s=30) is True
    assert MetricPoint.objects.filter(series__run=run).count() == 200
    kinds = list(RunEvent.objects.filter(run=run).values_list("kind", flat=True))
    assert kinds.count("checkpoint_saved") == 2 and kinds.count("rollout") == 2
    custom = RunEvent.objects.filter(run=run, kind="message").first()
    assert custom.payload["name"] == "custom_thing" and custom.payload["detail"] == "x"
    assert list((tmp_path / "spool").glob("batch-*.json")) == []


@pytest.mark.django_db(transaction=True)
def test_spooled_batches_replay_after_an_outage(live_server, running_run, tmp_path):
    run, token = running_run
    down = ControlPlaneTarget(url=f"http://127.0.0.1:{free_port()}", run_id=run.pk, token=token)
    sink = ControlPlaneSink(down, spool_dir=tmp_path / "spool", flush_seconds=0.05, max_backoff_s=0.2)
    recorder = Recorder([sink])
    _record(recorder, range(0, 30))
    time.sleep(0.2)
    _record(recorder, range(30, 60))
    assert sink.close(timeout_s=1) is False, "nothing can be delivered while the control plane is down"
    spooled = sorted((tmp_path / "spool").glob("batch-*.json"))
    assert len(spooled) >= 2
    assert MetricPoint.objects.filter(series__run=run).count() == 0

    up = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    replay = ControlPlaneSink(up, spool_dir=tmp_path / "spool", flush_seconds=0.05)
    Recorder([replay]).log("loss", 0.0, step=60)
    assert replay.close(timeout_s=30) is True
    assert MetricPoint.objects.filter(series__run=run, series__key="loss").count() == 61
    assert MetricPoint.objects.filter(series__run=run).count() == 121
    run.refresh_from_db()
    assert run.telemetry_seq == len(spooled) + 1


@pytest.mark.django_db(transaction=True)
def test_commands_run_once_across_a_controller_restart(live_server, running_run, team, tmp_path):
    run, token = running_run
    command = command_create(actor=team.member, run=run, kind="checkpoint")
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    calls: list[tuple[str, dict]] = []

    def handler(kind: str, payload: dict) -> dict:
        calls.append((kind, payload))
        return {"path": "/ckpt/step-10"}

    channel = CommandChannel(target, ledger=tmp_path / "commands.json")
    assert channel.poll(handler) == 1
    # The result report is lost (say the web server died): the command is open again for the controller.
    Command.objects.filter(pk=command.pk).update(state="delivered", result={})
    restarted = CommandChannel(target, ledger=tmp_path / "commands.json")
    assert restarted.poll(handler) == 0
    assert calls == [("checkpoint", {})]
    command.refresh_from_db()
    assert command.state == "succeeded" and command.result == {"path": "/ckpt/step-10"}


@pytest.mark.django_db(transaction=True)
def test_a_failing_command_reports_its_error(live_server, monarch_running_run, team, tmp_path):
    run, token = monarch_running_run
    command = command_create(actor=team.member, run=run, kind="placement_change",
                             payload={"action": "move", "role": "generator", "replica": 0, "host": "nope"})

    def handler(kind: str, payload: dict) -> dict:
        raise ValueError(f"unknown host {payload['host']!r}")

    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    assert CommandChannel(target, ledger=tmp_path / "c.json").poll(handler) == 1
    command.refresh_from_db()
    assert command.state == "failed" and command.result == {"error": "unknown host 'nope'"}


@pytest.mark.django_db(transaction=True)
def test_records_of_a_killed_controller_are_sent_by_the_next_one(live_server, running_run, tmp_path):
    run, token = running_run
    down = ControlPlaneTarget(url=f"http://127.0.0.1:{free_port()}", run_id=run.pk, token=token)
    killed = ControlPlaneSink(down, spool_dir=tmp_path / "spool", flush_seconds=3600)
    Recorder([killed]).log_many({"loss": 0.5, "reward/mean": 0.1}, step=1)
    # No close(): the process dies here. Only the journal on disk remains.
    assert (tmp_path / "spool" / "open.jsonl").read_text().count("\n") == 2
    up = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    assert ControlPlaneSink(up, spool_dir=tmp_path / "spool", flush_seconds=0.05).close(timeout_s=30) is True
    assert MetricPoint.objects.filter(series__run=run).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_spool_ahead_of_the_control_plane_is_renumbered_not_lost(live_server, running_run, tmp_path):
    """The control plane expects batch 1 but the spool starts at 3 (its earlier batches went elsewhere)."""
    import json

    run, token = running_run
    spool = tmp_path / "spool"
    spool.mkdir()
    for seq in (3, 4):
        batch = {"seq": seq, "metrics": [{"key": "loss", "step": seq, "value": 0.5, "time": 1.0}],
                 "events": [], "logs": []}
        (spool / f"batch-{seq:012d}.json").write_text(json.dumps(batch))
    (spool / "last_seq").write_text("4")
    up = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    assert ControlPlaneSink(up, spool_dir=spool, flush_seconds=0.05).close(timeout_s=30) is True
    steps = sorted(MetricPoint.objects.filter(series__run=run).values_list("step", flat=True))
    assert steps == [3, 4]
    run.refresh_from_db()
    assert run.telemetry_seq == 2
