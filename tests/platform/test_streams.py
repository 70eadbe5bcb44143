"""Websocket streams: a backlog from the database, then live updates; a reconnect resumes without a gap."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from channels.db import database_sync_to_async as sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings

from forgeboard.accounts.services import api_token_create
from forgeboard.asgi import application
from forgeboard.runs.services import command_acknowledge, command_create, command_finish, run_transition
from forgeboard.runs.states import RunState
from forgeboard.telemetry.ingest import telemetry_ingest
from tests.platform.test_step_timelines import timeline
from workers.engine.telemetry_wire import TelemetryBatch

ALL_DATABASES = list(settings.DATABASES)
pytestmark = [pytest.mark.django_db(transaction=True, databases=ALL_DATABASES), pytest.mark.asyncio]
HEADERS = [(b"origin", b"http://127.0.0.1")]


def _batch(seq: int) -> TelemetryBatch:
    return TelemetryBatch.model_validate({
        "seq": seq,
        "metrics": [{"key": "loss", "step": seq, "value": 1.0 / seq, "time": 1.7e9}],
        "events": [{"kind": "message", "payload": {"batch": seq}, "time": 1.7e9}],
    })


async def _ingest(run, *seqs: int) -> None:
    await sync_to_async(telemetry_ingest)(run=run, batches=[_batch(s) for s in seqs])


async def _connect(path: str) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(application, path, headers=HEADERS)
    connected, code = await communicator.connect(timeout=10)
    assert connected, code
    return communicator


async def _receive_until(communicator: WebsocketCommunicator, predicate, timeout: float = 10.0) -> list[dict]:
    seen = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not any(predicate(m) for m in seen):
        remaining = deadline - loop.time()
        assert remaining > 0, f"timed out; got {seen}"
        seen.append(json.loads(await communicator.receive_from(timeout=remaining)))
    return seen


async def _token(team) -> str:
    return await _token_named(team, "ws")


async def _token_named(team, name: str) -> str:
    _, raw = await sync_to_async(api_token_create)(actor=team.member, project=team.project, name=name, scope="read")
    return raw


async def test_backlog_then_live_then_resume(running_run, team):
    run, _ = running_run
    token = await _token(team)
    await _ingest(run, 1, 2)
    first = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    backlog = json.loads(await first.receive_from(timeout=10))
    assert backlog["type"] == "run.backlog" and backlog["state"] == "running"
    messages = [e["payload"]["batch"] for e in backlog["events"] if e["kind"] == "message"]
    assert messages == [1, 2]
    assert [p[0] for p in backlog["metrics"]["loss"]] == [1, 2]
    last_seq = backlog["events"][-1]["seq"]

    await _ingest(run, 3)
    live = await _receive_until(first, lambda m: m.get("batch") == 3)
    assert live[-1]["metrics"]["loss"] == [[3, pytest.approx(1 / 3)]]
    last_seq = live[-1]["events"][-1]["seq"]
    await first.disconnect()

    await _ingest(run, 4, 5)  # missed while disconnected
    second = await _connect(f"/ws/runs/{run.pk}/?token={token}&after_seq={last_seq}&after_step=3")
    resumed = json.loads(await second.receive_from(timeout=10))
    assert [e["payload"]["batch"] for e in resumed["events"]] == [4, 5]
    assert [p[0] for p in resumed["metrics"]["loss"]] == [3, 4, 5]  # the cursor's step again: see the next test
    await _ingest(run, 6)
    live = await _receive_until(second, lambda m: m.get("batch") == 6)
    assert [e["payload"]["batch"] for m in live for e in m["events"]] == [6]
    await second.disconnect()


async def test_a_steps_metric_reported_in_a_later_batch_survives_a_reconnect(running_run, team):
    """The engine reports a step's loss, then evaluates and reports that step's eval metrics in a later batch: a page
    that dropped in between and resumes after the step it saw still gets them."""
    run, _ = running_run
    token = await _token(team)
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    await stream.receive_from(timeout=10)
    await _ingest(run, 1, 2, 3)
    live = await _receive_until(stream, lambda m: m.get("batch") == 3)
    assert live[-1]["metrics"] == {"loss": [[3, pytest.approx(1 / 3)]]}
    last_seq = live[-1]["events"][-1]["seq"]
    await stream.disconnect()

    evaluation = TelemetryBatch.model_validate({"seq": 4, "metrics": [
        {"key": "eval/accuracy", "step": 3, "value": 0.5, "time": 1.7e9}]})
    await sync_to_async(telemetry_ingest)(run=run, batches=[evaluation])
    again = await _connect(f"/ws/runs/{run.pk}/?token={token}&after_seq={last_seq}&after_step=3")
    backlog = json.loads(await again.receive_from(timeout=10))
    assert backlog["metrics"]["eval/accuracy"] == [[3, 0.5]]
    await again.disconnect()


def _events_batch(seq: int, count: int) -> TelemetryBatch:
    return TelemetryBatch.model_validate({
        "seq": seq, "events": [{"kind": "message", "payload": {"batch": seq, "i": i}, "time": 1.7e9} for i in range(count)],
    })


async def _frames_through(stream: WebsocketCommunicator, seq: int) -> list[dict]:
    return await _receive_until(stream, lambda m: any(e["seq"] == seq for e in m.get("events", [])))


def _backlog_frames(frames: list[dict]) -> list[dict]:
    return [f for f in frames if f["type"] in ("run.backlog", "run.backlog_page")]


@pytest.mark.parametrize(("page_events", "page_chars"), [(10, 1_000_000), (1_000, 250)])
async def test_a_backlog_longer_than_a_page_comes_whole_in_pages_then_live(running_run, team, monkeypatch,
                                                                          page_events, page_chars):
    """Every event once and in order, whether the engine reports while the backlog is read (before the run is read:
    those come in the backlog and again live) or while it is paged (those come live only)."""
    from forgeboard.telemetry import consumers

    run, _ = running_run
    monkeypatch.setattr(consumers, "BACKLOG_PAGE_EVENTS", page_events)
    monkeypatch.setattr(consumers, "BACKLOG_PAGE_CHARS", page_chars)
    await sync_to_async(telemetry_ingest)(run=run, batches=[_events_batch(1, 25)])
    following, paging = consumers.LiveConsumer.follow_access, consumers.events_page
    pages = []

    async def follow_access_as_the_engine_reports(self, **kwargs):  # joined the run's group, the run not yet read
        await sync_to_async(telemetry_ingest)(run=run, batches=[_events_batch(2, 3)])
        await following(self, **kwargs)

    def events_page_as_the_engine_reports(**kwargs):
        pages.append(kwargs)
        if len(pages) == 1:
            telemetry_ingest(run=run, batches=[_events_batch(3, 3)])
        return paging(**kwargs)

    monkeypatch.setattr(consumers.LiveConsumer, "follow_access", follow_access_as_the_engine_reports)
    monkeypatch.setattr(consumers, "events_page", events_page_as_the_engine_reports)
    token = await _token(team)
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    frames = await _frames_through(stream, 1 + 25 + 3 + 3)
    await _ingest(run, 4)
    frames += await _receive_until(stream, lambda m: m.get("batch") == 4)

    backlog = _backlog_frames(frames)
    assert frames[:len(backlog)] == backlog and len(backlog) > 2
    assert [f["type"] for f in backlog] == ["run.backlog"] + ["run.backlog_page"] * (len(backlog) - 1)
    assert [f["more"] for f in backlog] == [True] * (len(backlog) - 1) + [False]
    assert backlog[-1]["events"][-1]["seq"] == 1 + 25 + 3  # the run as it was read: the last batch comes live
    for frame in backlog:
        assert 0 < len(frame["events"]) <= page_events
        assert sum(len(json.dumps(e)) for e in frame["events"][:-1]) < page_chars
    seqs = [e["seq"] for f in frames for e in f["events"]]
    assert seqs == list(range(1, 1 + 25 + 3 + 3 + 1 + 1))
    await stream.disconnect()


async def test_the_backlog_of_a_run_past_the_old_5000_event_cap_loses_nothing(running_run, team):
    """With the default page size: 5,200 events in frames of at most 1,000, then live ones."""
    run, _ = running_run
    await sync_to_async(telemetry_ingest)(run=run, batches=[_events_batch(seq, 1_000 if seq < 6 else 199)
                                                            for seq in range(1, 7)])
    token = await _token(team)
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    frames = await _frames_through(stream, 5_200)
    await _ingest(run, 7)
    frames += await _receive_until(stream, lambda m: m.get("batch") == 7)
    assert [len(f["events"]) for f in _backlog_frames(frames)] == [1_000] * 5 + [200]
    assert [e["seq"] for f in frames for e in f["events"]] == list(range(1, 5_202))
    await stream.disconnect()


def _telemetry_batch(seq: int, *, message: bool = True) -> TelemetryBatch:
    """A training step's batch: its loss, two log lines, its step timeline and (unless told not to) an event."""
    return TelemetryBatch.model_validate({
        "seq": seq,
        "metrics": [{"key": "loss", "step": seq, "value": 1.0 / seq, "time": 1.7e9}],
        "logs": [{"line": f"batch {seq} line {i}", "time": 1.7e9} for i in range(2)],
        "events": [{"kind": "message", "payload": {"batch": seq}, "time": 1.7e9}] * message
        + [{"kind": "step_timeline", "payload": timeline(seq), "time": 1.7e9}],
    })


