"""Charts that fit their cards, in Chromium at 1024 and 1600 px windows: every canvas inside its card, the x axis
reaching the run's last step, the legend visible and following a window resize; signed, scaled axis labels;
a live duration, the launch flash following the run's state, the step under way, the startup panel built from startup_phase
events (live and after a reload); the metrics that say whether a run learns first, with their meaning, and a
metric's lone point drawn. A 100k-point series is measured."""

from __future__ import annotations

import re
import time
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch, run_transition
from forgeboard.runs.states import RunState
from forgeboard.telemetry.ingest import telemetry_ingest
from forgeboard.telemetry.services import event_append
from tests.e2e.conftest import login, outside_the_browser_loop, screenshot
from tests.platform.conftest import TINY_GRPO_YAML
from tests.support.configs import sft_yaml
from tests.support.processes import wait_for
from workers.engine.telemetry_wire import TelemetryBatch

LAST_STEP = 240
START = 1_700_000_000.0
KEYS = ["loss", "reward/mean", "kl", "time/step_s", "throughput/train_tokens_per_s"]
RUN_GRID = "FBRunPage.grid"
COMPARE_GRID = "FBCompare.grid()"

# What a person sees of each chart: the card's box, its canvas and legend, and the plot's x scale and data.
LAYOUT = """grid => Array.from(grid.charts.entries()).map(([key, chart]) => {
    const f = chart.figure, box = (el) => { const r = el.getBoundingClientRect();
        return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width, height: r.height}; };
    const style = getComputedStyle(f);
    return {key, figure: box(f), canvas: box(f.querySelector('canvas')), legend: box(f.querySelector('.u-legend')),
        rows: Array.from(f.querySelectorAll('.u-legend .u-series')).map(box),
        content: f.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight),
        overflowing: f.scrollWidth > f.clientWidth, plotWidth: chart.plot.width,
        xMax: chart.plot.scales.x.max, lastX: chart.plot.data[0][chart.plot.data[0].length - 1],
        yTicks: chart.plot.axes[1]._values || [], yLabel: chart.plot.axes[1].label || '', ...yRoom(chart.plot)};
})"""
# The widest y tick label against the room uPlot left for it beside the plot (CSS px).
Y_ROOM = """function yRoom(u) { const a = u.axes[1]; u.ctx.font = a.font[0];
    const widest = Math.max(0, ...(a._values || []).map(v => u.ctx.measureText(v).width / devicePixelRatio));
    return {yLabelWidth: widest, yLabelRoom: u.bbox.left / devicePixelRatio - a.ticks.size - a.gap
        - (a.label ? a.labelSize : 0)}; }"""


def _seed_run(team, *, scale: float = 1.0, state: RunState = RunState.SUCCEEDED, started_ago_s: float = 3600) -> Run:
    """A run the worker skips (not queued once the launch commits) with metrics at steps 0..240."""
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        finished = timezone.now() if state == RunState.SUCCEEDED else None
        Run.objects.filter(pk=run.pk).update(state=state, started_at=timezone.now() - timedelta(seconds=started_ago_s),
                                             finished_at=finished)
    values = {
        "loss": lambda s: scale * (0.8 - 1.4 * s / LAST_STEP),  # crosses zero: negative ticks
        "reward/mean": lambda s: min(1.0, s / LAST_STEP * scale),
        "kl": lambda s: 1e-4 * (1 + s / LAST_STEP),  # small values
        "time/step_s": lambda s: 0.5 + (s % 5) * 0.1,
        "throughput/train_tokens_per_s": lambda s: 1500.0 * scale + 10 * s,  # thousands
    }
    metrics = [{"key": key, "step": step, "value": fn(step), "time": START + 2.0 * step}
               for step in range(LAST_STEP + 1) for key, fn in values.items()]
    telemetry_ingest(run=run, batches=[TelemetryBatch(seq=1, metrics=metrics)])
    return run


