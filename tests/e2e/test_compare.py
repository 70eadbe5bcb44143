"""The compare and cluster pages in Chromium: both runs' series are drawn with their legends; smoothing keeps
zoom and hidden series; the time axis and only-differences switch work; the cluster shows a host and its run,
and an operator drains it after confirming."""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from forgeboard.cluster.models import Host
from forgeboard.cluster.services import DeviceReport, host_register
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.ingest import telemetry_ingest
from forgeboard.telemetry.services import event_append
from tests.e2e.conftest import login, screenshot
from tests.platform.conftest import TINY_GRPO_YAML
from workers.engine.telemetry_wire import TelemetryBatch

START = 1_700_000_000.0
LOSS = "FBCompare.grid().charts.get('loss')"


def _finished_run(team, *, overrides: list[str], steps: int, scale: float, long_steps: int = 0) -> Run:
    """A run that already ran (the worker skips it: it is not queued once the launch commits), with metrics."""
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML, overrides=overrides)
        Run.objects.filter(pk=run.pk).update(state=RunState.SUCCEEDED, started_at=timezone.now() - timedelta(hours=1),
                                             finished_at=timezone.now())
    metrics = [{"key": key, "step": step, "value": value, "time": START + 2.0 * step}
               for step in range(steps)
               for key, value in (("loss", scale * (1.0 + (-1) ** step * 0.5) / (step + 1)),
                                  ("reward/mean", min(1.0, step / steps * scale)))]
    metrics += [{"key": "tokens_per_s", "step": step, "value": 100.0 + step % 7, "time": START + step}
                for step in range(long_steps)]
    telemetry_ingest(run=run, batches=[TelemetryBatch(seq=1, metrics=metrics)])
    return run


def _chart_keys(page) -> list[str]:
    return page.locator("#compare-charts figure.chart").evaluate_all("figures => figures.map((f) => f.dataset.key)")


