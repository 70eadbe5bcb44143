"""The run page in Chromium, on a real run: chart points arrive over the websocket; zoom and hidden series
survive new data and a reconnect; operator controls are confirmed, sent, and show up in the timeline; a run that
ends while its page is open loses its live-only controls and shows how and why it ended, without a reload."""

from __future__ import annotations

import itertools
import json
import re
from datetime import timedelta

import httpx
import pytest
from django.db import transaction
from django.utils import timezone
from playwright.sync_api import expect

from forgeboard.accounts.services import api_token_create, membership_remove
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Command, Run
from forgeboard.runs.services import (
    command_acknowledge,
    command_create,
    command_finish,
    run_cancel,
    run_launch,
    run_transition,
)
from forgeboard.runs.states import RunState
from forgeboard.runs.tokens import run_token_issue
from forgeboard.telemetry.ingest import telemetry_ingest
from tests.e2e.conftest import login, outside_the_browser_loop, screenshot
from tests.platform.conftest import TINY_MONARCH_GRPO_YAML
from tests.support.configs import sft_yaml
from tests.support.processes import wait_for
from workers.engine.command_channel import CommandChannel
from workers.engine.control_plane import ControlPlaneTarget
from workers.engine.telemetry_wire import TelemetryBatch

POINTS = "Number(document.querySelector('figure.chart[data-key=\"loss\"]')?.dataset.points || 0)"


def _launch(team, tiny_model, steps: int):
    experiment = experiment_create(actor=team.owner, project=team.project, name="warmup", recipe="sft")
    return run_launch(actor=team.member, experiment=experiment, config_yaml=sft_yaml(tiny_model, steps=steps))


def test_live_charts_keep_zoom_and_hidden_series_across_updates_and_reconnects(page, server, team, tiny_model):
    # a tiny SFT run trains ~90 steps/s on a quiet machine: long enough to outlast the test, cancelled after it
    run = _launch(team, tiny_model, steps=1_000_000)
    try:
        _watch_zoom_and_reconnect(page, server, run)
    finally:
        run_cancel(actor=team.member, run=run)
        wait_for(lambda: run.__class__.objects.get(pk=run.pk).state == "cancelled", timeout=60, what="cancelled")


def _watch_zoom_and_reconnect(page, server, run) -> None:
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function(f"{POINTS} >= 3", timeout=90_000)
    first = page.evaluate(POINTS)
    page.wait_for_function(f"{POINTS} > {first}", timeout=30_000)  # more arrive while we watch
    assert page.locator("#conn").inner_text() == "live"
    # checkpoint_saved events refresh the checkpoints table, with a way to start a new run from each
    page.wait_for_selector("#checkpoints button:has-text('Start a new run from here')", timeout=60_000)

    chart = page.locator('figure.chart[data-key="loss"] .u-over')
    chart.scroll_into_view_if_needed()  # the mouse only reaches what the window shows
    box = chart.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] / 2, steps=5)
    page.mouse.up()
    zoom = "(() => { const c = FBRunPage.grid.charts.get('loss').plot.scales.x; return [c.min, c.max]; })()"
    zoomed = page.evaluate(zoom)
    assert page.locator('figure.chart[data-key="loss"]').get_attribute("data-zoomed") == "true"
    page.locator('figure.chart[data-key="loss"] .u-legend .u-series').nth(1).click()  # hide the series
    hidden = "FBRunPage.grid.charts.get('loss').plot.series[1].show"
    assert page.evaluate(hidden) is False

    seq_before = page.evaluate("FBRunPage.cursors().lastSeq")
    page.evaluate("FBRunPage.reconnect()")
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    now = page.evaluate(POINTS)
    page.wait_for_function(f"{POINTS} > {now}", timeout=30_000)
    assert page.evaluate(zoom) == zoomed, "new points after a reconnect must not reset the zoom"
    assert page.evaluate(hidden) is False, "a hidden series stays hidden"
    seqs = page.eval_on_selector_all("#timeline li", "items => items.map(li => Number(li.dataset.seq))")
    assert len(seqs) == len(set(seqs)), "no event is shown twice after a reconnect"
    assert page.evaluate("FBRunPage.cursors().lastSeq") >= seq_before
    screenshot(page, "run_page_live")