async def _ingest_steps(run, *seqs: int, message: bool = True) -> None:
    for seq in seqs:  # a request each, as the engine sends them while it trains: each batch its own update
        await sync_to_async(telemetry_ingest)(run=run, batches=[_telemetry_batch(seq, message=message)])


def _as_the_page_holds(frames: list[dict]) -> tuple[dict[int, float], list[str], list[int], list[int]]:
    """What the run page makes of these frames: the loss by step (charts.js: a repeated step replaces its value), the
    log lines appended, the steps of the timelines (held by step) and the batches of the message events (each event
    once and in order: checked here)."""
    loss, logs, timelines, events = {}, [], set(), []
    for frame in frames:
        loss.update({step: value for step, value in frame.get("metrics", {}).get("loss", [])})
        logs += frame.get("logs", [])
        timelines |= {t["step"] for t in frame.get("timelines", [])}
        events += frame.get("events", [])
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    return loss, logs, sorted(timelines), [e["payload"]["batch"] for e in events if e["kind"] == "message"]


def _lines(*seqs: int) -> list[str]:
    return [f"batch {seq} line {i}" for seq in seqs for i in range(2)]


def _losses(*seqs: int) -> dict[int, float]:
    return {seq: pytest.approx(1.0 / seq) for seq in seqs}


async def _subscribed(run, team) -> tuple[WebsocketCommunicator, list[dict]]:
    """A run stream and the backlog frame it opens with."""
    stream = await _connect(f"/ws/runs/{run.pk}/?token={await _token(team)}")
    return stream, [json.loads(await stream.receive_from(timeout=10))]


async def _ingest_lost(monkeypatch, run, *steps: int) -> None:
    """These steps stored, their updates lost on the way to the channel layer."""
    from forgeboard.telemetry import ingest

    with monkeypatch.context() as patched:
        patched.setattr(ingest, "publish_run_update", lambda **kwargs: None)
        await _ingest_steps(run, *steps)