def _drag(page, figure, start: float, end: float) -> None:
    """Select an x range on a chart with the mouse (a zoom)."""
    figure.scroll_into_view_if_needed()
    box = figure.locator(".u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * start, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * end, box["y"] + box["height"] / 2, steps=5)
    page.mouse.up()


def test_compare_two_runs(page, server, team):
    a = _finished_run(team, overrides=[], steps=40, scale=1.0, long_steps=1500)
    b = _finished_run(team, overrides=["trainer.optimizer.lr=0.001"], steps=25, scale=2.0)
    login(page, server, "vera")  # a viewer may compare
    page.goto(f"{server['url']}/p/alpha/")  # from the runs list: tick two, compare
    page.get_by_label(f"Compare math #{a.number}").check()
    page.get_by_label(f"Compare math #{b.number}").check()
    page.get_by_role("button", name="Compare selected").click()
    page.wait_for_url(f"{server['url']}/p/alpha/compare/?runs={b.pk}&runs={a.pk}")  # the list is newest first
    assert page.get_by_role("heading", name="Compare 2 runs").is_visible()
    page.goto(f"{server['url']}/p/alpha/compare/?runs={a.pk},{b.pk}")  # a first: the legend order below
    page.wait_for_function("document.getElementById('compare-charts').dataset.state === 'ready'", timeout=30_000)

    # What tells whether the runs learn comes first, as on a run page, with what it means; the rest by name.
    assert _chart_keys(page) == ["reward/mean", "loss", "tokens_per_s"]
    first = page.locator("#compare-charts figure.chart").first
    assert first.locator(".chart-note").inner_text().startswith("Training reward: the mean reward")
    box, last = first.bounding_box(), page.locator('figure.chart[data-key="tokens_per_s"]').bounding_box()
    assert (box["y"], box["x"]) < (last["y"], last["x"]), "the headline chart is drawn first on the page"
    loss = page.locator('figure.chart[data-key="loss"]')
    assert loss.get_attribute("data-runs-drawn") == "2"
    assert loss.get_attribute("data-series-points") == "40,25"
    assert page.locator('figure.chart[data-key="reward/mean"]').get_attribute("data-runs-drawn") == "2"
    legend = loss.locator(".u-legend .u-series")
    assert legend.nth(1).inner_text().startswith(f"math #{a.number}")
    assert legend.nth(2).inner_text().startswith(f"math #{b.number}")

    long = page.locator('figure.chart[data-key="tokens_per_s"]')
    assert long.get_attribute("data-series-points") == "500,0"  # 1500 steps in 500 slices; run b has none
    _drag(page, long, 0.1, 0.6)
    page.wait_for_function("Number(document.querySelector('figure.chart[data-key=\"tokens_per_s\"]')"
                           ".dataset.seriesPoints.split(',')[0]) > 500")  # the zoomed range at full resolution
    assert long.get_attribute("data-zoomed") == "true"

    raw = page.evaluate(f"{LOSS}.plot.data[1].slice(0, 4)")
    _drag(page, loss, 0.1, 0.6)
    zoom = f"(() => {{ const x = {LOSS}.plot.scales.x; return [x.min, x.max]; }})()"
    zoomed = page.evaluate(zoom)
    assert loss.get_attribute("data-zoomed") == "true"
    legend.nth(2).click()  # hide run b
    hidden = f"{LOSS}.plot.series[2].show"
    assert page.evaluate(hidden) is False

    page.locator("#smoothing").fill("0.9")
    page.wait_for_function(f"{LOSS}.plot.data[1][1] !== {raw[1]}")
    smoothed = page.evaluate(f"{LOSS}.plot.data[1].slice(0, 4)")
    assert page.locator("#smoothing-value").inner_text() == "0.90"
    assert smoothed[0] == raw[0] and abs(smoothed[1] - (0.9 * raw[0] + 0.1 * raw[1])) < 1e-9
    assert page.evaluate(zoom) == zoomed, "smoothing keeps the zoom"
    assert page.evaluate(hidden) is False, "smoothing keeps hidden series hidden"
    screenshot(page, "compare_smoothed")

    page.get_by_label("seconds since start").check()
    page.wait_for_function("document.getElementById('compare-charts').dataset.axis === 'time'")
    page.wait_for_function(f"{LOSS}.plot.data[0].length > 0")
    xs = page.evaluate(f"{LOSS}.plot.data[0]")
    assert _chart_keys(page) == ["reward/mean", "loss", "tokens_per_s"], "the new axis's charts keep the order"
    assert xs[0] == 0 and xs[-1] == 2.0 * 39  # seconds since run a's first point, two per step
    assert page.evaluate(hidden) is False, "the time axis keeps hidden series hidden"
    assert page.evaluate(f"{LOSS}.smoothing") == 0.9

    same, changed = page.locator('tr[data-key="model.family"]'), page.locator('tr[data-key="trainer.optimizer.lr"]')
    assert same.is_visible() and changed.is_visible()
    assert not page.locator("#diff-form").get_by_role("button", name="Apply").is_visible(), \
        "with JavaScript the checkbox applies itself: the form's button is put away"
    page.get_by_label("Show only differences").check()
    assert not same.is_visible() and changed.is_visible()
    assert "only=diff" in page.url
    assert changed.locator("td").all_inner_texts() == ["0.0001", "0.001"]
    screenshot(page, "compare_only_differences")
    page.reload()  # the choice is in the URL, and the server applies it
    assert not page.locator('tr[data-key="model.family"]').is_visible()
    assert page.get_by_label("Show only differences").is_checked()


def test_cluster_shows_a_registered_host_and_its_run(page, server, team):
    host_register(actor=team.operator, hostname="gpu-e2e", pool="h200", cpu_count=32, memory_bytes=256 * 1024**3,
                  cpu_utilization=12.0, memory_utilization=40.0,
                  devices=[DeviceReport(kind="gpu", index=0, model="NVIDIA H200", memory_bytes=141 * 1024**3,
                                        utilization=75.0, memory_used_bytes=60 * 1024**3)])
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, host="gpu-e2e", last_heartbeat_at=timezone.now(),
                                             allocation={"gpu-e2e": {"gpus": 1, "slots": 1}})
    login(page, server, "vera")
    page.goto(f"{server['url']}/cluster/")
    host = page.locator('section[data-hostname="gpu-e2e"]')
    assert "pool h200" in host.inner_text() and "NVIDIA H200" in host.inner_text()
    row = host.locator(f'tr[data-run="{run.pk}"]')
    assert row.get_by_role("link", name=f"math #{run.number}").is_visible()
    assert "trainer" in row.inner_text() and "generator" in row.inner_text()
    assert host.locator("form.host-state-form").count() == 0  # not an operator
    screenshot(page, "cluster_viewer")

    page.context.clear_cookies()
    login(page, server, "opal")
    page.goto(f"{server['url']}/cluster/")
    form = page.locator('section[data-hostname="gpu-e2e"] form.host-state-form')
    form.locator('select[name="intent"]').select_option("draining")
    form.locator('input[name="reason"]').fill("maintenance")
    page.once("dialog", lambda dialog: dialog.dismiss())  # declined: nothing changes
    form.get_by_role("button", name="Apply").click()
    assert Host.objects.get(hostname="gpu-e2e").state == "up"
    page.once("dialog", lambda dialog: dialog.accept())
    form.get_by_role("button", name="Apply").click()
    page.wait_for_selector('section[data-hostname="gpu-e2e"][data-state="draining"]')
    assert "gpu-e2e is now draining." in page.locator(".messages").inner_text()
    assert Host.objects.get(hostname="gpu-e2e").state == "draining"
    screenshot(page, "cluster_operator")


def test_a_run_placing_thousands_of_actors_leaves_the_cluster_page_readable(page, server, team):
    """An engine reporting 20,000 actors (18,000 on hosts no agent registered) shows 32 of those hosts and says how
    many more; the registered host lists 64 of its 2,000 actors and the rest as a count."""
    host_register(actor=team.operator, hostname="gpu-big", pool="h200", cpu_count=32, memory_bytes=256 * 1024**3)
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, host="gpu-big", last_heartbeat_at=timezone.now())
    actors = [{"role": "generator", "replica": i, "host": f"ghost-{i:05d}"} for i in range(18_000)]
    actors += [{"role": "trainer", "rank": i, "host": "gpu-big"} for i in range(2_000)]
    event_append(run=run, kind="placement_applied", payload={"actors": actors})
    login(page, server, "mateo")
    page.goto(f"{server['url']}/cluster/")
    assert page.locator("section.unregistered").count() == 32
    more = page.locator("#elsewhere-more")
    assert more.is_visible() and more.inner_text().startswith("and 17968 more hosts outside the inventory")
    row = page.locator(f'section[data-hostname="gpu-big"] tr[data-run="{run.pk}"]')
    assert row.locator(".tag").count() == 64 and "and 1936 more" in row.inner_text()
    assert page.evaluate("document.body.scrollHeight") < 40_000
    screenshot(page, "cluster_many_actors")