def test_pause_and_resume_from_the_controls(page, server, team, tiny_model):
    run = _launch(team, tiny_model, steps=2000)
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("document.getElementById('run-state').dataset.state === 'running'", timeout=90_000)

    page.once("dialog", lambda dialog: dialog.dismiss())  # declined: nothing is sent
    page.locator('form[data-command="run"] button').click()
    assert not Command.objects.filter(run=run, kind="pause").exists()

    page.once("dialog", lambda dialog: dialog.accept())
    page.locator('form[data-command="run"] select[name="kind"]').select_option("pause")
    page.locator('form[data-command="run"] button').click()
    page.wait_for_function("document.getElementById('run-state').dataset.state === 'paused'", timeout=60_000)
    assert page.locator('#timeline li[data-kind="command_issued"]').count() >= 1

    page.once("dialog", lambda dialog: dialog.accept())
    page.locator('form[data-command="run"] select[name="kind"]').select_option("resume")
    page.locator('form[data-command="run"] button').click()
    page.wait_for_function("document.getElementById('run-state').dataset.state === 'running'", timeout=60_000)
    screenshot(page, "run_page_controls")

    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel run").click()
    wait_for(lambda: run.__class__.objects.get(pk=run.pk).state == "cancelled", timeout=60, what="cancelled")


def test_viewer_sees_the_run_but_no_controls(page, server, team, tiny_model):
    run = _launch(team, tiny_model, steps=5)
    login(page, server, "vera")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    assert page.locator("#controls").count() == 0
    assert page.locator("#checkpoints button").count() == 0
    assert page.get_by_role("button", name="Cancel run").count() == 0
    assert page.locator("#config").inner_text().startswith("recipe: sft")


def test_a_member_removed_while_watching_sees_the_stream_end(page, server, team, tiny_model):
    """The live stream closes the moment its watcher leaves the project; the page says so and stops reconnecting."""
    run = _launch(team, tiny_model, steps=3)
    login(page, server, "vera")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    outside_the_browser_loop(membership_remove, actor=team.owner, project=team.project, user=team.viewer)
    page.wait_for_function("document.getElementById('conn').textContent === 'no longer allowed to follow this run'",
                           timeout=10_000)
    assert "conn-closed" in page.locator("#conn").get_attribute("class")
    page.wait_for_timeout(1500)  # past the first reconnect's delay: none was tried
    assert page.locator("#conn").inner_text() == "no longer allowed to follow this run"
    screenshot(page, "run_page_access_withdrawn")



def _seeded_run(team, state: RunState = RunState.RUNNING) -> Run:
    """A multi-process run (every operator control) that the worker skips: not queued once the launch commits,
    started 90 s ago."""
    def launch() -> Run:
        with transaction.atomic():
            run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_MONARCH_GRPO_YAML)
            Run.objects.filter(pk=run.pk).update(state=state, started_at=timezone.now() - timedelta(seconds=90))
        return run
    return outside_the_browser_loop(launch)


def _open(page, server, run, *, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 900})
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)


def _open_live(page, server, run, *, width: int) -> None:
    _open(page, server, run, width=width)
    expect(page.locator("#run-state")).to_have_text("Running")
    expect(page.get_by_role("button", name="Cancel run")).to_be_visible()
    expect(page.get_by_role("heading", name="Operator controls")).to_be_visible()
    expect(page.get_by_role("button", name="Inject")).to_be_visible()
    expect(page.get_by_role("note").filter(has_text="Exit reason")).to_have_count(0)


def _fits(page, width: int) -> None:
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"the run page scrolls sideways by {overflow}px at {width}px"