async def test_updates_the_channel_layer_lost_are_filled_in_once_from_the_database(running_run, team, monkeypatch):
    """A subscriber's full queue drops updates: the next one finds the batches missing before its own (this one has no
    event to tell of theirs) and is preceded by what they held, from the database, so the page has every point, log
    line, timeline and event, once."""
    run, _ = running_run
    stream, frames = await _subscribed(run, team)
    await _ingest_steps(run, 1)
    frames += await _receive_until(stream, lambda m: m.get("batch") == 1)
    await _ingest_lost(monkeypatch, run, 2, 3, 4)
    await _ingest_steps(run, 5, message=False)
    frames += await _receive_until(stream, lambda m: m.get("batch") == 5)

    filled = frames[-3]  # then the events, then batch 5
    assert (filled["type"], filled["telemetry_seq"], filled["logs"]) == ("run.update", 4, _lines(2, 3, 4))
    assert [p[0] for p in filled["metrics"]["loss"]] == [1, 2, 3, 4, 5]  # from the step the page has, as stored
    loss, logs, timelines, messages = _as_the_page_holds(frames)
    assert loss == _losses(1, 2, 3, 4, 5)
    assert logs == _lines(1, 2, 3, 4, 5)
    assert timelines == [1, 2, 3, 4, 5]
    assert messages == [1, 2, 3, 4]
    await _ingest_steps(run, 6)
    after = json.loads(await stream.receive_from(timeout=10))  # the next update as it is
    assert (after["batch"], after["metrics"], after["logs"]) == (6, {"loss": [[6, pytest.approx(1 / 6)]]}, _lines(6))
    assert [e["payload"] for e in after["events"]] == [{"batch": 6}]
    assert [t["step"] for t in after["timelines"]] == [6]
    await stream.disconnect()


async def test_an_update_the_channel_layer_delivered_late_is_filled_in_once_and_dropped_when_it_comes(
        running_run, team, monkeypatch):
    """Two web processes may publish out of order: the later batch's update comes first and is preceded by the
    earlier ones' from the database; when their own updates come at last they add nothing (no line twice)."""
    from forgeboard.telemetry import ingest

    run, _ = running_run
    stream, frames = await _subscribed(run, team)
    held = []
    with monkeypatch.context() as patched:
        patched.setattr(ingest, "publish_run_update", lambda **kwargs: held.append(kwargs))
        await _ingest_steps(run, 1, 2)  # stored, not pushed yet
    await _ingest_steps(run, 3)
    frames += await _receive_until(stream, lambda m: m.get("batch") == 3)
    assert [f.get("telemetry_seq") for f in frames[1:]] == [None, 2, None]  # the events, the telemetry, batch 3
    for late in held:  # the held pushes arrive at last
        await sync_to_async(ingest.publish_run_update)(**late)
    assert await _still_answers(stream)  # nothing came before the pong
    await _ingest_steps(run, 4)
    frames += await _receive_until(stream, lambda m: m.get("batch") == 4)
    loss, logs, timelines, messages = _as_the_page_holds(frames)
    assert (loss, logs, timelines, messages) == (_losses(1, 2, 3, 4), _lines(1, 2, 3, 4), [1, 2, 3, 4], [1, 2, 3, 4])
    await stream.disconnect()


async def test_updates_a_full_channel_drops_are_filled_in_once(running_run, team, monkeypatch, settings):
    """The channel layer itself at capacity 1: the engine reports eight steps while the stream is still busy sending
    its backlog, the layer drops what does not fit (silently, as it does for a slow page) and the next update fills
    them in."""
    from forgeboard.telemetry import consumers

    layers = settings.CHANNEL_LAYERS
    settings.CHANNEL_LAYERS = {"default": {**layers["default"],
                                           "CONFIG": {**layers["default"].get("CONFIG", {}), "capacity": 1}}}
    run, _ = running_run
    paging = consumers.events_page

    def events_page_as_the_engine_reports(**kwargs):  # the backlog was read: the stream receives nothing meanwhile
        if not run.telemetry_seq:
            for seq in range(1, 9):
                telemetry_ingest(run=run, batches=[_telemetry_batch(seq)])
            run.refresh_from_db()
        return paging(**kwargs)

    monkeypatch.setattr(consumers, "events_page", events_page_as_the_engine_reports)
    stream, frames = await _subscribed(run, team)
    assert frames[0]["telemetry_seq"] == 0
    settings.CHANNEL_LAYERS = layers  # room again, whatever the stream has yet to take of what was kept
    await _ingest_steps(run, 9)
    frames += await _receive_until(stream, lambda m: m.get("batch") == 9)
    live = [f["batch"] for f in frames if "batch" in f]
    assert len(live) < 9, f"the layer dropped nothing: {live}"
    loss, logs, timelines, messages = _as_the_page_holds(frames)
    assert loss == _losses(*range(1, 10))
    assert logs == _lines(*range(1, 10))
    assert timelines == list(range(1, 10))
    assert messages == list(range(1, 10))
    await stream.disconnect()


async def test_a_lost_last_batch_comes_with_the_runs_next_event(running_run, team, monkeypatch):
    """An engine that goes quiet after a lost update (its run ends, or pauses): the platform's next event says how far
    the run's telemetry goes, and the stream fills in the rest before it."""
    run, _ = running_run
    stream, frames = await _subscribed(run, team)
    await _ingest_steps(run, 1)
    frames += await _receive_until(stream, lambda m: m.get("batch") == 1)
    await _ingest_lost(monkeypatch, run, 2)
    await sync_to_async(run_transition)(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.PAUSED)
    frames += await _receive_until(stream, lambda m: any(e["kind"] == "state_changed" for e in m["events"]))
    assert frames[-2]["telemetry_seq"] == 2 and frames[-2]["logs"] == _lines(2)
    loss, logs, timelines, messages = _as_the_page_holds(frames)
    assert (loss, logs, timelines, messages) == (_losses(1, 2), _lines(1, 2), [1, 2], [1, 2])
    await stream.disconnect()


