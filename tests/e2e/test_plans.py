"""The what-if planner in Chromium (#18): the Launch page predicts a config's step before it is launched (calibrated
on a run of the project whose telemetry was recorded from a real Monarch run here), one row per scale for the
placement as written and the best split, a refused value said at its field; the suite page shows each stage's
predicted step beside the measured one, the error, and the error over the suite's history."""

from __future__ import annotations

import re

import pytest
from django.db import transaction

from forgeboard.regressions.models import StageResult, SuiteRun
from forgeboard.regressions.services import suite_create, suite_launch, suite_run_refresh
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from tests.e2e.conftest import login, outside_the_browser_loop, screenshot
from tests.platform.test_plans import BENCH_YAML, REPLICAS2, engine_expectation, ingest, recorded
from workers.engine.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-h192-l4", hidden_size=192, num_layers=4,
                           num_heads=4, num_kv_heads=2, intermediate_size=384)


def _finished_run(team, yaml_text: str, overrides: list[str], name: str) -> Run:
    """A run launched and at once marked succeeded (so the worker never starts it), with recorded telemetry."""
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=yaml_text, overrides=overrides)
        Run.objects.filter(pk=run.pk).update(state=RunState.SUCCEEDED)
    outside_the_browser_loop(ingest, run=run, records=recorded(name))
    return run


def _numbers(texts: list[str]) -> list[float]:
    return [float(t.replace(",", "").replace("×", "")) for t in texts]


def test_the_launch_page_predicts_a_step_before_launching(page, server, team, bench_model):
    yaml_text = BENCH_YAML.format(model=bench_model)
    calibration = _finished_run(team, yaml_text, [], "calibrate")
    login(page, server, "mateo")
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{server['url']}/p/alpha/launch/")
    page.locator("#config_yaml").fill(yaml_text)
    page.locator("#overrides").fill("\n".join(REPLICAS2))
    page.locator("#config-status.ok").wait_for(timeout=20_000)  # the launch's own check says it is valid

    page.locator("#plan-device").select_option("cpu")
    page.locator("#plan-gpus").fill("3,12")
    page.locator("#plan-calibration").select_option(str(calibration.pk))
    page.get_by_role("button", name="Predict").click()
    rows = page.locator("#plan-table tbody tr")
    rows.nth(3).wait_for(timeout=20_000)
    assert rows.count() == 4
    assert page.locator("#plan-status").inner_text().startswith("tiny-qwen3-h192-l4 (1.5M parameters); calibration: "
                                                               f"fitted from run {calibration.pk} on cpu")
    predicted, measured = engine_expectation(bench_model, overrides=REPLICAS2)
    configured = page.locator("#plan-configured").inner_text()
    assert f"{predicted:.3f} s a step" in configured and "1 trainer rank x 1 + 2 generators x 1, 3 devices" in configured
    assert abs(predicted - measured) / measured < 0.30
    # one row per scale for the placement as written, one for the best split, with the predicted gain
    assert [rows.nth(i).get_attribute("data-kind") for i in range(4)] == ["as written", "best"] * 2
    assert rows.nth(0).locator("td").nth(0).inner_text() == "3" and rows.nth(2).locator("td").nth(0).inner_text() == "12"
    steps = _numbers([rows.nth(i).locator("td").nth(3).inner_text() for i in range(4)])
    assert all(s > 0 for s in steps) and steps[1] <= steps[0] and steps[3] <= steps[2]
    gains = _numbers([rows.nth(i).locator("td").nth(9).inner_text() for i in (1, 3)])
    assert all(g >= 1.0 for g in gains) and gains[0] == pytest.approx(steps[0] / steps[1], abs=0.01)
    # the table fits its card at this width: nothing sticks out
    card = page.locator("#plan-panel").bounding_box()
    table = page.locator("#plan-table").bounding_box()
    assert table["width"] > 600 and table["x"] + table["width"] <= card["x"] + card["width"] + 1
    page.locator("#plan-panel").scroll_into_view_if_needed()
    screenshot(page, "launch_plan")

    # a scale that holds no split is refused at its field, and the old table goes
    page.locator("#plan-gpus").fill("1")
    page.get_by_role("button", name="Predict").click()
    page.locator("#plan-status.error").wait_for(timeout=10_000)
    assert re.match(r"Cannot predict: gpus\.0: .*greater than or equal to 2", page.locator("#plan-status").inner_text())
    assert page.locator("#plan-table").is_hidden()
    screenshot(page, "launch_plan_refused")


def test_the_suite_page_shows_predicted_beside_measured_and_the_history(page, server, team, bench_model):
    yaml_text = BENCH_YAML.format(model=bench_model)
    checks = [{"name": "step-time", "metric": "time/step_s", "direction": "lower_is_better", "gate": False}]
    spec = {"stages": [
        {"name": "1-replica", "experiment_id": team.experiment.pk, "config_yaml": yaml_text, "checks": checks},
        {"name": "2-replicas", "experiment_id": team.experiment.pk, "config_yaml": yaml_text, "overrides": REPLICAS2,
         "checks": checks}]}
    suite = suite_create(actor=team.member, project=team.project, name="scale-up", spec=spec)
    for _ in range(2):  # two suite runs: a history
        with transaction.atomic():
            suite_run = suite_launch(actor=team.member, suite=suite)
            Run.objects.filter(stage_results__suite_run=suite_run).update(state=RunState.SUCCEEDED)
        for stage, name in zip(suite_run.stages.order_by("id"), ("calibrate", "replicas2")):
            outside_the_browser_loop(ingest, run=stage.run, records=recorded(name))
        outside_the_browser_loop(suite_run_refresh, suite_run=SuiteRun.objects.get(pk=suite_run.pk))
    second = StageResult.objects.filter(suite_run=suite_run, name="2-replicas").get()
    assert second.prediction_error is not None and abs(second.prediction_error) < 0.30

    login(page, server, "vera")  # a viewer reads suites too
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{server['url']}/p/alpha/")
    page.get_by_role("link", name="Regression suites").click()
    page.get_by_role("link", name="scale-up").click()
    stages = page.locator("#stage-table tbody tr")
    assert stages.count() == 2
    first_row, second_row = stages.nth(0), stages.nth(1)
    assert first_row.locator("td.prediction-error").inner_text().strip() == "+0.0%"
    assert second_row.locator("td.predicted").inner_text() == f"{second.predicted_step_s:.4g}"
    assert second_row.locator("td.measured").inner_text() == f"{second.measured_step_s:.4g}"
    assert second_row.locator("td.prediction-error").inner_text().strip() == f"{100 * second.prediction_error:+.1f}%"
    bar = second_row.locator(".error-bar").bounding_box()
    assert bar["width"] == pytest.approx(round(min(1.0, abs(second.prediction_error) / 0.5) * 80), abs=1)
    assert bar["height"] > 4
    history = page.locator("#prediction-history tbody tr")
    assert history.count() == 2
    assert page.locator("#prediction-history thead th").all_inner_texts()[-2:] == ["1-replica", "2-replicas"]
    assert history.nth(0).locator("td").nth(3).inner_text().strip() == f"{100 * second.prediction_error:+.1f}%"
    screenshot(page, "suite_predictions")