@pytest.mark.parametrize("width", [1280, 390])
def test_a_run_that_fails_while_its_page_is_open_shows_it_without_a_reload(page, server, team, width):
    run = _seeded_run(team)
    _open_live(page, server, run, width=width)
    screenshot(page, f"run_page_before_end_{width}")

    # what the local supervisor does when the engine exits with an error (its reason: the code and the log's tail)
    reason = "engine exited with code 1\nTraceback (most recent call last):\nRuntimeError: out of memory on rank 0"
    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.FAILED,
                             reason=reason)

    expect(page.locator("#run-state")).to_have_text("Failed")
    expect(page.get_by_role("button", name="Cancel run")).to_be_hidden()
    expect(page.get_by_role("heading", name="Operator controls")).to_be_hidden()
    for button in ("Inject", "Apply", "Redirect", "Send"):
        expect(page.get_by_role("button", name=button, exact=True)).to_be_hidden()
    card = page.get_by_role("note").filter(has_text="Exit reason")
    expect(card).to_be_visible()
    expect(card).to_contain_text("engine exited with code 1")
    expect(card).to_contain_text("RuntimeError: out of memory on rank 0")
    duration = page.locator("#run-duration").inner_text()
    assert duration.startswith("1m 3"), duration
    page.wait_for_timeout(1200)
    assert page.locator("#run-duration").inner_text() == duration, "the duration stops at the end"
    _fits(page, width)
    screenshot(page, f"run_page_after_end_{width}")

    page.reload()  # what a fresh page shows is what the live one came to
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    expect(page.locator("#run-state")).to_have_text("Failed")
    expect(page.get_by_role("button", name="Cancel run")).to_have_count(0)
    expect(page.get_by_role("note").filter(has_text="Exit reason")).to_contain_text("RuntimeError: out of memory")


def test_a_run_cancelled_by_someone_else_while_its_page_is_open(page, server, team):
    run = _seeded_run(team)
    _open_live(page, server, run, width=1280)

    outside_the_browser_loop(run_cancel, actor=team.owner, run=run)  # the owner, in another window
    expect(page.locator("#run-state")).to_have_text("Cancelling")
    expect(page.get_by_role("button", name="Cancel run")).to_be_hidden()
    expect(page.get_by_role("button", name="Inject")).to_be_hidden()
    expect(page.locator("#controls-note")).to_contain_text("takes no more commands")
    screenshot(page, "run_page_cancelling")

    # the supervisor, once the engine stopped
    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=RunState.CANCELLING,
                             to_state=RunState.CANCELLED, reason="cancelled by operator")
    expect(page.locator("#run-state")).to_have_text("Cancelled")
    expect(page.get_by_role("heading", name="Operator controls")).to_be_hidden()
    expect(page.get_by_role("note").filter(has_text="Exit reason")).to_contain_text("cancelled by operator")