async def test_a_platform_events_push_reads_nothing_to_say_how_far_the_telemetry_goes(running_run, team, monkeypatch):
    """event_append reads the run's last telemetry batch with the event's sequence (one query, under the row lock an
    ingest takes too): pushing its update reads nothing more, and a stream that lost the last batch still fills it in."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from forgeboard.telemetry import services

    run, _ = running_run
    stream, frames = await _subscribed(run, team)
    await _ingest_steps(run, 1)
    frames += await _receive_until(stream, lambda m: m.get("batch") == 1)
    await _ingest_lost(monkeypatch, run, 2)
    pushing, queries = services.publish_run_update, []

    def publish_counting_queries(**kwargs):
        with CaptureQueriesContext(connection) as captured:
            pushing(**kwargs)
        queries.extend(query["sql"] for query in captured.captured_queries)

    monkeypatch.setattr(services, "publish_run_update", publish_counting_queries)
    await sync_to_async(services.event_append)(run=run, kind="message", payload={"text": "from the platform"})
    frames += await _receive_until(stream, lambda m: any(e["payload"] == {"text": "from the platform"}
                                                         for e in m["events"]))
    assert queries == []
    assert (frames[-2]["telemetry_seq"], frames[-2]["logs"]) == (2, _lines(2))
    assert [line for frame in frames for line in frame["logs"]] == _lines(1, 2)
    await stream.disconnect()


async def test_a_reconnect_gets_the_log_lines_after_the_last_batch_it_saw_only(running_run, team):
    run, _ = running_run
    token = await _token(team)
    await _ingest_steps(run, 1, 2)
    first = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    backlog = json.loads(await first.receive_from(timeout=10))
    assert (backlog["logs"], backlog["telemetry_seq"]) == (_lines(1, 2), 2)
    await first.disconnect()

    await _ingest_steps(run, 3, 4)  # missed while disconnected
    again = await _connect(f"/ws/runs/{run.pk}/?token={token}&after_seq=2&after_step=2&after_batch=2")
    backlog = json.loads(await again.receive_from(timeout=10))
    assert (backlog["logs"], backlog["telemetry_seq"]) == (_lines(3, 4), 4)
    assert [p[0] for p in backlog["metrics"]["loss"]] == [2, 3, 4]
    await _ingest_steps(run, 5)
    live = await _receive_until(again, lambda m: m.get("batch") == 5)
    assert [line for m in live for line in m["logs"]] == _lines(5)
    await again.disconnect()


def _log_batch(seq: int, count: int, width: int) -> TelemetryBatch:
    """A batch of `count` log lines of `width` characters (non-ASCII ones, which JSON escapes), and a step's loss."""
    return TelemetryBatch.model_validate({
        "seq": seq, "metrics": [{"key": "loss", "step": seq, "value": 1.0 / seq, "time": 1.7e9}],
        "logs": [{"line": line, "time": 1.7e9} for line in _long_lines(seq, count, width)]})


def _long_lines(seq: int, count: int, width: int) -> list[str]:
    return [f"batch {seq} line {i:04d} ".ljust(width, "é" if i % 2 else "-") for i in range(count)]


def _frames_are_bounded(frames: list[dict]) -> None:
    from forgeboard.telemetry.consumers import LOG_FRAME_CHARS

    sizes = [len(json.dumps(frame.get("logs", []))) for frame in frames]
    assert max(sizes) <= LOG_FRAME_CHARS, f"a frame's log lines take {max(sizes)} characters"


@pytest.mark.parametrize(("count", "width"), [(120, 10), (300, 2_000), (1_200, 1_000), (2_000, 8_192)])
async def test_every_log_line_of_a_long_batch_reaches_the_page_once_and_in_order(running_run, team, count, width):
    """A traceback or an engine that spooled while the platform was away: a batch of many or long lines. Its update
    carries its last lines and the stream sends the ones before from the database, first, so the page gets every line
    it keeps (the last 500) once and in order, in frames of bounded size; the next batch's update comes as it is."""
    run, _ = running_run
    stream, frames = await _subscribed(run, team)
    await sync_to_async(telemetry_ingest)(run=run, batches=[_log_batch(1, count, width)])
    frames += await _receive_until(stream, lambda m: m.get("batch") == 1)
    _, logs, _, _ = _as_the_page_holds(frames)
    assert logs == _long_lines(1, count, width)[-500:]
    _frames_are_bounded(frames)
    if width > 1_000:
        assert frames[-1]["logs_left_out"] > 0 and len(frames) > 2, "the lines came in more than one frame"
    await _ingest_steps(run, 2)
    after = json.loads(await stream.receive_from(timeout=10))
    assert (after["batch"], after["logs"], after["logs_left_out"]) == (2, _lines(2), 0)
    await stream.disconnect()


async def test_long_batches_missed_or_before_a_connect_come_whole_in_bounded_frames(running_run, team, monkeypatch):
    """The batches a stream fills in from the database, and a backlog's log tail, come in frames of bounded size too:
    every line the page keeps, once and in order."""
    from forgeboard.telemetry import consumers, ingest

    run, _ = running_run
    await sync_to_async(telemetry_ingest)(run=run, batches=[_log_batch(1, 300, 2_000)])
    stream = await _connect(f"/ws/runs/{run.pk}/?token={await _token(team)}")
    frames = await _receive_until(stream, lambda m: m["type"] == "run.backlog")
    _, logs, _, _ = _as_the_page_holds(frames)
    assert logs == _long_lines(1, 300, 2_000)[-consumers.BACKLOG_LOG_LINES:]
    assert len(frames) > 1 and frames[-1]["telemetry_seq"] == 1
    _frames_are_bounded(frames)

    with monkeypatch.context() as patched:
        patched.setattr(ingest, "publish_run_update", lambda **kwargs: None)  # lost on the way
        await sync_to_async(telemetry_ingest)(run=run, batches=[_log_batch(2, 200, 2_000), _log_batch(3, 200, 3_000)])
    await _ingest_steps(run, 4)
    filled = await _receive_until(stream, lambda m: m.get("batch") == 4)
    _, logs, _, _ = _as_the_page_holds(frames + filled)
    missed = [*_long_lines(2, 200, 2_000), *_long_lines(3, 200, 3_000)][-consumers.MISSED_LOG_LINES:]
    assert logs == _long_lines(1, 300, 2_000)[-consumers.BACKLOG_LOG_LINES:] + missed + _lines(4)
    assert [f.get("telemetry_seq") for f in filled].count(3) == 1 and len(filled) > 3
    _frames_are_bounded(filled)
    await stream.disconnect()


