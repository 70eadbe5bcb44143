"""The run page's "Where the time goes" panel in Chromium: step_timeline records stored through the real ingest path
drawn as one row per proc in a stable order, spans where their lane and times say, a marker per step, a live step
arriving without a reload, "Last N steps", zoom (buttons, wheel, drag, double-click) kept while steps arrive, the
legend's shares and idle shares as the payloads' means; hostile payloads refused by the server or drawn as text,
without overflowing the card, live and from the backlog after a reload; at 1280 and 1024 px."""

from __future__ import annotations

import math
import re
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from pydantic import ValidationError

from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.ingest import telemetry_ingest
from tests.e2e.conftest import ARTIFACTS, login, outside_the_browser_loop, screenshot
from tests.platform.conftest import TINY_GRPO_YAML
from workers.engine.telemetry_wire import TelemetryBatch

START = 1_764_700_000.0
STEP_S = 2.0
SEEDED_STEPS = 12  # steps 0..11
LANES_IN_ORDER = ["controller", "trainer 0", "trainer 1", "generator 0", "generator 1", "generator 10", "reward",
                  "reference"]
GEOMETRY = "FBRunPage.timeline.geometry()"
HOSTILE_PHASE = "<img src=x onerror=window.__pwned=1><script>__pwned=2</script>"  # 62 chars: the wire takes it
LONG_LANE = "trainer " + "x" * 56  # the longest name the wire takes (64)


def _payload(step: int) -> dict:
    """A GRPO step in async mode: generation launched in the step before (negative start) overlaps the trainer's
    work, and the controller scores the next batch while the trainer trains (score_ahead); from step 8 on, generator 1
    is replaced by generator 10. Shares alternate so a mean over an even number of steps is round (forward_backward
    30%, trainer 0 idle 55%)."""
    second = "generator 1" if step < 8 else "generator 10"
    lanes = ["trainer 1", "generator 0", "controller", "reference", "trainer 0", "reward", second]  # not in order
    at = {name: i for i, name in enumerate(lanes)}
    spans = [
        [at["controller"], "generate_wait", 0.0, 0.6], [at["controller"], "reward", 0.6, 0.8],
        [at["controller"], "score_ahead", 0.8, 1.5], [at["controller"], "train", 1.5, 1.8],
        [at["controller"], "weight_sync", 1.8, 1.95],
        [at["generator 0"], "generate", -0.3, 0.6], [at[second], "generate", 0.0, 0.5],
        [at[second], "weight_load", 1.8, 1.95],
        [at["reward"], "reward", 0.6, 0.8], [at["reference"], "reference", 0.6, 0.75],
        [at["trainer 0"], "old_logprobs", 0.8, 1.0], [at["trainer 0"], "forward_backward", 1.0, 1.4],
        [at["trainer 0"], "optimizer", 1.4, 1.6],
        [at["trainer 1"], "forward_backward", 1.0, 1.4], [at["trainer 1"], "all_reduce", 1.4, 1.5],
        [at["trainer 1"], "optimizer", 1.5, 1.6],
    ]
    odd = step % 2
    return {"step": step, "start": START + STEP_S * step, "seconds": STEP_S, "lanes": lanes, "spans": spans,
            "shares": {"generate": 0.3, "forward_backward": 0.35 if odd else 0.25, "optimizer": 0.1,
                       "reward": 0.1, "reference": 0.075, "old_logprobs": 0.1, "weight_sync": 0.075,
                       "weight_load": 0.075, "all_reduce": 0.05},
            "idle": {"trainer 0": 0.6 if odd else 0.5, "trainer 1": 0.6, "generator 0": 0.55,
                     second: 0.675, "reward": 0.9, "reference": 0.925}}


def _batch(run: Run, payloads: list[dict]) -> TelemetryBatch:
    run.refresh_from_db()
    return TelemetryBatch.model_validate({"seq": run.telemetry_seq + 1, "events": [
        {"kind": "step_timeline", "payload": p, "time": p["start"] + p["seconds"]} for p in payloads]})


def _store(run: Run, payloads: list[dict]) -> None:
    outside_the_browser_loop(telemetry_ingest, run=run, batches=[_batch(run, payloads)])


def _seed_run(team) -> Run:
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, started_at=timezone.now() - timedelta(minutes=5))
    _store(run, [_payload(step) for step in range(SEEDED_STEPS)])
    return run


def _geometry(page) -> dict:
    return page.evaluate(GEOMETRY)