def test_a_lost_run_restarted_while_its_page_is_open_gets_its_controls_back(page, server, team):
    """The reverse: the actions of a live run come back as the reconciler restarts a lost run (without a reload);
    the reason it keeps reads as its last restart's while it goes on, and as its exit reason once it ends."""
    run = _seeded_run(team, state=RunState.LOST)
    Run.objects.filter(pk=run.pk).update(exit_reason="engine killed by signal 9")
    _open(page, server, run, width=1280)
    expect(page.locator("#run-state")).to_have_text("Lost")
    expect(page.locator("#exit-reason")).to_have_text("Lost: engine killed by signal 9")
    expect(page.get_by_role("button", name="Cancel run")).to_be_hidden()  # the service cannot cancel a lost run
    expect(page.locator("#controls-note")).to_contain_text("restarts from its last checkpoint")
    expect(page.get_by_role("button", name="Inject")).to_be_hidden()

    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=RunState.LOST, to_state=RunState.QUEUED,
                             reason="restart 1 of 2: engine killed by signal 9")
    expect(page.locator("#run-state")).to_have_text("Queued")
    expect(page.get_by_role("button", name="Cancel run")).to_be_visible()
    expect(page.locator("#controls-note")).to_contain_text("once the run is launching")
    reason = page.locator("#exit-reason")
    expect(reason).to_have_text("Last restart: restart 1 of 2: engine killed by signal 9")

    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING)
    expect(page.locator("#run-state")).to_have_text("Launching")
    expect(page.get_by_role("button", name="Inject")).to_be_visible()
    expect(page.locator("#controls-note")).to_be_hidden()
    expect(page.get_by_role("button", name="Cancel run")).to_be_visible()
    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    expect(page.locator("#run-state")).to_have_text("Running")
    expect(reason).to_have_text("Last restart: restart 1 of 2: engine killed by signal 9")
    screenshot(page, "run_page_running_after_restart")
    page.reload()
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    expect(reason).to_have_text("Last restart: restart 1 of 2: engine killed by signal 9")

    # it ends: the reason it ended is its exit reason, live and on a reload
    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.SUCCEEDED,
                             reason="finished")
    expect(page.locator("#run-state")).to_have_text("Succeeded")
    expect(reason).to_have_text("Exit reason: finished")
    page.reload()
    expect(reason).to_have_text("Exit reason: finished")


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def test_commands_appear_and_change_in_the_table_as_they_are_sent_and_run(page, server, team, tmp_path):
    """A command sent from this page's controls and one sent through the API by another member appear at once; as
    the engine (its own client, over HTTP) acknowledges and finishes them, their rows change in place; what anyone
    wrote in a payload or a result is shown as text, and a reload shows the same table."""
    run = _seeded_run(team)
    run_token = outside_the_browser_loop(run_token_issue, run=run)
    _, api_token = outside_the_browser_loop(api_token_create, actor=team.owner, project=team.project, name="ci",
                                            scope="write")
    _open_live(page, server, run, width=1280)
    rows = page.locator("#commands tbody tr")
    expect(rows).to_have_text(["No commands sent."])

    page.once("dialog", lambda dialog: dialog.accept())
    page.locator('form[data-command="run"] select[name="kind"]').select_option("checkpoint")
    page.locator('form[data-command="run"] button').click()
    expect(page.locator("#commands tr[data-command]")).to_have_count(1)
    sent = Command.objects.get(run=run).pk
    mine = page.locator(f'#commands tr[data-command="{sent}"]')
    expect(mine.locator("td")).to_have_text([str(sent), "Checkpoint now", "mateo", "Pending", "{}", ""])

    hostile = '<img src=x onerror="window.pwned=1">'
    answer = httpx.post(f"{server['url']}/api/v1/runs/{run.pk}/commands", json={"kind": "pause",
                        "payload": {"note": hostile}}, headers={"Authorization": f"Bearer {api_token}"})
    assert answer.status_code == 201, answer.text
    theirs = page.locator(f'#commands tr[data-command="{answer.json()["id"]}"]')
    expect(rows).to_have_count(2)
    expect(rows.first).to_have_attribute("data-command", str(answer.json()["id"]))  # the newest on top
    expect(theirs.locator("td")).to_have_text([str(answer.json()["id"]), "Pause", "olivia", "Pending",
                                               _compact({"note": hostile}), ""])

    def engine_runs(kind, payload):  # the engine has acknowledged the command it is running
        row = mine if kind == "checkpoint" else theirs
        expect(row.locator('[data-field="state"]')).to_have_text("Delivered")
        if kind == "pause":
            raise RuntimeError("<b>cannot pause</b> during a weight sync")
        return {"path": "<script>window.pwned=2</script>/step-40"}

    channel = CommandChannel(ControlPlaneTarget(url=server["url"], run_id=run.pk, token=run_token),
                             ledger=tmp_path / "commands.json")
    try:
        assert channel.poll(engine_runs) == 2
    finally:
        channel.close()
    expect(mine.locator('[data-field="state"]')).to_have_text("Succeeded")
    expect(mine.locator('[data-field="result"]')).to_have_text(_compact({"path": "<script>window.pwned=2</script>/step-40"}))
    expect(theirs.locator('[data-field="state"]')).to_have_text("Failed")
    expect(theirs.locator('[data-field="result"]')).to_have_text(
        _compact({"error": "<b>cannot pause</b> during a weight sync"}))
    assert page.locator("#commands img, #commands script, #commands b").count() == 0
    assert page.evaluate("window.pwned") is None
    expect(page.locator("#run-state")).to_have_text("Running")  # the pause failed
    screenshot(page, "run_page_commands_1280")
    table = "rows => rows.map((row) => Array.from(row.cells, (cell) => cell.textContent))"
    live = page.eval_on_selector_all("#commands tbody tr", table)

    page.set_viewport_size({"width": 390, "height": 900})
    page.wait_for_timeout(300)
    _fits(page, 390)
    screenshot(page, "run_page_commands_390")
    page.reload()
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    assert page.eval_on_selector_all("#commands tbody tr", table) == live, "a fresh page shows what the live one did"