def _assert_charts_fit(layout: list[dict], *, keys: list[str], where: str) -> None:
    assert sorted(c["key"] for c in layout) == sorted(keys), where
    for chart in layout:
        what = f"{where}: chart {chart['key']}"
        figure, canvas, legend = chart["figure"], chart["canvas"], chart["legend"]
        assert canvas["width"] > 150, what
        assert figure["left"] <= canvas["left"] and canvas["right"] <= figure["right"], f"{what}: canvas {canvas} card {figure}"
        assert figure["top"] <= canvas["top"] and canvas["bottom"] <= figure["bottom"], what
        assert abs(chart["plotWidth"] - chart["content"]) <= 1, f"{what}: sized from the card's content box"
        assert not chart["overflowing"], f"{what}: nothing wider than the card"
        assert chart["yLabelWidth"] <= chart["yLabelRoom"], f"{what}: y labels {chart['yTicks']} cut at the left"
        assert chart["xMax"] >= LAST_STEP and chart["lastX"] == LAST_STEP, f"{what}: x axis ends at {chart['xMax']}"
        assert legend["width"] > 0 and legend["height"] > 0, f"{what}: legend shown"
        assert figure["left"] <= legend["left"] and legend["right"] <= figure["right"] + 0.5, f"{what}: legend {legend}"
        assert legend["bottom"] <= figure["bottom"] + 0.5, f"{what}: legend cut off at the bottom"
        for row in chart["rows"]:
            assert figure["left"] <= row["left"] and row["right"] <= figure["right"] + 0.5, f"{what}: legend row {row}"


def _wait_until_fitted(page, grid: str) -> None:
    page.wait_for_function(f"""() => {{ const g = {grid}; if (!g || !g.charts.size) return false;
        return Array.from(g.charts.values()).every(c => {{ const f = c.figure, s = getComputedStyle(f);
            const w = f.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight);
            return c.plot.data[0].length > 0 && Math.abs(c.plot.width - w) <= 1; }}); }}""", timeout=30_000)


def _layout(page, grid: str) -> list[dict]:
    return page.evaluate(f"(() => {{ {Y_ROOM}; return ({LAYOUT})({grid}); }})()")


def test_run_page_charts_fit_their_cards_at_1600_and_1024_and_follow_a_resize(page, server, team):
    run = _seed_run(team)
    login(page, server, "mateo")
    page.set_viewport_size({"width": 1600, "height": 1000})
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function(f"document.querySelectorAll('figure.chart[data-last-x=\"{LAST_STEP}\"]').length === {len(KEYS)}",
                           timeout=30_000)
    _wait_until_fitted(page, RUN_GRID)
    wide = _layout(page, RUN_GRID)
    _assert_charts_fit(wide, keys=KEYS, where="1600 px")
    screenshot(page, "charts_fit_run_1600")

    by_key = {c["key"]: c for c in wide}
    loss_ticks = by_key["loss"]["yTicks"]
    assert any(t.startswith("-") for t in loss_ticks) and "0" in loss_ticks, loss_ticks
    assert all(re.fullmatch(r"-?\d+(\.\d+)?k|0", t) for t in by_key["throughput/train_tokens_per_s"]["yTicks"]), \
        by_key["throughput/train_tokens_per_s"]["yTicks"]
    assert any(re.fullmatch(r"\d(\.\d+)?e-4", t) for t in by_key["kl"]["yTicks"]), by_key["kl"]["yTicks"]
    assert by_key["time/step_s"]["yLabel"] == "s" and by_key["throughput/train_tokens_per_s"]["yLabel"] == "tok/s"
    assert by_key["loss"]["yLabel"] == ""
    legend = page.locator('figure.chart[data-key="loss"] .u-legend')
    assert legend.is_visible()

    page.set_viewport_size({"width": 1024, "height": 900})  # the same page, resized: the canvases follow
    page.wait_for_function(f"""() => {{ const c = {RUN_GRID}.charts.get('loss'); return c.plot.width !== {by_key['loss']['plotWidth']}; }}""",
                           timeout=10_000)
    _wait_until_fitted(page, RUN_GRID)
    narrow = _layout(page, RUN_GRID)
    _assert_charts_fit(narrow, keys=KEYS, where="resized to 1024 px")
    screenshot(page, "charts_fit_run_resized_1024")

    page.reload()  # made at 1024 px
    page.wait_for_function(f"document.querySelectorAll('figure.chart[data-last-x=\"{LAST_STEP}\"]').length === {len(KEYS)}",
                           timeout=30_000)
    _wait_until_fitted(page, RUN_GRID)
    _assert_charts_fit(_layout(page, RUN_GRID), keys=KEYS, where="loaded at 1024 px")

    # A card the filter hid and shows again is fitted to its (new) size too.
    page.locator("#chart-filter").fill("loss")
    page.wait_for_function("Array.from(document.querySelectorAll('figure.chart')).filter(f => !f.hidden).length === 1")
    page.set_viewport_size({"width": 1600, "height": 1000})
    page.locator("#chart-filter").fill("")
    _wait_until_fitted(page, RUN_GRID)
    _assert_charts_fit(_layout(page, RUN_GRID), keys=KEYS, where="filter cleared at 1600 px")