# --- a reconnect resumes after the last log line the page has --------------------------------------------------------

def _reconnect_query(frames: list[dict]) -> str:
    """The cursors run_page.js reconnects with after these frames: the last event and metric step it has, and where its
    log tail ends: the whole of a batch (a backlog's or a filled-in gap's `telemetry_seq`, a live update's `batch`) or a
    line of one (a frame of log lines alone says where its last one is: `logs_through`)."""
    seq = max((e["seq"] for f in frames for e in f.get("events", [])), default=0)
    step = max((points[-1][0] for f in frames for points in f.get("metrics", {}).values() if points), default=0)
    end = (0, math.inf)
    for frame in frames:
        end = max(end, (max(frame.get("telemetry_seq") or 0, frame.get("batch") or 0), math.inf))
        if through := frame.get("logs_through"):
            end = max(end, (through["batch"], through["line"]))
    query = f"after_seq={seq}&after_step={step}&after_batch={end[0]}"
    return query if end[1] == math.inf else f"{query}&after_line={end[1]}"


async def _dropped_and_resumed(run, token: str, frames: list[dict], *, kept: int) -> list[dict]:
    """What a page has when its connection drops after the first `kept` of these frames (the others were on the way and
    are lost with it) and it reconnects from there: those frames, then the new stream's backlog."""
    page = frames[:kept]
    again = await _connect(f"/ws/runs/{run.pk}/?token={token}&{_reconnect_query(page)}")
    page += await _receive_until(again, lambda m: m["type"] == "run.backlog")
    await again.disconnect()
    return page


def _once_each(logs: list[str]) -> list[str]:
    twice = sorted({line[:20] for line in logs if logs.count(line) > 1})
    assert not twice, f"{len(logs) - len(set(logs))} log lines twice, the first of them: {twice[:3]}"
    return logs


def _lines_alone(frames: list[dict]) -> list[int]:
    """Where these frames have log lines in frames of their own (before a long batch's update, a backlog or a gap)."""
    return [i for i, f in enumerate(frames) if f["logs"] and "batch" not in f and "telemetry_seq" not in f]


@pytest.mark.parametrize(("count", "width"), [(300, 2_000), (1_200, 1_000)])
@pytest.mark.parametrize("drop", ["after_its_first_lines", "before_its_update"])
async def test_a_reconnect_amid_a_long_batchs_lines_resumes_after_the_last_line_the_page_has(
        running_run, team, count, width, drop):
    """A long batch's update leaves its first lines out, which the stream sends first, from the database: a page whose
    connection drops after some of those (its update lost with it) reconnects from the last line it has and gets every
    other line it keeps once, none twice (it reconnected from the batch before: those lines came again)."""
    run, _ = running_run
    token = await _token(team)
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    frames = [json.loads(await stream.receive_from(timeout=10))]
    await sync_to_async(telemetry_ingest)(run=run, batches=[_log_batch(1, count, width)])
    frames += await _receive_until(stream, lambda m: m.get("batch") == 1)
    await stream.disconnect()
    alone = _lines_alone(frames)
    assert frames[-1]["logs_left_out"] > 0 and len(alone) > 1, "the batch's first lines came in frames of their own"
    kept = alone[0] + 1 if drop == "after_its_first_lines" else len(frames) - 1

    page = await _dropped_and_resumed(run, token, frames, kept=kept)
    _, logs, _, _ = _as_the_page_holds(page)
    assert _once_each(logs) == _long_lines(1, count, width)[-500:]
    _frames_are_bounded(page)


async def test_a_reconnect_amid_a_backlogs_lines_resumes_after_the_last_line_the_page_has(running_run, team):
    """A backlog's log tail longer than a frame comes in frames of lines before it: a page that drops after the first
    reconnects from its last line and gets the rest of the tail, once."""
    from forgeboard.telemetry import consumers

    run, _ = running_run
    token = await _token(team)
    await sync_to_async(telemetry_ingest)(run=run, batches=[_log_batch(1, 300, 2_000)])
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    frames = await _receive_until(stream, lambda m: m["type"] == "run.backlog")
    await stream.disconnect()
    assert len(_lines_alone(frames)) > 1

    page = await _dropped_and_resumed(run, token, frames, kept=1)
    _, logs, _, _ = _as_the_page_holds(page)
    assert _once_each(logs) == _long_lines(1, 300, 2_000)[-consumers.BACKLOG_LOG_LINES:]
    _frames_are_bounded(page)


async def test_a_reconnect_amid_a_filled_in_gaps_lines_resumes_after_the_last_line_the_page_has(
        running_run, team, monkeypatch):
    """The batches an update found missing come from the database, their lines first in frames of their own: a page
    that drops after the first of those reconnects from its last line and gets every line it keeps, once."""
    run, _ = running_run
    token = await _token(team)
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    frames = [json.loads(await stream.receive_from(timeout=10))]
    from forgeboard.telemetry import ingest

    with monkeypatch.context() as patched:
        patched.setattr(ingest, "publish_run_update", lambda **kwargs: None)  # lost on the way
        await sync_to_async(telemetry_ingest)(run=run, batches=[_log_batch(1, 200, 2_000), _log_batch(2, 200, 3_000)])
    await _ingest_steps(run, 3)
    frames += await _receive_until(stream, lambda m: m.get("batch") == 3)
    await stream.disconnect()
    alone = _lines_alone(frames)
    assert len(alone) > 1

    page = await _dropped_and_resumed(run, token, frames, kept=alone[0] + 1)
    _, logs, _, _ = _as_the_page_holds(page)
    assert _once_each(logs) == [*_long_lines(1, 200, 2_000), *_long_lines(2, 200, 3_000), *_lines(3)]
    _frames_are_bounded(page)