def test_open_commands_turn_expired_with_the_reason_when_the_run_ends(page, server, team):
    """A drill the controller took and a checkpoint it never pulled are open when the run fails: their rows say
    Expired and why, at once, and the timeline says it in words; a reload shows the same table."""
    run = _seeded_run(team)
    drill = outside_the_browser_loop(command_create, actor=team.member, run=run, kind="fault_drill",
                                     payload={"kind": "kill", "role": "generator", "replica": 1})
    checkpoint = outside_the_browser_loop(command_create, actor=team.owner, run=run, kind="checkpoint")
    outside_the_browser_loop(command_acknowledge, run=run, command_id=drill.pk)
    _open_live(page, server, run, width=1280)
    drill_row = page.locator(f'#commands tr[data-command="{drill.pk}"]')
    checkpoint_row = page.locator(f'#commands tr[data-command="{checkpoint.pk}"]')
    expect(drill_row.locator('[data-field="state"]')).to_have_text("Delivered")
    expect(checkpoint_row.locator('[data-field="state"]')).to_have_text("Pending")

    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.FAILED,
                             reason="engine exited with code 1")

    expect(page.locator("#run-state")).to_have_text("Failed")
    taken = "the run failed after its controller took this command but before it reported a result (it may have run)"
    untaken = "the run failed before its controller took this command"
    expect(drill_row.locator("td")).to_have_text([
        str(drill.pk), "Fault drill", "mateo", "Expired", _compact({"kind": "kill", "role": "generator", "replica": 1}),
        _compact({"reason": taken})])
    expect(checkpoint_row.locator("td")).to_have_text([str(checkpoint.pk), "Checkpoint now", "olivia", "Expired", "{}",
                                                       _compact({"reason": untaken})])
    expect(page.locator("#timeline li").filter(has_text=f"command {checkpoint.pk} (checkpoint)")).to_contain_text(
        f"command finished command {checkpoint.pk} (checkpoint) expired: {untaken}")
    box = checkpoint_row.locator('[data-field="result"]').bounding_box()
    assert box and box["width"] > 100, box
    page.locator("#commands").scroll_into_view_if_needed()
    screenshot(page, "run_page_commands_expired")
    table = "rows => rows.map((row) => Array.from(row.cells, (cell) => cell.textContent))"
    live = page.eval_on_selector_all("#commands tbody tr", table)
    page.reload()
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    assert page.eval_on_selector_all("#commands tbody tr", table) == live, "a fresh page shows what the live one did"