def test_compare_page_charts_fit_at_1024_and_1600(page, server, team):
    a, b = _seed_run(team), _seed_run(team, scale=-2.0)
    login(page, server, "vera")
    for width in (1600, 1024):
        page.set_viewport_size({"width": width, "height": 1000})
        page.goto(f"{server['url']}/p/alpha/compare/?runs={a.pk},{b.pk}")
        page.wait_for_function("document.getElementById('compare-charts').dataset.state === 'ready'", timeout=30_000)
        _wait_until_fitted(page, COMPARE_GRID)
        layout = _layout(page, COMPARE_GRID)
        _assert_charts_fit(layout, keys=KEYS, where=f"compare at {width} px")
        assert all(len(c["rows"]) == 3 for c in layout), "the x value and both runs in each legend"
        screenshot(page, f"charts_fit_compare_{width}")
    page.set_viewport_size({"width": 1600, "height": 1000})  # from 1024 back to 1600 without a reload
    _wait_until_fitted(page, COMPARE_GRID)
    _assert_charts_fit(_layout(page, COMPARE_GRID), keys=KEYS, where="compare resized to 1600 px")


def _phase(run: Run, phase: str, label: str, elapsed_s: float, previous_s: float | None,
           previous_parts: object = None) -> None:
    outside_the_browser_loop(event_append, run=run, kind="message", payload={
        "name": "startup_phase", "phase": phase, "label": label, "elapsed_s": elapsed_s, "previous_s": previous_s,
        "previous_parts": previous_parts if previous_parts is not None else {}})


def _transition(run: Run, from_state: RunState, to_state: RunState, **kwargs) -> None:
    outside_the_browser_loop(run_transition, run_id=run.pk, from_state=from_state, to_state=to_state, **kwargs)


DURATION = "document.getElementById('run-duration').textContent"
SUMMARY = "document.getElementById('startup-summary').textContent"


def _watch_a_launching_run(page, server, team) -> Run:
    """A run the worker skips (launching once the launch commits), its page open and live."""
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(state=RunState.LAUNCHING)
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    return run