def _span(geometry: dict, lane: str, phase: str, step: int) -> dict:
    found = [s for s in geometry["spans"] if (s["lane"], s["phase"], s["step"]) == (lane, phase, step)]
    assert len(found) == 1, f"{lane} {phase} step {step}: {len(found)} spans drawn"
    return found[0]["box"]


def _wait_for_steps(page, first: int, last: int) -> None:
    page.wait_for_function(f"""() => {{ const t = window.FBRunPage && FBRunPage.timeline; if (!t) return false;
        const s = t.geometry().steps; return s.length === {last - first + 1} && s[0] === {first} && s.at(-1) === {last}; }}""",
                           timeout=15_000)


def _assert_fits(page, geometry: dict, where: str) -> None:
    card, plot = geometry["card"], geometry["plot"]
    assert plot["width"] > 300, f"{where}: plot {plot}"
    assert card["left"] - 0.5 <= geometry["laneColumn"]["left"] and plot["right"] <= card["right"] + 0.5, \
        f"{where}: plot {plot} outside the card {card}"
    overflow = page.evaluate("""() => ({page: document.documentElement.scrollWidth - document.documentElement.clientWidth,
        card: (() => { const c = document.getElementById('step-timeline'); return c.scrollWidth - c.clientWidth; })(),
        legend: Array.from(document.querySelectorAll('#step-timeline .tl-legend li')).some(li => {
            const r = li.getBoundingClientRect(), c = document.getElementById('step-timeline').getBoundingClientRect();
            return r.right > c.right + 0.5 || r.left < c.left - 0.5; }),
        chart: (() => { const c = document.querySelector('#step-timeline .tl-chart'); return c.scrollWidth - c.clientWidth; })()})""")
    assert overflow == {"page": 0, "card": 0, "legend": False, "chart": 0}, f"{where}: overflow {overflow}"
    for lane in geometry["lanes"]:
        label = lane["label"]
        assert geometry["laneColumn"]["left"] <= label["left"] and label["right"] <= geometry["laneColumn"]["right"] + 0.5, \
            f"{where}: label {lane['name']!r} outside its column"
        assert label["right"] <= plot["left"] + 0.5, f"{where}: label {lane['name']!r} runs into the plot"
    ticks = geometry["ticks"]
    assert len(ticks) >= 3, f"{where}: ticks {ticks}"
    for left, right in zip(ticks, ticks[1:]):
        assert left["box"]["right"] < right["box"]["left"], f"{where}: tick labels overlap: {left} {right}"
    for tick in ticks:
        assert plot["left"] - 0.5 <= tick["box"]["left"] and tick["box"]["right"] <= plot["right"] + 0.5, \
            f"{where}: tick {tick['text']} clipped"
    labels = sorted(geometry["markerLabels"], key=lambda m: m["box"]["left"])
    for left, right in zip(labels, labels[1:]):
        assert left["box"]["right"] <= right["box"]["left"], f"{where}: step labels overlap: {left} {right}"


def _assert_layout(geometry: dict, *, first: int, last: int, where: str) -> None:
    """Rows in order and aligned with their labels; spans in their rows, at x proportional to time."""
    assert [lane["name"] for lane in geometry["lanes"]] == LANES_IN_ORDER, where
    assert [lane["labelText"] for lane in geometry["lanes"]] == LANES_IN_ORDER, where
    assert not any(lane["labelClipped"] for lane in geometry["lanes"]), f"{where}: a lane label is cut"
    tops = [lane["row"]["top"] for lane in geometry["lanes"]]
    assert tops == sorted(tops) and len(set(tops)) == len(tops), f"{where}: rows {tops}"
    for lane in geometry["lanes"]:
        label, row = lane["label"], lane["row"]
        assert abs((label["top"] + label["bottom"]) / 2 - (row["top"] + row["bottom"]) / 2) <= 1, \
            f"{where}: label {lane['name']} not beside its row ({label} vs {row})"

    view, plot = geometry["view"], geometry["plot"]
    assert math.isclose(view["from"], -0.3, abs_tol=1e-6), f"{where}: the first step's generation starts 0.3 s early"
    assert math.isclose(view["to"], (last - first + 1) * STEP_S, abs_tol=1e-6), where
    scale = plot["width"] / (view["to"] - view["from"])
    rows = {lane["name"]: lane["row"] for lane in geometry["lanes"]}
    drawn = [s for s in geometry["spans"]]
    assert len(drawn) == 16 * (last - first + 1), f"{where}: {len(drawn)} spans"
    for span in drawn:
        box, row = span["box"], rows[span["lane"]]
        assert row["top"] < box["top"] and box["bottom"] < row["bottom"], f"{where}: {span['title']} outside its row"
        at = (span["step"] - first) * STEP_S + span["start"]
        expected_left = plot["left"] + (max(at, view["from"]) - view["from"]) * scale
        assert abs(box["left"] - expected_left) <= 1, f"{where}: {span['title']} at {box['left']}, not {expected_left}"
        assert abs(box["width"] - (span["end"] - span["start"]) * scale) <= 1, f"{where}: {span['title']} width"
    backward = _span(geometry, "trainer 0", "forward_backward", last)  # 0.4 s
    logprobs = _span(geometry, "trainer 0", "old_logprobs", last)  # 0.2 s
    assert abs(backward["width"] / logprobs["width"] - 2) < 0.05, (backward, logprobs)
    assert abs(backward["left"] - logprobs["right"]) <= 1, "forward_backward starts where old_logprobs ends"
    assert abs(logprobs["width"] - 0.2 * scale) <= 1

    markers = geometry["markers"]
    assert [m["step"] for m in markers] == list(range(last, first - 1, -1)), f"{where}: markers {markers}"
    for marker in markers:
        expected = plot["left"] + ((marker["step"] - first) * STEP_S - view["from"]) * scale
        assert abs(marker["box"]["left"] - expected) <= 1.5, f"{where}: step {marker['step']} marker"
    assert str(last) in [m["text"] for m in geometry["markerLabels"]], f"{where}: the newest step's number"


