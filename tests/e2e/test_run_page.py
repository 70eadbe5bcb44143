"""The run page in Chromium, on a real run: chart points arrive over the websocket; zoom and hidden series
survive new data and a reconnect; operator controls are confirmed, sent, and show up in the timeline."""

from __future__ import annotations

from forgeboard.accounts.services import membership_remove
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Command
from forgeboard.runs.services import run_cancel, run_launch
from tests.e2e.conftest import login, outside_the_browser_loop, screenshot
from tests.support.configs import sft_yaml
from tests.support.processes import wait_for

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