def test_duration_ticks_and_startup_panel_shows_phases(page, server, team):
    run = _watch_a_launching_run(page, server, team)
    assert page.evaluate(DURATION) == "—"  # not started
    assert page.locator("#startup").is_hidden()

    _phase(run, "placing", "placing the actors", 0.0, None)
    _phase(run, "spawning_procs", "spawning procs", 0.1, 0.1)
    page.wait_for_function(f"{SUMMARY}.startsWith('Starting: spawning procs')", timeout=10_000)
    first = page.evaluate(SUMMARY)
    page.wait_for_function(f"{SUMMARY} !== {first!r}", timeout=5_000)  # the current phase's counter ticks
    phases = page.locator("#startup-phases li")
    assert phases.count() == 2
    assert phases.nth(0).inner_text() == "placing the actors: 0.1 s"
    assert re.fullmatch(r"spawning procs: \d+\.\d\d? s…", phases.nth(1).inner_text()), phases.nth(1).inner_text()
    assert page.locator("#startup").get_attribute("data-state") == "starting"
    screenshot(page, "startup_panel_starting")

    _transition(run, RunState.LAUNCHING, RunState.RUNNING)
    page.wait_for_function("document.getElementById('run-state').dataset.state === 'running'", timeout=10_000)
    page.wait_for_function(f"/^\\d+s$/.test({DURATION})", timeout=5_000)
    page.wait_for_function(f"Number({DURATION}.slice(0, -1)) >= 2", timeout=10_000)  # ticking, no reload

    _phase(run, "loading_model", "loading the model", 6.3, 6.2)
    # each role's procs ready so many seconds into loading; what is not a name with seconds is left out
    _phase(run, "warming_generator", "warming the generator", 10.3, 4.0,
           {"generator": 3.1, "trainer": 3.9, "data": 0.4, "bogus": "soon", "nested": {"a": 1}, "negative": -2})
    _phase(run, "ready", "ready", 12.4, 2.1)
    expected = ("Started in 12.4 s (placing the actors 0.1 s, spawning procs 6.2 s, loading the model 4.0 s, "
                "warming the generator 2.1 s)")
    page.wait_for_function(f"{SUMMARY} === {expected!r}", timeout=10_000)
    assert page.locator("#startup").get_attribute("open") is None  # collapsed to its one line
    startup_items = page.locator('#timeline li[data-kind="message"]')
    assert startup_items.count() == 5
    assert startup_items.first.inner_text().endswith("startup ready: started in 12.4 s")
    assert "startup loading the model (at 6.3 s; the previous phase took 6.2 s)" in \
        page.locator("#timeline").inner_text()
    loading = page.locator('#startup-phases li[data-phase="loading_model"]')
    assert loading.locator(".phase-parts").text_content() == "ready after trainer 3.9 s · generator 3.1 s · data 0.4 s"
    assert page.locator("#startup-phases .phase-parts").count() == 1  # only the phase that had parts
    page.locator("#startup-summary").click()  # open the panel: the parts show on their own line under the phase
    parts_box, label_box = loading.locator(".phase-parts").bounding_box(), loading.bounding_box()
    assert parts_box["height"] > 0 and parts_box["y"] >= label_box["y"] + parts_box["height"] * 0.8
    screenshot(page, "startup_panel_started")
    page.locator("#startup-summary").click()

    page.reload()  # the same from the backlog
    page.wait_for_function(f"{SUMMARY} === {expected!r}", timeout=10_000)
    assert page.locator('#timeline li[data-kind="message"]').count() == 5

    _transition(run, RunState.RUNNING, RunState.SUCCEEDED)
    page.wait_for_function("document.getElementById('run-state').dataset.state === 'succeeded'", timeout=10_000)
    stopped = page.evaluate(DURATION)
    time.sleep(1.6)
    assert page.evaluate(DURATION) == stopped, "the duration stops at the end state"
    run.refresh_from_db()
    assert stopped == f"{int((run.finished_at - run.started_at).total_seconds())}s"