def _legend(page) -> tuple[list[str], list[str]]:
    return (page.locator("#step-timeline .tl-shares:not(.tl-waits) li").all_inner_texts(),
            page.locator("#step-timeline .tl-idle li").all_inner_texts())


def _flat(texts: list[str]) -> list[str]:
    return [re.sub(r"\s+", " ", t).strip() for t in texts]


def test_step_timeline_draws_lanes_spans_steps_zoom_and_shares(page, server, team):
    run = _seed_run(team)
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    panel = page.locator("#step-timeline")
    _wait_for_steps(page, SEEDED_STEPS - 10, SEEDED_STEPS - 1)  # the last 10 of the backlog
    assert page.get_by_role("heading", name="Where the time goes").is_visible()
    assert panel.locator(".tl-empty").is_hidden()
    assert page.locator("#step-timeline select").input_value() == "10"
    panel.scroll_into_view_if_needed()
    geometry = _geometry(page)
    _assert_layout(geometry, first=2, last=11, where="1280 px")
    _assert_fits(page, geometry, "1280 px")
    assert all(re.fullmatch(r"-?\d+(\.\d+)? s|0", t["text"]) for t in geometry["ticks"]), geometry["ticks"]
    assert "0" in [t["text"] for t in geometry["ticks"]], "the first shown step's start is 0"
    backward = [s for s in geometry["spans"] if (s["lane"], s["phase"], s["step"]) == ("trainer 0", "forward_backward", 11)]
    assert backward[0]["title"] == "trainer 0 · forward_backward · step 11 · 0.40 s"
    assert panel.locator('rect.tl-span[data-lane="trainer 0"][data-phase="forward_backward"][data-step="11"] title') \
        .text_content() == "trainer 0 · forward_backward · step 11 · 0.40 s"

    shares, idle = _legend(page)
    shares, idle = _flat(shares), _flat(idle)
    assert shares[:2] == ["forward_backward 30%", "generate 30%"] or shares[:2] == ["generate 30%", "forward_backward 30%"], shares
    values = [int(s.rsplit(" ", 1)[1].rstrip("%")) for s in shares]
    assert values == sorted(values, reverse=True), f"largest first: {shares}"
    assert "all_reduce 5%" in shares and "reference 8%" in shares, shares
    assert "trainer 0 idle 55%" in idle and "trainer 1 idle 60%" in idle and "reward idle 90%" in idle, idle
    assert [line.rsplit(" idle ", 1)[0] for line in idle] == LANES_IN_ORDER[1:], "idle lines in the rows' order"
    assert not any(s.startswith(("generate_wait", "train ", "score_ahead")) for s in shares), \
        "the controller's waits are not work"
    waits = _flat(page.locator("#step-timeline .tl-waits li").all_inner_texts())
    assert waits == ["score_ahead 35%", "generate_wait 30%", "train 15%", "reward 10%", "weight_sync 8%"], waits
    colours = {phase: panel.locator(f'rect.tl-span[data-lane="controller"][data-phase="{phase}"]').first.evaluate(
        "e => getComputedStyle(e).fill") for phase in ("score_ahead", "generate_wait", "train")}
    assert colours["score_ahead"] == "rgb(246, 191, 133)" and len(set(colours.values())) == 3, colours
    # each entry says what its phase is when pointed at
    assert panel.locator('.tl-waits li[data-phase="score_ahead"]').get_attribute("title") == \
        "score_ahead: the next batch awaited and scored while the trainer trains (async): off the step's path"
    assert panel.locator('.tl-shares:not(.tl-waits) li[data-phase="forward_backward"]').get_attribute("title") == \
        "forward_backward: the trainer's forward and backward passes"
    swatch = panel.locator('.tl-shares li[data-phase="forward_backward"] .swatch')
    assert swatch.evaluate("e => getComputedStyle(e).backgroundColor") == \
        panel.locator('rect.tl-span[data-phase="forward_backward"]').first.evaluate("e => getComputedStyle(e).fill")
    assert "Steps 2–11 · mean step 2.00 s" in panel.locator(".tl-summary").inner_text()
    screenshot(page, "step_timeline_1280")
    panel.screenshot(path=str(ARTIFACTS / "step_timeline_1280_panel.png"))

    # a step stored while the page is open appears without a reload; the view follows the newest steps
    _store(run, [_payload(12)])
    _wait_for_steps(page, 3, 12)
    geometry = _geometry(page)
    _assert_layout(geometry, first=3, last=12, where="after a live step")
    assert "12" in [m["text"] for m in geometry["markerLabels"]]

    page.locator("#step-timeline select").select_option("5")
    _wait_for_steps(page, 8, 12)
    geometry = _geometry(page)
    assert len(geometry["markers"]) == 5
    assert [lane["name"] for lane in geometry["lanes"]] == [n for n in LANES_IN_ORDER if n != "generator 1"], \
        "generator 1 was replaced before step 8"
    assert sorted(m["text"] for m in geometry["markerLabels"]) == sorted(str(s) for s in range(8, 13))
    shares = _flat(_legend(page)[0])
    assert "forward_backward 29%" in shares, "(0.25 + 0.35 + 0.25 + 0.35 + 0.25) / 5"  # steps 8..12
    page.locator("#step-timeline select").select_option("10")
    _wait_for_steps(page, 3, 12)

    page.locator("#step-timeline").scroll_into_view_if_needed()  # the mouse only reaches what the window shows
    # zoom in (the button) around the middle: a span there gets twice as wide; Reset brings it back
    zoom_in, reset = page.get_by_role("button", name="Zoom in"), page.get_by_role("button", name="Reset")
    assert reset.is_disabled()
    before = _span(_geometry(page), "trainer 0", "forward_backward", 7)
    zoom_in.click()
    page.wait_for_function("document.getElementById('step-timeline').dataset.zoomed === 'true'")
    zoomed = _span(_geometry(page), "trainer 0", "forward_backward", 7)
    assert abs(zoomed["width"] / before["width"] - 2) < 0.03, (before, zoomed)
    view = _geometry(page)["view"]
    assert math.isclose(view["to"] - view["from"], (20.0 + 0.3) / 2, rel_tol=1e-6), view
    ticks = [t["text"] for t in _geometry(page)["ticks"]]
    assert len(ticks) >= 3, ticks
    screenshot(page, "step_timeline_zoomed_1280")

    # while zoomed, a new step is held back (the view stays) and said so; Reset follows the newest steps again
    _store(run, [_payload(13)])
    page.wait_for_function("document.querySelector('#step-timeline .tl-summary').textContent.includes('1 newer step held')",
                           timeout=15_000)
    assert _span(_geometry(page), "trainer 0", "forward_backward", 7) == zoomed
    reset.click()
    _wait_for_steps(page, 4, 13)
    restored = _span(_geometry(page), "trainer 0", "forward_backward", 7)
    assert abs(restored["width"] - before["width"]) <= 0.5, "the same scale: 10 steps of 2 s, from -0.3 s"

    # the wheel zooms around the cursor, a drag pans, a double-click resets
    point = {"x": restored["left"] + restored["width"] / 2, "y": restored["top"] + restored["height"] / 2}
    page.mouse.move(point["x"], point["y"])
    page.mouse.wheel(0, -300)
    page.wait_for_function("document.getElementById('step-timeline').dataset.zoomed === 'true'")
    page.wait_for_timeout(100)  # drawn in the next animation frame
    wheeled = _span(_geometry(page), "trainer 0", "forward_backward", 7)
    assert wheeled["width"] > restored["width"] * 1.5, (restored, wheeled)
    assert abs(wheeled["left"] + wheeled["width"] / 2 - point["x"]) <= 2, "the point under the cursor stays there"
    page.mouse.down()
    page.mouse.move(point["x"] + 120, point["y"], steps=6)
    page.mouse.up()
    page.wait_for_timeout(100)
    dragged = _span(_geometry(page), "trainer 0", "forward_backward", 7)
    assert abs(dragged["left"] - (wheeled["left"] + 120)) <= 2 and abs(dragged["width"] - wheeled["width"]) <= 0.5
    page.mouse.dblclick(point["x"], point["y"])
    page.wait_for_function("document.getElementById('step-timeline').dataset.zoomed === 'false'")
    assert abs(_span(_geometry(page), "trainer 0", "forward_backward", 7)["width"] - before["width"]) <= 0.5

    # 1024 px: the legend moves under the chart (no room beside it), the plot follows the window and fits its card
    wide = _geometry(page)
    assert wide["legend"]["left"] >= wide["plot"]["right"], "at 1280 px the legend stands beside the chart"
    page.set_viewport_size({"width": 1024, "height": 900})
    page.wait_for_function(f"Math.abs(FBRunPage.timeline.geometry().plot.width - {wide['plot']['width']}) > 20",
                           timeout=10_000)
    geometry = _geometry(page)
    assert geometry["legend"]["top"] >= geometry["plot"]["bottom"], "at 1024 px the legend is under the chart"
    assert geometry["plot"]["right"] <= geometry["card"]["right"] and geometry["card"]["right"] <= 1024
    _assert_layout(geometry, first=4, last=13, where="resized to 1024 px")
    _assert_fits(page, geometry, "resized to 1024 px")
    panel.scroll_into_view_if_needed()
    screenshot(page, "step_timeline_1024")
    panel.screenshot(path=str(ARTIFACTS / "step_timeline_1024_panel.png"))

    page.reload()  # made at 1024 px, from the backlog
    _wait_for_steps(page, 4, 13)
    geometry = _geometry(page)
    _assert_layout(geometry, first=4, last=13, where="reloaded at 1024 px")
    _assert_fits(page, geometry, "reloaded at 1024 px")