def test_a_lost_runs_expired_drill_shows_its_controllers_late_report(page, server, team):
    """The run is lost while its controller runs a drill: the row expires; the controller's late report of what it
    did moves it on to Succeeded with its result, live."""
    run = _seeded_run(team)
    drill = outside_the_browser_loop(command_create, actor=team.member, run=run, kind="fault_drill",
                                     payload={"kind": "kill", "role": "generator"})
    outside_the_browser_loop(command_acknowledge, run=run, command_id=drill.pk)
    _open_live(page, server, run, width=1280)
    row = page.locator(f'#commands tr[data-command="{drill.pk}"]')

    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.LOST,
                             reason="no heartbeat for 75 s (timeout 60 s)")
    expect(row.locator('[data-field="state"]')).to_have_text("Expired")
    expect(row.locator('[data-field="result"]')).to_contain_text("a restarted run does not get it again")

    outside_the_browser_loop(command_finish, run=run, command_id=drill.pk, ok=True, result={"killed": "generator 0"})
    expect(row.locator('[data-field="state"]')).to_have_text("Succeeded")
    expect(row.locator('[data-field="result"]')).to_have_text(_compact({"killed": "generator 0"}))
    expect(page.locator("#timeline li").first).to_contain_text(
        f"command {drill.pk} (fault_drill) done (reported after it had expired: the run was lost after its "
        "controller took this command")


def _events_batch(seq: int, count: int) -> TelemetryBatch:
    return TelemetryBatch.model_validate({"seq": seq, "events": [
        {"kind": "message", "payload": {"text": f"batch {seq} event {i}"}, "time": 1.7e9} for i in range(count)]})


def test_a_run_with_more_events_than_a_backlog_page_shows_every_one_and_its_state(page, server, team):
    """The backlog comes in pages of 1,000 events: the page shows all 2,502, once each and in order, then the run's
    state as of the last one, then live events."""
    run = _seeded_run(team)
    outside_the_browser_loop(telemetry_ingest, run=run, batches=[_events_batch(1, 1_000), _events_batch(2, 1_000),
                                                                 _events_batch(3, 500)])
    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.PAUSED)
    _open(page, server, run, width=1280)
    page.wait_for_function("FBRunPage.cursors().lastSeq === 2502", timeout=30_000)
    expect(page.locator("#run-state")).to_have_text("Paused")
    seqs = page.eval_on_selector_all("#timeline li", "items => items.map(li => Number(li.dataset.seq))")
    assert seqs == list(range(2502, 0, -1)), "every event once, the newest on top"

    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=RunState.PAUSED, to_state=RunState.RUNNING)
    expect(page.locator("#run-state")).to_have_text("Running")
    expect(page.locator("#timeline li").first).to_have_attribute("data-seq", "2503")


def _step_batch(seq: int) -> TelemetryBatch:
    return TelemetryBatch.model_validate({
        "seq": seq, "metrics": [{"key": "loss", "step": seq, "value": 1.0 / seq, "time": 1.7e9}],
        "logs": [{"line": f"step {seq}: loss {1.0 / seq:.3f}", "time": 1.7e9}]})


def test_a_batch_of_many_log_lines_shows_every_one_in_order(page, server, team):
    """A traceback reported in one batch: the log box shows all its lines, in order, the last one in view."""
    run = _seeded_run(team)
    _open(page, server, run, width=1280)
    lines = [f"traceback line {i:03d}: File \"train.py\", line {i}" for i in range(120)]
    outside_the_browser_loop(telemetry_ingest, run=run, batches=[TelemetryBatch.model_validate(
        {"seq": 1, "logs": [{"line": line, "time": 1.7e9} for line in lines]})])
    logs = page.locator("#logs")
    expect(logs).to_have_text("\n".join(lines))
    expect(logs).to_be_visible()
    box = logs.bounding_box()
    assert box["width"] > 300 and box["height"] > 100
    assert logs.evaluate("pre => pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4"), "the newest line in view"
    screenshot(page, "run_page_long_log_batch")