def test_a_local_run_counts_its_engine_spawn_in_the_startup(page, server, team):
    """A local run is running from the moment its engine process is spawned; the engine tells its first phase
    only after its imports (12 s on a busy 2-core host), so the page said "Started in 0.1 s" after a blank wait."""
    run = _watch_a_launching_run(page, server, team)
    assert page.locator("#startup").is_hidden()

    _transition(run, RunState.LAUNCHING, RunState.RUNNING)
    page.wait_for_function(f"{SUMMARY}.startsWith('Starting: spawning the engine… ')", timeout=10_000)
    assert page.locator("#startup").is_visible() and page.locator("#startup").get_attribute("data-state") == "starting"
    page.wait_for_function(f"parseFloat({SUMMARY}.split('… ')[1]) >= 1.5", timeout=10_000)  # ticking, no reload
    screenshot(page, "startup_panel_spawning_the_engine")

    _phase(run, "loading_model", "loading the model and data", 0.0, None)
    _phase(run, "ready", "ready", 0.1, 0.1)
    pattern = r"Started in (\d+\.\d+) s \(spawning the engine (\d+\.\d+) s, loading the model and data 0\.1 s\)"
    page.wait_for_function(f"{SUMMARY}.startsWith('Started in ')", timeout=10_000)
    for where in ("live", "after a reload"):
        summary = page.evaluate(SUMMARY)
        match = re.fullmatch(pattern, summary)
        assert match, f"{where}: {summary}"
        total, spawn = float(match[1]), float(match[2])
        assert spawn >= 1.5 and abs(total - (spawn + 0.1)) < 0.02, f"{where}: {summary}"
        page.reload()
        page.wait_for_function(f"{SUMMARY}.startsWith('Started in ')", timeout=10_000)


def test_a_run_stopped_during_startup_says_where(page, server, team):
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(state=RunState.LAUNCHING)
    _phase(run, "placing", "placing the actors", 0.0, None)
    _phase(run, "loading_model", "loading the model", 0.4, 0.4)
    _transition(run, RunState.LAUNCHING, RunState.FAILED, reason="out of memory")
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function(f"{SUMMARY}.startsWith('Stopped while loading the model, after ')", timeout=10_000)
    first = page.evaluate(SUMMARY)
    time.sleep(0.6)
    assert page.evaluate(SUMMARY) == first, "no counter ticks on a stopped run"
    assert page.locator("#startup").get_attribute("data-state") == "stopped"


def test_launch_flash_follows_the_run_to_its_end(page, server, team, tiny_model):
    login(page, server, "mateo")
    page.goto(f"{server['url']}/p/alpha/launch/")
    page.locator("#experiment").select_option("new")
    page.locator("#new_name").fill("flash")
    page.locator("#new_recipe").select_option("sft")
    page.locator("#config_yaml").fill(sft_yaml(tiny_model, steps=3))
    page.wait_for_function("document.getElementById('config-status').textContent === 'Config is valid.'",
                           timeout=10_000)
    page.locator("#launch-button").click()
    page.wait_for_url(re.compile(r"/runs/\d+/$"), timeout=30_000)
    run = Run.objects.get(experiment__name="flash")
    flash = page.locator(".messages li")
    assert flash.inner_text().startswith(f"Launched flash #{run.number}: ")
    wait_for(lambda: Run.objects.get(pk=run.pk).state in ("succeeded", "failed"), timeout=180, what="the run ends")
    run.refresh_from_db()
    assert run.state == "succeeded", run.exit_reason
    page.wait_for_function("document.getElementById('run-state').dataset.state === 'succeeded'", timeout=30_000)
    assert flash.inner_text() == f"Launched flash #{run.number}: succeeded."
    assert re.fullmatch(r"\d+s|\d+m \d\ds", page.evaluate(DURATION)), page.evaluate(DURATION)
    screenshot(page, "run_page_flash_finished")