def test_step_timeline_shows_nothing_until_the_first_step(page, server, team):
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, started_at=timezone.now())
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    empty = page.locator("#step-timeline .tl-empty")
    assert empty.inner_text() == "No step timeline yet."
    assert page.locator("#step-timeline .tl-body").is_hidden() and page.locator("#step-timeline .tl-toolbar").is_hidden()
    single = {"step": 0, "start": START, "seconds": 0.25, "lanes": ["process"],
              "spans": [[0, "forward_backward", 0.0, 0.2], [0, "optimizer", 0.2, 0.24]],
              "shares": {"forward_backward": 0.8, "optimizer": 0.16}, "idle": {"process": 0.04}}
    _store(run, [single])
    _wait_for_steps(page, 0, 0)
    assert empty.is_hidden()
    geometry = _geometry(page)
    assert [lane["name"] for lane in geometry["lanes"]] == ["process"]
    assert len(geometry["spans"]) == 2 and all(re.fullmatch(r"\d+ ms|0", t["text"]) for t in geometry["ticks"]), \
        geometry["ticks"]
    assert _flat(_legend(page)[0]) == ["forward_backward 80%", "optimizer 16%"]
    assert _flat(_legend(page)[1]) == ["process idle 4%"]


def test_hostile_step_timelines_are_refused_or_drawn_as_text(page, server, team):
    run = _seed_run(team)
    # what the wire refuses: a lane index out of range, a span that ends before it starts, a 200-char lane name
    for bad in ({"spans": [[99, "generate", 0.0, 0.5]]}, {"spans": [[0, "generate", 0.5, 0.1]]},
                {"lanes": ["l" * 200] + _payload(12)["lanes"][1:]}):
        with pytest.raises(ValidationError):
            _batch(run, [{**_payload(12), **bad}])

    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    _wait_for_steps(page, 2, 11)
    # what the wire takes but a page must not run: markup in a phase name, the longest lane name
    hostile = _payload(12)
    hostile["lanes"][hostile["lanes"].index("reward")] = LONG_LANE
    hostile["spans"].append([hostile["lanes"].index(LONG_LANE), HOSTILE_PHASE, 0.1, 1.9])
    hostile["shares"][HOSTILE_PHASE] = 0.9
    hostile["idle"][LONG_LANE] = hostile["idle"].pop("reward")
    _store(run, [hostile])
    _wait_for_steps(page, 3, 12)
    _assert_hostile_drawn_as_text(page, "live")

    # junk straight into the page (what a broken or hostile server could send): skipped, never thrown on
    page.evaluate("""([start, longName]) => FBRunPage.timeline.add([
        null, "step", 5, [], {step: -1, start}, {step: 1.5, start}, {step: 13, start: NaN}, {step: 13, start: "x"},
        {step: 13, start: start + 26, seconds: Infinity, lanes: "no", spans: "no", shares: [1, 2], idle: null},
        {step: 14, start: start + 28, seconds: 2, lanes: [{}, "ok", longName, 7],
         spans: [[99, "generate", 0, 1], [0, "generate", 0, 1], [1, "generate", 1, 0.5], [1, "generate", NaN, 1],
                 [1, "<b>bold</b>", 0.1, 0.5], "nope", [2, "generate", 0, 0.5], [1.5, "generate", 0, 1],
                 [1, {}, 0, 1], [1, "far", 0, 1e9], [3]],
         shares: {"generate": 2, "<b>bold</b>": 0.5, "x": NaN}, idle: {"ok": 0.25, "x": -1}, truncated: "many"}])""",
                  [START, "q" * 200])
    _wait_for_steps(page, 5, 14)
    geometry = _geometry(page)
    junk = sorted((s["lane"], s["phase"]) for s in geometry["spans"] if s["step"] == 14)
    assert junk == [("ok", "<b>bold</b>"), ("q" * 79 + "…", "generate")], junk
    step13 = [s for s in geometry["spans"] if s["step"] == 13]
    assert step13 == [] and 13 in geometry["steps"], "a step with no spans still counts as a step"
    assert page.locator("#step-timeline b").count() == 0
    assert "<b>bold</b> 5%" in _flat(_legend(page)[0]), "(0.5 over the 10 steps shown)"
    _assert_fits(page, geometry, "junk added")
    screenshot(page, "step_timeline_hostile_1280")

    page.set_viewport_size({"width": 1024, "height": 900})
    page.reload()  # from the backlog: the stored hostile step again, the junk gone
    _wait_for_steps(page, 3, 12)
    _assert_hostile_drawn_as_text(page, "reloaded at 1024 px")
    page.locator("#step-timeline").scroll_into_view_if_needed()
    screenshot(page, "step_timeline_hostile_1024")