LOSS_POINTS = ("() => { const c = FBRunPage.grid.charts.get('loss'); return c ? Array.from(c.plot.data[0]) : []; }")


def test_updates_lost_on_the_way_leave_no_hole_in_the_chart_or_the_log_tail(page, server, team, monkeypatch):
    """The channel layer drops updates for a page that is behind: the next one that arrives brings what they held, so
    the page shows every step's loss and every log line once, then goes on, and reconnects from there."""
    from forgeboard.telemetry import ingest

    run = _seeded_run(team)
    _open(page, server, run, width=1280)
    outside_the_browser_loop(telemetry_ingest, run=run, batches=[_step_batch(1)])
    expect(page.locator("#logs")).to_have_text("step 1: loss 1.000")
    with monkeypatch.context() as patched:
        patched.setattr(ingest, "publish_run_update", lambda **kwargs: None)  # lost on the way
        for seq in (2, 3):
            outside_the_browser_loop(telemetry_ingest, run=run, batches=[_step_batch(seq)])
    page.wait_for_timeout(500)
    assert page.locator("#logs").inner_text() == "step 1: loss 1.000", "the lost updates never came"
    outside_the_browser_loop(telemetry_ingest, run=run, batches=[_step_batch(4)])

    lines = ["step 1: loss 1.000", "step 2: loss 0.500", "step 3: loss 0.333", "step 4: loss 0.250"]
    expect(page.locator("#logs")).to_have_text("\n".join(lines))
    expect(page.locator("#run-step")).to_have_text("4 of 5 · step 5 running")
    page.wait_for_function(f"({LOSS_POINTS})().length === 4", timeout=10_000)
    assert page.evaluate(LOSS_POINTS) == [1, 2, 3, 4]
    assert page.evaluate("FBRunPage.cursors()") == {"lastSeq": 1, "lastStep": 4, "lastBatch": 4,  # 1: queued
                                                    "lastLine": None}
    screenshot(page, "run_page_gap_filled")

    page.evaluate("FBRunPage.reconnect()")  # a reconnect from these cursors doubles nothing
    outside_the_browser_loop(telemetry_ingest, run=run, batches=[_step_batch(5)])
    expect(page.locator("#logs")).to_have_text("\n".join([*lines, "step 5: loss 0.200"]))
    page.wait_for_function(f"({LOSS_POINTS})().length === 5", timeout=10_000)
    expect(page.locator("#run-step")).to_have_text("5 of 5")


def _long_batch_lines() -> list[str]:
    """A run's output in one batch: training lines, a dump of long lines (a tensor printed whole), and more training
    lines. Its update carries the last ones that fit (the dump's end and the lines after it) and leaves out the rest."""
    dump = [f"grad dump rank {rank}: " + " ".join(f"{(rank * 31 + i) % 997 / 997:.4f}" for i in range(1_300))
            for rank in range(35)]
    return ([f"epoch 1 step {step:03d}: loss {2.5 - step / 100:.3f}" for step in range(200)]
            + [line[:8_192] for line in dump]
            + [f"epoch 1 step {step:03d}: loss {2.5 - step / 100:.3f} (after the dump)" for step in range(200, 212)])


