"""The engine's client against a live control plane: nothing lost while it is down, nothing doubled."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from forgeboard.runs.models import Command, Run
from forgeboard.runs.services import command_create
from forgeboard.telemetry.models import LogLine, MetricPoint, RunEvent
from tests.support.processes import free_port
from tests.support.small_disk import small_disk
from workers.engine.command_channel import CommandChannel
from workers.engine.control_plane import ControlPlaneSink, ControlPlaneTarget, record_to_wire
from workers.engine.metrics import Recorder
from workers.engine.telemetry_wire import MAX_REQUEST_BYTES, TelemetryRequest, WireEvent
from workers.engine.wire_limits import json_depth


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


def _dropped_events(run) -> list[dict]:
    return [e.payload for e in RunEvent.objects.filter(run=run, kind="message").order_by("seq")
            if e.payload.get("name") == "telemetry_dropped"]


def _dropped_metric(run) -> dict[int, float]:
    return dict(MetricPoint.objects.filter(series__run=run, series__key="telemetry/dropped")
                .values_list("step", "value"))


@pytest.mark.django_db(transaction=True)
def test_a_poison_item_in_the_middle_does_not_stop_later_batches(live_server, running_run, tmp_path):
    run, token = running_run
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    sink = ControlPlaneSink(target, spool_dir=tmp_path / "spool", flush_seconds=0.05, max_backoff_s=0.2)
    recorder = Recorder([sink])
    for step in range(30):
        recorder.log("loss", 1.0 / (step + 1), step=step)
    time.sleep(0.3)
    recorder.log("loss", 0.5, step=30)
    recorder.log("bad\x07key", 1.0, step=30)  # a control character: the control plane refuses this point
    recorder.log("loss", 0.4, step=31)
    time.sleep(0.3)
    for step in range(32, 60):
        recorder.log("loss", 1.0 / (step + 1), step=step)
    assert sink.close(timeout_s=30) is True
    assert MetricPoint.objects.filter(series__run=run, series__key="loss").count() == 60
    assert not MetricPoint.objects.filter(series__run=run, series__key__startswith="bad").exists()
    assert sink.dropped == 1 and sink.dropped_by_section["metrics"] == 1
    [event] = _dropped_events(run)
    assert event["items"] == 1 and event["total"] == 1 and "batches.0.metrics.1.key" in event["reasons"][0]
    assert _dropped_metric(run) == {1: 1.0}
    assert (tmp_path / "spool" / "dropped").read_text() == "1"
    assert list((tmp_path / "spool").glob("batch-*.json")) == []


@pytest.mark.django_db(transaction=True)
def test_duplicate_points_the_control_plane_dropped_are_recorded(live_server, running_run, tmp_path):
    run, token = running_run
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    sink = ControlPlaneSink(target, spool_dir=tmp_path / "spool", flush_seconds=3600)
    recorder = Recorder([sink])
    recorder.log("loss", 0.9, step=1)
    recorder.log("loss", 0.8, step=1)
    recorder.log("loss", 0.7, step=2)
    assert sink.close(timeout_s=30) is True
    assert dict(MetricPoint.objects.filter(series__run=run, series__key="loss").values_list("step", "value")) == \
        {1: 0.8, 2: 0.7}
    assert sink.dropped == 1 and _dropped_metric(run) == {1: 1.0}
    assert "step 1" in _dropped_events(run)[0]["reasons"][0]


def _spool_batch(spool, seq: int, **sections) -> None:
    batch = {"seq": seq, "metrics": [], "events": [], "logs": []} | sections
    (spool / f"batch-{seq:012d}.json").write_text(json.dumps(batch))


@pytest.mark.django_db(transaction=True)
def test_a_batch_refused_forever_is_quarantined_and_the_next_ones_applied(live_server, running_run, tmp_path):
    run, token = running_run
    spool = tmp_path / "spool"
    spool.mkdir()
    _spool_batch(spool, 1, metrics=[{"key": "loss", "step": 1, "value": 0.5, "time": 1.0}])
    _spool_batch(spool, 2, metrics="not a list", logs=[{"line": "lost with its batch", "time": 1.0}])
    _spool_batch(spool, 3, metrics=[{"key": "loss", "step": 3, "value": 0.5, "time": 1.0}])
    (spool / "last_seq").write_text("3")
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    sink = ControlPlaneSink(target, spool_dir=spool, flush_seconds=0.05, max_backoff_s=0.1)
    assert sink.close(timeout_s=30) is True
    assert sorted(MetricPoint.objects.filter(series__run=run, series__key="loss").values_list("step", flat=True)) \
        == [1, 3]
    assert json.loads((spool / "refused" / "batch-000000000002.json").read_text())["metrics"] == "not a list"
    assert sink.dropped == 1 and sink.dropped_by_section["logs"] == 1
    assert "HTTP 400" in _dropped_events(run)[0]["reasons"][0]
    run.refresh_from_db()
    assert run.telemetry_seq >= 4, "the refused batch's number is taken by an empty batch, then the drop is reported"


@pytest.mark.django_db(transaction=True)
def test_5xx_answers_keep_the_batch_for_later(running_run, tmp_path):
    """A control plane that answers 503 (restarting) loses nothing: the batch waits, nothing is dropped."""
    import httpx

    run, token = running_run
    answers = iter([503, 502, 500])
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        status = next(answers, 503)
        seen.append(status)
        return httpx.Response(status, json={"code": "internal_error", "message": "down", "errors": []})

    target = ControlPlaneTarget(url="http://control-plane", run_id=run.pk, token=token)
    sink = ControlPlaneSink(target, spool_dir=tmp_path / "spool", flush_seconds=0.02, max_backoff_s=0.05,
                            transport=httpx.MockTransport(handler))
    Recorder([sink]).log("loss", 0.5, step=1)
    assert sink.close(timeout_s=2) is False
    assert len(seen) >= 4 and sink.dropped == 0
    assert not (tmp_path / "spool" / "refused").exists()
    [kept] = (tmp_path / "spool").glob("batch-*.json")
    assert json.loads(kept.read_text())["metrics"][0]["key"] == "loss"


@pytest.mark.django_db(transaction=True)
def test_a_batch_over_the_size_limit_is_split_and_the_later_ones_renumbered(live_server, running_run, tmp_path):
    run, token = running_run
    spool = tmp_path / "spool"
    spool.mkdir()
    _spool_batch(spool, 1, logs=[{"line": f"{i:05d}" + "x" * 8000, "time": 1.0} for i in range(1100)])
    _spool_batch(spool, 2, metrics=[{"key": "loss", "step": 2, "value": 0.5, "time": 1.0}])
    (spool / "last_seq").write_text("2")
    assert (spool / "batch-000000000001.json").stat().st_size > MAX_REQUEST_BYTES
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    assert ControlPlaneSink(target, spool_dir=spool, flush_seconds=0.05).close(timeout_s=60) is True
    lines = [line[:5] for line in LogLine.objects.filter(run=run).order_by("batch_seq", "index")
             .values_list("line", flat=True)]
    assert lines == [f"{i:05d}" for i in range(1100)], "every line once, in order"
    assert MetricPoint.objects.filter(series__run=run, series__key="loss").count() == 1
    run.refresh_from_db()
    assert run.telemetry_seq == 3


def test_a_sealed_batch_stays_within_the_limits(tmp_path):
    """Records are packed into batches under the size limit and the per-section counts."""
    down = ControlPlaneTarget(url=f"http://127.0.0.1:{free_port()}", run_id=1, token="fbr_x")
    sink = ControlPlaneSink(down, spool_dir=tmp_path / "spool", flush_seconds=3600)
    for i in range(1500):
        sink.log_line(f"{i} " + "y" * 8000)
        sink.write({"kind": "event", "name": "message", "seq": i, "time": 1.0, "i": i})
    sink.close(timeout_s=0.1)
    batches = [json.loads(p.read_text()) for p in sorted((tmp_path / "spool").glob("batch-*.json"))]
    assert [b["seq"] for b in batches] == list(range(1, len(batches) + 1)) and len(batches) >= 3
    assert all(len(json.dumps(b)) <= MAX_REQUEST_BYTES // 2 + 9000 and len(b["events"]) <= 1000 for b in batches)
    assert sum(len(b["logs"]) for b in batches) == 1500 and sum(len(b["events"]) for b in batches) == 1500
    TelemetryRequest.model_validate({"batches": batches[:1]})


def test_what_the_engine_records_itself_never_breaks_the_sink():
    deep: dict = {}
    inner = deep
    for _ in range(5000):
        inner["x"] = {}
        inner = inner["x"]
    cycle: list = []
    cycle.append(cycle)
    record = {"kind": "event", "name": "checkpoint_saved", "seq": 1, "time": 1.0, "deep": deep, "cycle": cycle,
              float("nan"): 1, ("a", 1): 2, "reward": float("inf"), "text": "a\x00b\ud800", "obj": object()}
    section, item = record_to_wire(record)
    text = json.dumps(item, allow_nan=False)
    assert section == "events" and json_depth(text) <= 33
    event = WireEvent.model_validate(json.loads(text))
    assert event.payload["nan"] == 1 and event.payload["reward"] is None and event.payload["text"] == "a\ufffdb?"
    assert event.payload["cycle"] == ["<list: a cycle>"]
    section, item = record_to_wire({"kind": "metric", "key": float("nan"), "step": None, "value": "x", "time": 1.0})
    assert section == "metrics" and item["key"] == "nan" and item["step"] == "None"
    json.dumps(item)


@pytest.mark.django_db(transaction=True)
def test_answers_that_are_not_the_apis_do_not_stop_the_sender(live_server, running_run, tmp_path):
    """A proxy answers 200 with a page, then with JSON of another shape: the background sender goes on (its heartbeats
    are what keep the run from being taken for lost) and delivers what was recorded, before any close()."""
    import httpx

    run, token = running_run
    server = httpx.HTTPTransport()
    answers = [httpx.Response(200, text="<html>a portal</html>"), httpx.Response(200, json={"applied": "?"}),
               httpx.Response(409, json={"code": "sequence_gap"})]

    class Proxy(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return answers.pop(0) if answers else server.handle_request(request)

    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    sink = ControlPlaneSink(target, spool_dir=tmp_path / "spool", flush_seconds=0.05, max_backoff_s=0.1,
                            transport=Proxy())
    Recorder([sink]).log("loss", 0.5, step=1)
    deadline = time.monotonic() + 20
    while MetricPoint.objects.filter(series__run=run).count() == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert answers == [] and sink._thread.is_alive()
    assert MetricPoint.objects.filter(series__run=run).count() == 1
    assert sink.close(timeout_s=10) is True


# --- crash safety: a controller killed at any point of a spool change loses and doubles nothing ---------------------

class Crash(BaseException):
    """The controller dies here (a SIGKILL, an OOM kill, a power cut): nothing after this line runs."""


class CrashAt:
    """Counts the changes made to the spool folder (a rename, a removal, a write in place) and kills the controller
    just before the one numbered `at`: every point between two steps of a spool change is tried by one test."""

    def __init__(self, spool: Path, at: int, patch: pytest.MonkeyPatch) -> None:
        self.spool, self.at, self.done, self.crashed = str(spool), at, 0, False
        for owner, name in ((os, "replace"), (os, "rename"), (os, "unlink"), (os, "remove"), (Path, "write_text")):
            patch.setattr(owner, name, self._before(getattr(owner, name)))

    def _before(self, change):  # noqa: ANN001, ANN202
        def changed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if str(args[0]).startswith(self.spool):
                if self.done == self.at:
                    self.crashed = True
                    raise Crash
                self.done += 1
            return change(*args, **kwargs)
        return changed


def _lines(run) -> list[str]:
    return list(LogLine.objects.filter(run=run).order_by("batch_seq", "index").values_list("line", flat=True))


def _deliver(target: ControlPlaneTarget, spool: Path, lines: list[str]) -> None:
    """A first controller delivers one batch per line, numbered from 1."""
    for seq, line in enumerate(lines, start=1):
        _spool_batch(spool, seq, logs=[{"line": line, "time": 1.0}])
    (spool / "last_seq").write_text(str(len(lines)))
    assert ControlPlaneSink(target, spool_dir=spool, flush_seconds=3600).close(timeout_s=30) is True


def _while_sealing(target: ControlPlaneTarget, spool: Path) -> tuple[ControlPlaneSink, list[str]]:
    """Records in the open journal are sealed into a batch, then sent."""
    sink = ControlPlaneSink(target, spool_dir=spool, flush_seconds=3600)
    for i in range(3):
        sink.log_line(f"line {i}")
    return sink, [f"line {i}" for i in range(3)]


def _while_realigning(target: ControlPlaneTarget, spool: Path) -> tuple[ControlPlaneSink, list[str]]:
    """The control plane has batches 1 and 2; the spool holds 2 again (its answer was lost) and then 5, 6 and 7:
    the sequence_gap answer (3 expected) drops 2 and renumbers 5, 6, 7 as 3, 4, 5."""
    _deliver(target, spool, ["one", "two"])
    _spool_batch(spool, 2, logs=[{"line": "two", "time": 1.0}])
    for seq, line in ((5, "three"), (6, "four"), (7, "five")):
        _spool_batch(spool, seq, logs=[{"line": line, "time": 1.0}])
    (spool / "last_seq").write_text("7")
    return ControlPlaneSink(target, spool_dir=spool, flush_seconds=3600), ["one", "two", "three", "four", "five"]


def _while_splitting(target: ControlPlaneTarget, spool: Path) -> tuple[ControlPlaneSink, list[str]]:
    """Batch 1 is over the request-size limit: it is split in two, and batch 2 becomes 3."""
    big = [f"{i:05d}" + "x" * 8000 for i in range(1100)]
    _spool_batch(spool, 1, logs=[{"line": line, "time": 1.0} for line in big])
    _spool_batch(spool, 2, logs=[{"line": "after the big one", "time": 1.0}])
    (spool / "last_seq").write_text("2")
    return ControlPlaneSink(target, spool_dir=spool, flush_seconds=3600), [*big, "after the big one"]


CRASH_POINTS = 10


@pytest.mark.parametrize("crash_at", range(CRASH_POINTS))
@pytest.mark.parametrize("change", [_while_sealing, _while_realigning, _while_splitting],
                         ids=["seal", "realign", "split"])
@pytest.mark.django_db(transaction=True)
def test_a_controller_killed_in_the_middle_of_a_spool_change_loses_and_doubles_nothing(
        live_server, running_run, tmp_path, monkeypatch, change, crash_at):
    """The controller is killed before its `crash_at`-th change to the spool folder (sealing records into a batch,
    renumbering after a sequence_gap, splitting a batch over the size limit, sending); the next controller on the
    same folder delivers every item exactly once, in order."""
    run, token = running_run
    spool = tmp_path / "spool"
    spool.mkdir()
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    sink, expected = change(target, spool)
    with monkeypatch.context() as patch:
        crash = CrashAt(spool, crash_at, patch)
        try:
            sink.close(timeout_s=30)
        except Crash:
            pass
    if crash_at == CRASH_POINTS - 1:
        assert not crash.crashed, "the last point tried is past the end: every point of the change was tried"
    assert ControlPlaneSink(target, spool_dir=spool, flush_seconds=3600).close(timeout_s=60) is True
    assert _lines(run) == expected, "every item once, in order"
    assert list(spool.glob("batch-*.json")) == []


# --- a spool's number marker that cannot be read ------------------------------------------------------------------

@pytest.mark.parametrize("marker", [b"", b"seven", b"\x00\x00\x00\x00", b"-3", b"9" * 40, b"12\n34", b"\xff\xfe"],
                         ids=["empty", "text", "zeros", "negative", "huge", "two-lines", "not-utf8"])
@pytest.mark.django_db(transaction=True)
def test_a_garbled_last_seq_is_recovered_from_the_control_planes_answer(live_server, running_run, tmp_path, caplog,
                                                                        marker):
    """The marker of the last batch number is garbled (cut short by a crash, a bad disk) after its batches were all
    delivered: the controller still starts, and what it records next is stored, not skipped as a batch the control
    plane already has, nor refused for a number out of range."""
    run, token = running_run
    spool = tmp_path / "spool"
    spool.mkdir()
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    _deliver(target, spool, ["one", "two", "three"])
    (spool / "last_seq").write_bytes(marker)

    sink = ControlPlaneSink(target, spool_dir=spool, flush_seconds=3600, max_backoff_s=0.1)
    Recorder([sink]).log("loss", 0.5, step=4)
    sink.log_line("after the restart")
    assert sink.close(timeout_s=30) is True
    assert _lines(run) == ["one", "two", "three", "after the restart"]
    assert MetricPoint.objects.filter(series__run=run, series__key="loss").count() == 1
    run.refresh_from_db()
    assert run.telemetry_seq == 4 and (spool / "last_seq").read_text() == "4"
    assert "last_seq" in caplog.text, "the recovery is logged"


@pytest.mark.django_db(transaction=True)
def test_a_garbled_last_seq_beside_spooled_batches_numbers_on_from_them(live_server, running_run, tmp_path):
    """Batches still in the spool say where numbering stands: the next batch follows them."""
    run, token = running_run
    spool = tmp_path / "spool"
    spool.mkdir()
    _spool_batch(spool, 1, logs=[{"line": "one", "time": 1.0}])
    _spool_batch(spool, 2, logs=[{"line": "two", "time": 1.0}])
    (spool / "last_seq").write_text("two")
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    sink = ControlPlaneSink(target, spool_dir=spool, flush_seconds=3600)
    sink.log_line("three")
    assert sink.close(timeout_s=30) is True
    assert _lines(run) == ["one", "two", "three"]
    run.refresh_from_db()
    assert run.telemetry_seq == 3


# --- the final flush --------------------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_final_flush_that_fails_ends_the_run_as_it_was_and_leaves_the_spool(live_server, running_run, tmp_path,
                                                                              caplog):
    """The disk is full as the run ends (the batch cannot be written): `recorder.close()` raises nothing (an
    exception there turned a finished run into a failed one), the log says what is left where, and the next
    controller on the same folder delivers it."""
    run, token = running_run
    spool = tmp_path / "spool"
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    sink = ControlPlaneSink(target, spool_dir=spool, flush_seconds=3600)
    recorder = Recorder([sink])
    recorder.log("loss", 0.5, step=1)
    sink.log_line("the last line")
    (spool / "batch-000000000001.json").mkdir()  # os.replace onto a folder fails as a full disk would

    recorder.close()

    assert "left in the spool" in caplog.text and str(spool) in caplog.text
    assert MetricPoint.objects.filter(series__run=run).count() == 0
    (spool / "batch-000000000001.json").rmdir()
    assert ControlPlaneSink(target, spool_dir=spool, flush_seconds=3600).close(timeout_s=30) is True
    assert _lines(run) == ["the last line"]
    assert MetricPoint.objects.filter(series__run=run, series__key="loss").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_full_disk_drops_and_reports_what_the_spool_cannot_take_and_sends_the_rest_once(
        live_server, running_run, tmp_path, monkeypatch):
    """Recording on a disk that fills up mid-run: the training loop never sees an error, what the journal could not
    take is counted and reported once the disk takes records again, and every record written arrives exactly once."""
    run, token = running_run
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    with small_disk(tmp_path / "disk", size=64 * 1024, monkeypatch=monkeypatch) as disk:
        sink = ControlPlaneSink(target, spool_dir=disk.folder / "spool", flush_seconds=3600)
        recorder = Recorder([sink])
        for step in range(5):
            recorder.log("loss", 1.0 / (step + 1), step=step)
        disk.fill()
        for step in range(5, 15):
            recorder.event("note", step=step, text="y" * 6000)  # longer than the journal's last page has room for
        disk.free()
        for step in range(15, 20):
            recorder.log("loss", 1.0 / (step + 1), step=step)
        assert sink.close(timeout_s=30) is True
        assert (disk.folder / "spool" / "dropped").read_text() == "10"
    assert sorted(MetricPoint.objects.filter(series__run=run, series__key="loss").values_list("step", flat=True)) == \
        [*range(5), *range(15, 20)]
    assert not [e for e in RunEvent.objects.filter(run=run, kind="message") if e.payload.get("name") == "note"]
    [event] = _dropped_events(run)
    assert event["items"] == 10 and event["total"] == 10 and event["by_section"] == {"events": 10}
    assert "not written" in event["reasons"][0] and "No space left on device" in event["reasons"][0]
    assert _dropped_metric(run) == {10: 10.0} and sink.dropped == 10 and recorder.dropped == {}


@pytest.mark.django_db(transaction=True)
def test_a_seal_that_finds_no_space_still_tells_the_control_plane_the_run_is_alive(
        live_server, running_run, tmp_path, monkeypatch):
    run, token = running_run
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    with small_disk(tmp_path / "disk", size=64 * 1024, monkeypatch=monkeypatch) as disk:
        sink = ControlPlaneSink(target, spool_dir=disk.folder / "spool", flush_seconds=3600, max_backoff_s=0.05)
        recorder = Recorder([sink])
        for step in range(5):
            recorder.log("loss", 1.0 / (step + 1), step=step)
        disk.fill()
        Run.objects.filter(pk=run.pk).update(last_heartbeat_at=None)
        sink._wake.set()  # the sender's round: its seal finds no space for the batch
        deadline = time.monotonic() + 30
        while Run.objects.get(pk=run.pk).last_heartbeat_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Run.objects.get(pk=run.pk).last_heartbeat_at is not None, "the sender heartbeats while it cannot seal"
        assert MetricPoint.objects.filter(series__run=run).count() == 0
        assert list((disk.folder / "spool").glob("sealing-*.jsonl")), "the records wait in the journal being sealed"
        disk.free()
        assert sink.close(timeout_s=30) is True
    assert sorted(MetricPoint.objects.filter(series__run=run, series__key="loss").values_list("step", flat=True)) == \
        list(range(5))


@pytest.mark.django_db(transaction=True)
def test_a_garbled_count_of_dropped_items_is_reported_not_reset_silently(live_server, running_run, tmp_path):
    run, token = running_run
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "dropped").write_text("garbled")
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    assert ControlPlaneSink(target, spool_dir=spool, flush_seconds=3600).close(timeout_s=30) is True
    [lost] = [e.payload for e in RunEvent.objects.filter(run=run, kind="message")
              if e.payload.get("name") == "telemetry_dropped_count_lost"]
    assert "'garbled'" in lost["reason"] and "counted again from 0" in lost["reason"]


@pytest.mark.django_db(transaction=True)
def test_records_the_journal_could_not_take_as_the_run_ended_are_reported_at_close(
        live_server, running_run, tmp_path, monkeypatch):
    run, token = running_run
    target = ControlPlaneTarget(url=live_server.url, run_id=run.pk, token=token)
    with small_disk(tmp_path / "disk", size=64 * 1024, monkeypatch=monkeypatch) as disk:
        sink = ControlPlaneSink(target, spool_dir=disk.folder / "spool", flush_seconds=3600)
        recorder = Recorder([sink])
        recorder.log("loss", 0.5, step=1)
        disk.fill()
        for step in range(2, 5):
            recorder.event("note", step=step, text="y" * 6000)
        disk.free()  # and nothing recorded after: the close reports them
        assert sink.close(timeout_s=30) is True
    [event] = _dropped_events(run)
    assert event["items"] == 3 and event["by_section"] == {"events": 3} and _dropped_metric(run) == {3: 3.0}