def _assert_hostile_drawn_as_text(page, where: str) -> None:
    assert page.evaluate("window.__pwned") is None, f"{where}: a script ran"
    panel = page.locator("#step-timeline")
    assert panel.locator("img, script").count() == 0, f"{where}: markup from a payload became elements"
    geometry = _geometry(page)
    hostile = [s for s in geometry["spans"] if s["phase"] == HOSTILE_PHASE]
    assert len(hostile) == 1 and hostile[0]["lane"] == LONG_LANE and hostile[0]["step"] == 12, where
    assert hostile[0]["title"] == f"{LONG_LANE} · {HOSTILE_PHASE} · step 12 · 1.80 s"
    assert f"{HOSTILE_PHASE} 9%" in _flat(_legend(page)[0]), f"{where}: 0.9 over 10 steps, as text"
    untitled = panel.locator(".tl-shares li").evaluate_all("items => items.filter(i => !i.title).map(i => i.dataset.phase)")
    assert untitled == [HOSTILE_PHASE], f"{where}: a phase the page does not know gets no help text ({untitled})"
    assert any(line.startswith(LONG_LANE[:20]) for line in _flat(_legend(page)[1])), where
    long_label = next(lane for lane in geometry["lanes"] if lane["name"] == LONG_LANE)
    assert long_label["labelClipped"], f"{where}: the long name is cut with an ellipsis, within its column"
    assert panel.locator(f'.tl-lane[data-lane="{LONG_LANE}"]').get_attribute("title").startswith(LONG_LANE)
    short = [lane for lane in geometry["lanes"] if lane["name"] != LONG_LANE]
    assert not any(lane["labelClipped"] for lane in short), f"{where}: the other labels stay whole"
    assert geometry["laneColumn"]["width"] <= 12 * 16 + 2, f"{where}: the label column stays narrow"
    _assert_fits(page, geometry, where)