async def test_a_page_that_has_every_line_resumes_with_none(running_run, team):
    """A position at a batch's last line, or past the run's last batch (a page of another run's, say), brings no line;
    the stream goes on with the next batch's."""
    run, _ = running_run
    token = await _token(team)
    await _ingest_steps(run, 1, 2)
    for query in ("after_batch=2&after_line=1", "after_batch=2", "after_batch=7&after_line=0",
                  f"after_batch={2**63 - 1}&after_line={2**63 - 1}"):
        stream = await _connect(f"/ws/runs/{run.pk}/?token={token}&{query}")
        backlog = json.loads(await stream.receive_from(timeout=10))
        assert (backlog["logs"], backlog["telemetry_seq"]) == ([], 2), query
        await stream.disconnect()
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}&after_batch=1&after_line={2**63 - 1}")
    assert json.loads(await stream.receive_from(timeout=10))["logs"] == _lines(2)  # past batch 1's last line
    await stream.disconnect()
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}&after_batch=1&after_line=0")
    backlog = json.loads(await stream.receive_from(timeout=10))
    assert backlog["logs"] == ["batch 1 line 1", *_lines(2)]
    await _ingest_steps(run, 3)
    live = await _receive_until(stream, lambda m: m.get("batch") == 3)
    assert [line for m in live for line in m["logs"]] == _lines(3)
    await stream.disconnect()


HOSTILE_POSITIONS = [  # what a client can send as the position it resumes from
    "after_line=-1", "after_batch=-1&after_line=0", f"after_line={2**63}", "after_line=" + "9" * 4_000,
    "after_line=x", "after_line=1.5", "after_line=1e3", "after_line=%2B1", "after_line=%201", "after_line=1_0",
    "after_line=%EF%BC%91", "after_line=%D9%A1", "after_line=%00", "after_line=1%00", "after_batch=%00&after_line=1",
    "after_line=%7B%22batch%22%3A1%7D", "after_line=%5B1%2C2%5D", "after_line=null", "after_line=true",
]
IGNORED_POSITIONS = ["after_line%5Bbatch%5D=1", "after_line.batch=1", "after_line=", "after_lines=-1"]


async def test_a_hostile_resume_position_is_refused_and_other_streams_go_on(running_run, team):
    """A negative, huge, fractional, non-ASCII-digit, NUL or JSON position, or bytes that are not UTF-8: each refused
    (4400) before the stream opens; a parameter the stream does not know is ignored. Neither touches a stream beside."""
    run, _ = running_run
    token = await _token(team)
    await _ingest_steps(run, 1)
    bystander = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    await bystander.receive_from(timeout=10)
    for query in HOSTILE_POSITIONS:
        refused = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/?token={token}&{query}", headers=HEADERS)
        connected, code = await refused.connect(timeout=10)  # an exception in the consumer would raise here
        await refused.disconnect()
        assert (connected, code) == (False, 4400), query
    raw = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/", headers=HEADERS)
    raw.scope["query_string"] = f"token={token}&after_batch=1&after_line=".encode() + b"\xff\xfe"
    connected, code = await raw.connect(timeout=10)
    await raw.disconnect()
    assert (connected, code) == (False, 4400)
    for query in IGNORED_POSITIONS:
        ignored = await _connect(f"/ws/runs/{run.pk}/?token={token}&{query}")
        backlog = json.loads(await ignored.receive_from(timeout=10))
        assert backlog["logs"] == _lines(1), query
        await ignored.disconnect()
    for frame in ({"type": "resume", "after_line": -1}, {"type": "resume", "after_line": {"$gt": 0}},
                  {"type": "ping", "after_line": "\x00" * 100}):
        await bystander.send_json_to(frame)  # a position in a frame is no message of the stream's: ignored
    await _ingest_steps(run, 2)
    live = await _receive_until(bystander, lambda m: m.get("batch") == 2)
    assert [line for m in live for line in m.get("logs", [])] == _lines(2)
    assert await _still_answers(bystander)
    await bystander.disconnect()


async def test_a_commands_life_reaches_the_run_stream(running_run, team):
    """Issued (who sent what), acknowledged and finished by the engine: what the run page's commands table shows."""
    run, _ = running_run
    stream = await _connect(f"/ws/runs/{run.pk}/?token={await _token(team)}")
    await stream.receive_from(timeout=10)

    def command_event(kind):
        return lambda m: any(e["kind"] == kind for e in m["events"])

    command = await sync_to_async(command_create)(actor=team.owner, run=run, kind="checkpoint",
                                                  payload={"note": "<b>now</b>"})
    issued = (await _receive_until(stream, command_event("command_issued")))[-1]["events"][-1]
    assert issued["payload"] == {"command": command.pk, "kind": "checkpoint", "by": "olivia",
                                 "payload": {"note": "<b>now</b>"}}
    await sync_to_async(command_acknowledge)(run=run, command_id=command.pk)
    acknowledged = (await _receive_until(stream, command_event("command_acknowledged")))[-1]["events"][-1]
    assert acknowledged["payload"] == {"command": command.pk}
    await sync_to_async(command_finish)(run=run, command_id=command.pk, ok=False, result={"error": "<i>disk full</i>"})
    finished = (await _receive_until(stream, command_event("command_finished")))[-1]["events"][-1]
    assert finished["payload"] == {"command": command.pk, "kind": "checkpoint", "ok": False,
                                   "result": {"error": "<i>disk full</i>"}}
    await stream.disconnect()