def test_a_reconnect_amid_a_long_batchs_lines_shows_each_line_once(page, server, team):
    """The stream sends a long batch's left-out lines from the database, then its update: when the connection drops in
    between (the update lost with it), the page reconnects from the last line it has and shows the rest once."""
    from forgeboard.telemetry.ingest import WIRE_LOG_CHARS

    lines = _long_batch_lines()
    carried = sum(1 for size in itertools.accumulate(len(json.dumps(line)) + 2 for line in reversed(lines))
                  if size <= WIRE_LOG_CHARS)
    assert 0 < len(lines) - carried and carried < 200, "its update leaves some out, and carries less than a backlog"
    connections: list[str] = []

    def drop_the_long_batchs_update(ws) -> None:  # a real websocket to the server, through the browser's routing
        connections.append(ws.url)
        server_side = ws.connect_to_server()
        ws.on_message(server_side.send)

        def from_server(message) -> None:
            if len(connections) == 1 and json.loads(message).get("logs_left_out"):
                ws.close(code=1001, reason="dropped")  # lost on the way, with the update
                server_side.close()
                return
            ws.send(message)
        server_side.on_message(from_server)

    page.route_web_socket(re.compile(r".*/ws/runs/.*"), drop_the_long_batchs_update)
    run = _seeded_run(team)
    _open(page, server, run, width=1280)
    outside_the_browser_loop(telemetry_ingest, run=run, batches=[TelemetryBatch.model_validate(
        {"seq": 1, "logs": [{"line": line, "time": 1.7e9} for line in lines]})])
    page.wait_for_function("FBRunPage.cursors().lastBatch === 1 && document.getElementById('conn').textContent"
                           " === 'live'", timeout=30_000)
    expect(page.locator("#logs")).to_contain_text(lines[-1])
    shown = page.evaluate("document.getElementById('logs').textContent.split('\\n')")
    twice = [line[:40] for line in set(shown) if shown.count(line) > 1]
    assert not twice, f"{len(shown) - len(set(shown))} lines twice, e.g. {twice[:3]}"
    assert shown == lines
    assert len(connections) == 2 and f"after_batch=1&after_line={len(lines) - carried - 1}" in connections[1]
    assert page.evaluate("FBRunPage.cursors()") == {"lastSeq": 1, "lastStep": 0, "lastBatch": 1, "lastLine": None}

    outside_the_browser_loop(telemetry_ingest, run=run, batches=[_step_batch(2)])  # and it goes on, live
    expect(page.locator("#logs")).to_contain_text("step 2: loss 0.500")
    assert page.evaluate("document.getElementById('logs').textContent.split('\\n')") == [*lines, "step 2: loss 0.500"]
    page.locator("#logs").scroll_into_view_if_needed()
    screenshot(page, "run_page_log_tail_after_reconnect")


def test_a_stream_refused_for_its_resume_point_is_not_retried(page, server, team):
    """A stream the server refuses for where the page says it left off (4400: tests/platform/test_streams.py) would be
    refused again: the page says to reload instead of reconnecting forever."""
    connections: list[str] = []

    def live_then_refused(ws) -> None:
        connections.append(ws.url)
        if len(connections) > 1:
            ws.close(code=4400, reason="bad cursor")
            return
        server_side = ws.connect_to_server()
        ws.on_message(server_side.send)
        server_side.on_message(ws.send)

    page.route_web_socket(re.compile(r".*/ws/runs/.*"), live_then_refused)
    _open(page, server, _seeded_run(team), width=1280)
    page.evaluate("FBRunPage.reconnect()")
    expect(page.locator("#conn")).to_have_text("the stream refused where this page left off: reload the page",
                                               timeout=15_000)
    page.wait_for_timeout(2_500)  # a reconnect would come after 1 s
    assert len(connections) == 2


def test_a_restart_by_the_reconciler_counts_on_the_page_without_a_reload(page, server, team):
    from forgeboard.runs.reconcile import runs_reconcile

    run = _seeded_run(team, state=RunState.LOST)
    Run.objects.filter(pk=run.pk).update(max_restarts=2, exit_reason="engine killed by signal 9")
    _open(page, server, run, width=1280)
    restarts = page.locator("div").filter(has=page.locator("dt", has_text="Restarts")).locator("dd")
    expect(restarts).to_have_text("0 of 2")

    outside_the_browser_loop(runs_reconcile, now=timezone.now())
    expect(page.locator("#exit-reason")).to_have_text("Last restart: restart 1 of 2: engine killed by signal 9")
    expect(restarts).to_have_text("1 of 2")
    screenshot(page, "run_page_restarted")
    page.reload()
    expect(restarts).to_have_text("1 of 2")