def test_a_100k_point_series_stays_smooth(page, server, team):
    run = _seed_run(team)
    login(page, server, "mateo")
    page.set_viewport_size({"width": 1600, "height": 1000})
    page.goto(f"{server['url']}/runs/{run.pk}/")
    _wait_until_fitted(page, RUN_GRID)
    # uPlot draws in a microtask after setData: each time is taken once a macrotask runs, so it includes the drawing.
    measure = """async labels => {
        const settled = () => new Promise((resolve) => {
            const channel = new MessageChannel(); channel.port1.onmessage = resolve; channel.port2.postMessage(0); });
        const grid = new FBCharts.ChartGrid(document.getElementById('charts'), {labels});
        const n = 100000, chart = grid.chart('bench/' + labels.length);
        const series = labels.map((_, k) => Array.from({length: n}, (_, s) => [s, Math.sin(s / (500 + 100 * k)) - 0.5]));
        let t = performance.now();
        series.forEach((points, k) => chart.add(k, points)); chart.redraw(); await settled();
        const first = performance.now() - t;
        const appends = [];  // live: 10 new steps per update, redrawn each time
        for (let i = 0; i < 50; i++) {
            const s0 = n + i * 10, pts = Array.from({length: 10}, (_, j) => [s0 + j, 0.1 * j]);
            t = performance.now(); labels.forEach((_, k) => chart.add(k, pts)); chart.redraw(); await settled();
            appends.push(performance.now() - t);
        }
        appends.sort((x, y) => x - y);
        const f = chart.figure, s = getComputedStyle(f);
        return {first, appendMedian: appends[25], appendMax: appends[49], lastX: chart.plot.data[0].at(-1),
                length: chart.plot.data[0].length, width: chart.plot.width,
                content: f.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight)};
    }"""
    for labels in (["value"], ["a", "b"]):
        figures = page.evaluate(measure, labels)
        print(f"\n100k points x {len(labels)} series: first draw {figures['first']:.0f} ms, live append + redraw "
              f"median {figures['appendMedian']:.1f} ms (max {figures['appendMax']:.1f} ms)")
        assert figures["length"] == 100_500 and figures["lastX"] == 100_499
        assert abs(figures["width"] - figures["content"]) <= 1
        assert figures["appendMedian"] < 250, figures


def test_what_says_whether_a_run_learns_comes_first_and_a_lone_point_shows(page, server, team):
    """The demo's GRPO page had forty charts by name: the held-out reward the README promises was the 8th, below
    the fold, and while it had only its step-0 evaluation it was an empty frame."""
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, started_at=timezone.now())
    names = ["buffer/batches", "clip_fraction", "data/train_tokens", "entropy", "grad_norm", "kl", "loss", "lr",
             "reward/mean", "reward/std", "time/step_s"]
    metrics = [{"key": key, "step": step, "value": 0.1 * step, "time": START + step}
               for step in range(1, 9) for key in names]
    metrics += [{"key": "eval/reward_mean", "step": 0, "value": 0.31, "time": START}]
    telemetry_ingest(run=run, batches=[TelemetryBatch(seq=1, metrics=metrics)])
    login(page, server, "mateo")
    page.set_viewport_size({"width": 1366, "height": 900})
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("document.querySelectorAll('#charts figure.chart').length === 12", timeout=30_000)
    _wait_until_fitted(page, RUN_GRID)
    order = page.evaluate("Array.from(document.querySelectorAll('#charts figure.chart')).map(f => f.dataset.key)")
    assert order[:3] == ["eval/reward_mean", "reward/mean", "loss"], order
    held_out = page.locator('figure.chart[data-key="eval/reward_mean"]')
    box = held_out.bounding_box()
    assert box["y"] + box["height"] <= 900, f"the held-out reward below the fold: {box}"
    assert held_out.locator(".chart-note").inner_text().startswith("Held-out reward: the mean reward on problems")
    assert page.locator('figure.chart[data-key="buffer/batches"] .chart-note').count() == 0

    # Its one point is drawn: pixels of the series' colour in the plot.
    blue = """key => { const c = document.querySelector(`figure.chart[data-key="${key}"] canvas`);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 0; i < d.length; i += 4) if (Math.abs(d[i] - 11) < 40 && Math.abs(d[i + 1] - 87) < 40
            && Math.abs(d[i + 2] - 208) < 40 && d[i + 3] > 200) n++;
        return n; }"""
    assert page.evaluate(blue, "eval/reward_mean") >= 12, "the step-0 evaluation is not drawn"
    screenshot(page, "run_page_headline_charts")

    # A key that arrives later still takes its place among the first; the lone point turns into a line.
    outside_the_browser_loop(telemetry_ingest, run=run, batches=[TelemetryBatch(seq=2, metrics=[
        {"key": "eval/accuracy", "step": 0, "value": 0.3, "time": START},
        {"key": "eval/accuracy", "step": 20, "value": 0.6, "time": START + 20},
        {"key": "eval/reward_mean", "step": 20, "value": 0.62, "time": START + 20}])])
    page.wait_for_function("document.querySelectorAll('#charts figure.chart').length === 13", timeout=30_000)
    order = page.evaluate("Array.from(document.querySelectorAll('#charts figure.chart')).map(f => f.dataset.key)")
    assert order[:4] == ["eval/reward_mean", "eval/accuracy", "reward/mean", "loss"], order