async def test_live_updates_skip_the_shared_sync_thread(running_run, team, monkeypatch):
    """Channels would close stale DB connections (a hop to the one sync thread) before each update."""
    run, _ = running_run
    token = await _token(team)
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    await stream.receive_from(timeout=10)
    hops = []

    async def counted() -> None:
        hops.append(1)

    monkeypatch.setattr("channels.consumer.aclose_old_connections", counted)
    await _ingest(run, 1)
    await _receive_until(stream, lambda m: m.get("batch") == 1)
    await stream.send_json_to({"type": "ping"})
    assert json.loads(await stream.receive_from(timeout=10)) == {"type": "pong"}
    assert hops == [1]  # the ping went through channels' dispatch; the update did not
    await stream.disconnect()


async def test_the_project_stream_answers_a_ping_and_goes_on(running_run, team):
    run, _ = running_run
    token = await _token(team)
    stream = await _connect(f"/ws/projects/{team.project.slug}/?token={token}")
    await stream.send_json_to({"type": "ping"})
    assert json.loads(await stream.receive_from(timeout=10)) == {"type": "pong"}
    await sync_to_async(run_transition)(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.PAUSED)
    assert json.loads(await stream.receive_from(timeout=10)) == {"type": "run.state", "run": run.pk, "state": "paused"}
    await stream.disconnect()


async def test_state_changes_reach_run_and_project_subscribers(running_run, team):
    run, _ = running_run
    token = await _token(team)
    run_stream = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    await run_stream.receive_from(timeout=10)
    project_stream = await _connect(f"/ws/projects/{team.project.slug}/?token={token}")
    await sync_to_async(run_transition)(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.PAUSED)
    update = await _receive_until(run_stream, lambda m: any(e["kind"] == "state_changed" for e in m["events"]))
    assert update[-1]["events"][-1]["payload"] == {"from": "running", "to": "paused"}
    project = json.loads(await project_stream.receive_from(timeout=10))
    assert project == {"type": "run.state", "run": run.pk, "state": "paused"}
    await run_stream.disconnect()
    await project_stream.disconnect()


async def test_an_ending_run_tells_its_subscribers_why_live_and_in_a_later_backlog(running_run, team):
    """The run page hides its live-only actions and shows the exit reason from these, without a reload."""
    run, _ = running_run
    token = await _token(team)
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    backlog = json.loads(await stream.receive_from(timeout=10))
    assert (backlog["state"], backlog["exit_reason"]) == ("running", "")
    await sync_to_async(run_transition)(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.FAILED,
                                        reason="engine exited with code 1")
    update = await _receive_until(stream, lambda m: any(e["kind"] == "state_changed" for e in m["events"]))
    assert update[-1]["events"][-1]["payload"] == {"from": "running", "to": "failed",
                                                   "reason": "engine exited with code 1"}
    await stream.disconnect()

    last_seq = update[-1]["events"][-1]["seq"]  # a page that reconnects after the end has every event already
    again = await _connect(f"/ws/runs/{run.pk}/?token={token}&after_seq={last_seq}&after_step=0")
    backlog = json.loads(await again.receive_from(timeout=10))
    assert (backlog["state"], backlog["exit_reason"], backlog["events"]) == ("failed", "engine exited with code 1", [])
    await again.disconnect()


@pytest.mark.parametrize(("query", "code"), [("", 4401), ("?token=fb_nope_nope", 4401), ("?after_seq=x", 4400)])
async def test_refused_connections(running_run, query, code):
    run, _ = running_run
    communicator = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/{query}", headers=HEADERS)
    connected, close_code = await communicator.connect(timeout=10)
    await communicator.disconnect()  # end the consumer here, not in the event loop's teardown
    assert not connected and close_code == code


async def test_outsider_token_cannot_subscribe(running_run, team):
    run, _ = running_run
    from forgeboard.accounts.services import project_create

    other = await sync_to_async(project_create)(actor=team.outsider, slug="beta", name="Beta")
    _, raw = await sync_to_async(api_token_create)(actor=team.outsider, project=other, name="ws", scope="read")
    communicator = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/?token={raw}", headers=HEADERS)
    connected, close_code = await communicator.connect(timeout=10)
    await communicator.disconnect()
    assert not connected and close_code == 4404


@pytest.mark.parametrize("path", [
    "/ws/projects/d%C3%A9mo/", "/ws/projects/%00/", "/ws/runs/1" + "0" * 5000 + "/", "/ws/nope/", "/",
])
async def test_unknown_paths_are_refused(path):
    communicator = WebsocketCommunicator(application, path, headers=HEADERS)
    connected, close_code = await communicator.connect(timeout=10)  # an exception in the app would raise here
    await communicator.disconnect()
    assert not connected and close_code == 4404


@pytest.mark.parametrize("run_id", ["1" + "0" * 30, "1" + "0" * 4000])
async def test_run_id_past_the_database_integer_is_not_found(team, run_id):
    token = await _token(team)
    communicator = WebsocketCommunicator(application, f"/ws/runs/{run_id}/?token={token}", headers=HEADERS)
    connected, close_code = await communicator.connect(timeout=10)
    await communicator.disconnect()
    assert not connected and close_code == 4404


GARBAGE_FRAMES = [  # as uvicorn hands them over; the communicator's send_to refuses an empty text frame
    {"bytes": b"\x00\xff"}, {"text": "not json"}, {"text": ""}, {"text": "[1, 2]"}, {"text": '"ping"'},
    {"text": '{"type": "nope"}'}, {"text": "[" * 2_000}, {"text": json.dumps({"type": "ping", "pad": "x" * 1_000_000})},
]


async def test_garbage_frames_are_ignored_and_the_run_stream_goes_on(running_run, team):
    run, _ = running_run
    token = await _token(team)
    stream = await _connect(f"/ws/runs/{run.pk}/?token={token}")
    await stream.receive_from(timeout=10)
    for frame in GARBAGE_FRAMES:
        await stream.send_input({"type": "websocket.receive", **frame})
    await _ingest(run, 1)
    live = await _receive_until(stream, lambda m: m.get("batch") == 1)  # an exception in the consumer raises here
    assert {"type": "pong"} not in live  # the oversized ping went unanswered
    await stream.send_json_to({"type": "ping"})
    assert json.loads(await stream.receive_from(timeout=10)) == {"type": "pong"}
    await stream.disconnect()


async def test_garbage_frames_are_ignored_and_the_project_stream_goes_on(running_run, team):
    run, _ = running_run
    token = await _token(team)
    stream = await _connect(f"/ws/projects/{team.project.slug}/?token={token}")
    for frame in GARBAGE_FRAMES:
        await stream.send_input({"type": "websocket.receive", **frame})
    await sync_to_async(run_transition)(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.PAUSED)
    assert json.loads(await stream.receive_from(timeout=10)) == {"type": "run.state", "run": run.pk, "state": "paused"}
    await stream.disconnect()


# --- a stream is open only while its credential may read the project ------------------------------------------------

async def _closed_with(stream: WebsocketCommunicator, *, timeout: float = 10.0) -> int:
    """The close code the server ends the stream with, skipping what it sent before."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        output = await stream.receive_output(timeout=max(deadline - loop.time(), 0.01))
        if output["type"] == "websocket.close":
            return output["code"]


async def _still_answers(stream: WebsocketCommunicator) -> bool:
    await stream.send_json_to({"type": "ping"})
    while (message := json.loads(await stream.receive_from(timeout=10)))["type"] != "pong":
        pass
    return message == {"type": "pong"}


def _logged_in(user):
    from django.test import Client

    client = Client()
    client.force_login(user)
    return client


async def _connect_as(user, path: str, *, browser=None) -> WebsocketCommunicator:
    browser = browser or await sync_to_async(_logged_in)(user)
    cookie = f"{settings.SESSION_COOKIE_NAME}={browser.cookies[settings.SESSION_COOKIE_NAME].value}".encode()
    communicator = WebsocketCommunicator(application, path, headers=[*HEADERS, (b"cookie", cookie)])
    connected, code = await communicator.connect(timeout=10)
    assert connected, code
    return communicator


async def test_a_revoked_tokens_streams_close_at_once_and_others_go_on(running_run, team):
    from forgeboard.accounts.models import ApiToken
    from forgeboard.accounts.services import api_token_revoke

    run, _ = running_run
    revoked, kept = await _token(team), await _token_named(team, "kept")
    run_stream = await _connect(f"/ws/runs/{run.pk}/?token={revoked}")
    project_stream = await _connect(f"/ws/projects/{team.project.slug}/?token={revoked}")
    other = await _connect(f"/ws/projects/{team.project.slug}/?token={kept}")
    token = await sync_to_async(ApiToken.objects.get)(name="ws")
    await sync_to_async(api_token_revoke)(actor=team.member, token=token)
    assert await _closed_with(run_stream) == 4403
    assert await _closed_with(project_stream) == 4403
    assert await _still_answers(other)
    await other.disconnect()


async def test_a_removed_members_streams_close_at_once(running_run, team):
    from forgeboard.accounts.services import membership_remove

    run, _ = running_run
    member = await _connect_as(team.member, f"/ws/runs/{run.pk}/")
    owner = await _connect_as(team.owner, f"/ws/runs/{run.pk}/")
    await sync_to_async(membership_remove)(actor=team.owner, project=team.project, user=team.member)
    assert await _closed_with(member) == 4403
    assert await _still_answers(owner)
    await owner.disconnect()


async def test_a_deactivated_user_an_expired_token_or_a_logout_is_closed_at_the_next_check(running_run, team, settings):
    from django.utils import timezone

    from forgeboard.accounts.models import ApiToken, User
    from forgeboard.accounts.services import membership_set

    settings.STREAM_ACCESS_RECHECK_S = 1
    run, _ = running_run
    expiring = await _token(team)
    user_stream = await _connect_as(team.viewer, f"/ws/runs/{run.pk}/")
    token_stream = await _connect(f"/ws/projects/{team.project.slug}/?token={expiring}")
    browser = await sync_to_async(_logged_in)(team.member)
    logged_out = await _connect_as(team.member, f"/ws/runs/{run.pk}/", browser=browser)
    maya = await sync_to_async(User.objects.create_user)("maya", password="pw-maya-1")
    await sync_to_async(membership_set)(actor=team.owner, project=team.project, user=maya, role="member")
    _, mayas = await sync_to_async(api_token_create)(actor=maya, project=team.project, name="maya-ci", scope="read")
    creator_gone = await _connect(f"/ws/runs/{run.pk}/?token={mayas}")
    owner = await _connect_as(team.owner, f"/ws/projects/{team.project.slug}/")
    # As the admin's forms do: a plain save, nothing told.
    await sync_to_async(User.objects.filter(pk__in=[team.viewer.pk, maya.pk]).update)(is_active=False)
    await sync_to_async(ApiToken.objects.filter(name="ws").update)(expires_at=timezone.now())
    await sync_to_async(browser.logout)()
    assert await _closed_with(user_stream, timeout=5) == 4403
    assert await _closed_with(token_stream, timeout=5) == 4403
    assert await _closed_with(logged_out, timeout=5) == 4403
    assert await _closed_with(creator_gone, timeout=5) == 4403  # a token acts no further than its creator
    await asyncio.sleep(1.5)  # a check came and went: the owner's stream is open
    assert await _still_answers(owner)
    await owner.disconnect()