STEP = "document.getElementById('run-step').textContent"


def test_the_page_says_which_step_a_run_is_on_and_when_its_log_is_empty(page, server, team):
    """A first step that takes long (a big batch) looked like a stalled run: nothing said a step was under way,
    and the log tail was an empty box."""
    run = _watch_a_launching_run(page, server, team)  # 5 steps
    assert page.evaluate(STEP) == "— of 5"
    assert page.locator(".facts div", has_text="Restarts").locator("dd").inner_text() == "none allowed"
    assert page.locator("#logs-empty").is_visible() and page.locator("#logs").is_hidden(), "no empty box under it"

    _transition(run, RunState.LAUNCHING, RunState.RUNNING)
    _phase(run, "loading_model", "loading the model and data", 0.0, None)
    assert page.evaluate(STEP) == "— of 5", "no step is under way while the run starts"
    _phase(run, "ready", "ready", 0.1, 0.1)
    page.wait_for_function(f"{STEP} === '— of 5 · step 1 running'", timeout=10_000)

    outside_the_browser_loop(telemetry_ingest, run=run, batches=[TelemetryBatch(seq=1, metrics=[
        {"key": key, "step": step, "value": 0.5, "time": START + step}
        for step in (1, 2) for key in ("loss", "reward/mean")], logs=[{"line": "step 2 done", "time": START + 2}])])
    page.wait_for_function(f"{STEP} === '2 of 5 · step 3 running'", timeout=10_000)
    page.wait_for_function("document.getElementById('logs').textContent.includes('step 2 done')", timeout=10_000)
    assert page.locator("#logs-empty").is_hidden() and page.locator("#logs").is_visible()
    for chart in _layout(page, RUN_GRID):  # a flat series: ticks five decimals long ("0.49950")
        assert chart["yLabelWidth"] <= chart["yLabelRoom"], f"{chart['key']}: y labels {chart['yTicks']} cut"
        assert len(chart["yTicks"][0]) == 7, chart["yTicks"]
    step_box, state_box = page.locator("#run-step").bounding_box(), page.locator("#run-state").bounding_box()
    assert step_box["width"] > 0 and step_box["y"] + step_box["height"] <= 900, step_box
    assert step_box["y"] > state_box["y"], "the step sits in the facts below the run's name"
    screenshot(page, "run_page_step_under_way")

    _transition(run, RunState.RUNNING, RunState.SUCCEEDED)
    page.wait_for_function(f"{STEP} === '2 of 5'", timeout=10_000)
    page.reload()
    page.wait_for_function(f"{STEP} === '2 of 5'", timeout=10_000)
    assert page.locator("#logs-empty").is_hidden()
