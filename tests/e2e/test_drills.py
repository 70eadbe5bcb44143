"""Fault drills from the run page of a multi-process (Monarch) run: the operator confirms one, the engine injects it,
and the page shows what happened. A GRPO run takes a generator kill (injection, detection, recovery in the timeline)
and then a nan_gradients drill on its trainer (the skipped step's message and chart point, the recovery after one
skipped update, training going on); the drill form offers nan_gradients for the trainer alone, and the server's
refusal of any other role is shown next to the form."""

from __future__ import annotations

import re

from django.db import transaction
from django.utils import timezone

from forgeboard.runs.models import Command, Run
from forgeboard.runs.services import run_cancel, run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import MetricPoint, RunEvent
from tests.e2e.conftest import login, screenshot
from tests.support.processes import wait_for

LOSS_POINTS = "Number(document.querySelector('figure.chart[data-key=\"loss\"]')?.dataset.points)"


def _monarch_grpo_yaml(model, *, steps: int = 2000) -> str:  # noqa: ANN001 - a Path
    return f"""\
recipe: grpo
model: {{family: qwen3, path: {model}}}
data: {{source: arithmetic, max_operand: 9, eval_size: 8, seq_len: 128}}
generator: {{max_new_tokens: 4, replicas: 2, routing: round_robin}}
trainer: {{steps: {steps}, batch_size: 4, micro_batch_size: 8, threads_per_process: 1}}
grpo: {{group_size: 4}}
eval: {{every_steps: 0}}
checkpoint: {{every_steps: 0}}
placement: {{backend: monarch}}
failover: {{call_timeout_s: 20}}
telemetry: {{console: false, flush_seconds: 0.3}}
"""


def _inject(page, *, kind: str, role: str, replica: int) -> None:
    """The operator fills the drill form, confirms, and sees it sent."""
    drill = page.locator('form[data-command="fault_drill"]')
    drill.locator('select[name="payload.kind"]').select_option(kind)
    drill.locator('select[name="payload.role"]').select_option(role)
    drill.locator('input[name="payload.replica"]').fill(str(replica))
    before = page.locator("#command-status").inner_text()  # an earlier drill's "sent" until this one's
    page.once("dialog", lambda dialog: dialog.accept())
    drill.get_by_role("button", name="Inject").click()
    page.wait_for_function("before => { const said = document.getElementById('command-status').textContent;"
                           " return said.includes('fault drill sent') && said !== before; }", arg=before)


def _line(page, kind: str, text: str, *, timeout: int = 120_000):
    """The timeline's line of this event kind that says `text`, once it is shown."""
    line = page.locator(f'#timeline li[data-kind="{kind}"]', has_text=text).first
    line.wait_for(state="visible", timeout=timeout)
    return line


def test_drills_from_the_page_show_their_recovery_in_the_timeline(page, server, team, tiny_model):
    """One run takes both drills (one Monarch start-up, not two): a generator kill, then, once it recovered, NaN
    gradients on the trainer. steps: the run trains about 15 steps a second here and must outlast both drills."""
    run = run_launch(actor=team.member, experiment=team.experiment,
                     config_yaml=_monarch_grpo_yaml(tiny_model, steps=100_000))
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function(f"{LOSS_POINTS} >= 2", timeout=240_000)

    _inject(page, kind="kill", role="generator", replica=0)
    for kind in ("fault_injected", "failure_detected", "recovered"):
        page.wait_for_selector(f'#timeline li[data-kind="{kind}"]', timeout=120_000)
    recovered = page.locator('#timeline li[data-kind="recovered"]').first.inner_text()
    assert "recovered generator" in recovered and " s" in recovered
    screenshot(page, "run_page_drill_recovered")

    assert RunEvent.objects.filter(run=run, kind="fault_injected").count() == 1
    assert RunEvent.objects.filter(run=run, kind="failure_detected").count() == 1
    assert RunEvent.objects.filter(run=run, kind="recovered").count() == 1
    wait_for(lambda: Command.objects.get(run=run, kind="fault_drill").state == "succeeded", timeout=60,
             what="the drill command succeeded")
    assert Run.objects.get(pk=run.pk).state == "running", "training goes on after the recovery"

    _see_a_nan_gradients_drill_skip_one_update(page, run)
    run_cancel(actor=team.member, run=run)
    wait_for(lambda: Run.objects.get(pk=run.pk).state == "cancelled", timeout=120, what="cancelled")


def _see_a_nan_gradients_drill_skip_one_update(page, run: Run) -> None:
    """NaN gradients on trainer 0: the injection, the step whose update was skipped (message and chart point at 1),
    the recovery after one skipped update, and more loss points after it; no trainer fails."""
    _inject(page, kind="nan_gradients", role="trainer", replica=0)
    injected = _line(page, "fault_injected", "nan_gradients").inner_text()
    assert "nan_gradients on trainer 0: its next update is skipped" in injected, injected
    skipped = _line(page, "message", "were NaN or infinite").inner_text()
    step = int(re.search(r"the gradients of step (\d+) were NaN or infinite: its update was skipped", skipped)[1])
    assert "(1 in a row; trainer.max_skipped_updates 3 in a row end the run)" in skipped, skipped
    recovered = _line(page, "recovered", "skipped update")
    assert re.search(r"recovered trainer 0 in \d+\.\d\d s, after 1 skipped update$", recovered.inner_text()), \
        recovered.inner_text()
    timeline = page.locator("#timeline")
    recovered_box, timeline_box = recovered.bounding_box(), timeline.bounding_box()
    assert recovered_box["height"] > 10 and recovered_box["width"] > 200
    assert timeline_box["x"] <= recovered_box["x"] and \
        recovered_box["x"] + recovered_box["width"] <= timeline_box["x"] + timeline_box["width"] + 0.5, \
        "the recovery line is not cut off at the side"
    seqs = {kind: int(_line(page, kind, text).get_attribute("data-seq")) for kind, text in
            (("fault_injected", "nan_gradients"), ("message", "were NaN"), ("recovered", "skipped update"))}
    assert seqs["fault_injected"] < seqs["message"] < seqs["recovered"], f"shown in the order they happened: {seqs}"
    recovered.scroll_into_view_if_needed()
    screenshot(page, "run_page_nan_gradients_recovered")

    # The chart of skipped updates (drawn by default, far down the grid), found as a person would with the chart
    # filter, zoomed around the step (the live data no longer moves it), and read under the cursor at that step.
    chart = page.locator('figure.chart[data-key="train/update_skipped"]')
    assert chart.is_visible(), "the chart is drawn without asking for it"
    page.locator("#chart-filter").fill("update_skipped")
    assert page.locator("#charts figure.chart:not([hidden])").count() == 1, "the filter leaves this chart alone"
    plot = "FBRunPage.grid.charts.get('train/update_skipped').plot"
    page.wait_for_function(f"step => {plot}.data[0].includes(step)", arg=step, timeout=30_000)
    chart.scroll_into_view_if_needed()
    over = chart.locator(".u-over").bounding_box()
    left, right = (page.evaluate(f"step => {plot}.valToPos(step, 'x')", s) for s in (step - 60, step + 20))
    page.mouse.move(over["x"] + left, over["y"] + over["height"] / 2)
    page.mouse.down()
    page.mouse.move(over["x"] + right, over["y"] + over["height"] / 2, steps=5)
    page.mouse.up()
    assert chart.get_attribute("data-zoomed") == "true"
    x, y = page.evaluate(f"step => [{plot}.valToPos(step, 'x'), {plot}.valToPos(1, 'y')]", step)
    scale = page.evaluate(f"[{plot}.scales.x.min, {plot}.scales.x.max, {plot}.data[0][0], {plot}.data[0].at(-1)]")
    assert 0 <= x <= over["width"] and 0 <= y <= over["height"], \
        f"the point ({x}, {y}) is inside the plot {over}; dragged {left}..{right}; x scale and data {scale}"
    page.mouse.move(over["x"] + x, over["y"] + y)
    rows = chart.locator(".u-legend .u-series")
    wait_for(lambda: rows.nth(0).locator(".u-value").inner_text() == str(step), timeout=10,
             what=f"the cursor on step {step}")
    assert rows.nth(1).locator(".u-value").inner_text() == "1", "the skipped step's point is at 1"
    screenshot(page, "run_page_update_skipped_chart")
    page.locator("#chart-filter").fill("")

    assert MetricPoint.objects.get(series__run=run, series__key="train/update_skipped", step=step).value == 1
    assert MetricPoint.objects.filter(series__run=run, series__key="train/update_skipped", value=1).count() == 1
    points = int(page.locator('figure.chart[data-key="loss"]').get_attribute("data-points"))
    page.wait_for_function(f"{LOSS_POINTS} >= {points + 5}", timeout=60_000)
    nan = RunEvent.objects.get(run=run, kind="recovered", payload__fault_kind="nan_gradients").payload
    assert (nan["step"], nan["skipped_updates"], nan["role"], nan["replica"]) == (step + 1, 1, "trainer", 0), nan
    assert not RunEvent.objects.filter(run=run, kind="failure_detected", payload__role="trainer").exists()
    wait_for(lambda: not Command.objects.filter(run=run, kind="fault_drill").exclude(state="succeeded").exists(),
             timeout=60, what="both drill commands succeeded")
    assert Run.objects.get(pk=run.pk).state == "running", "training goes on after one skipped update"


def test_the_drill_form_offers_nan_gradients_for_the_trainer_alone_and_shows_the_servers_refusal(page, server, team,
                                                                                               tiny_model):
    """No engine: a Monarch GRPO run marked running shows the drill form, and the server checks what it is sent."""
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=_monarch_grpo_yaml(tiny_model))
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, started_at=timezone.now())
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    drill = page.locator('form[data-command="fault_drill"]')
    kind, role = drill.locator('select[name="payload.kind"]'), drill.locator('select[name="payload.role"]')
    enabled = "select => Array.from(select.options).filter((o) => !o.disabled).map((o) => o.value)"
    assert role.evaluate(enabled) == ["generator", "trainer", "reference", "reward"]

    # Each kind's words fit the select when picked: measured in its font against its box less padding and arrow.
    cut = kind.evaluate("""select => { const style = getComputedStyle(select);
        const context = document.createElement('canvas').getContext('2d'); context.font = style.font;
        const room = select.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight) - 16;
        return Array.from(select.options).filter((o) => context.measureText(o.text).width > room).map((o) => o.text); }""")
    assert cut == [], f"cut off in the drill form's Kind: {cut}"

    role.select_option("generator")
    kind.select_option("nan_gradients")
    assert role.input_value() == "trainer", "picking nan_gradients moves the role to the trainer"
    assert role.evaluate(enabled) == ["trainer"], "and leaves no other role to pick"
    kind.select_option("kill")
    assert role.evaluate(enabled) == ["generator", "trainer", "reference", "reward"], "every role again for a kill"

    # A page whose guard is gone (an older page, or one edited in the browser) sends what the server refuses.
    kind.select_option("nan_gradients")
    role.evaluate("select => { Array.from(select.options).forEach((o) => { o.disabled = false; });"
                  " select.value = 'generator'; }")
    page.once("dialog", lambda dialog: dialog.accept())
    drill.get_by_role("button", name="Inject").click()
    status = page.locator("#command-status")
    page.wait_for_function("document.getElementById('command-status').classList.contains('error')", timeout=15_000)
    assert status.inner_text() == ("payload.role: kind 'nan_gradients' applies only to the trainer (a rank's gradients), "
                                   "not the generator"), status.inner_text()
    assert status.is_visible()
    status_box, form_box = status.bounding_box(), drill.bounding_box()
    assert 0 <= form_box["y"] - (status_box["y"] + status_box["height"]) < 40, (status_box, form_box)
    assert status_box["x"] <= form_box["x"] + form_box["width"] and form_box["x"] <= status_box["x"] + status_box["width"]
    colour = "element => getComputedStyle(element).color"
    assert status.evaluate(colour) != page.locator("#controls-h").evaluate(colour), "said in the error colour"
    drill.scroll_into_view_if_needed()
    screenshot(page, "run_page_nan_gradients_refused")
    assert Command.objects.filter(run=run).count() == 0, "nothing stored"
    assert page.locator("#commands-empty").is_visible()


def _monarch_sft_yaml(model) -> str:  # noqa: ANN001 - a Path
    return f"""\
recipe: sft
model: {{family: qwen3, path: {model}}}
data: {{source: arithmetic, max_operand: 9, eval_size: 8, seq_len: 128}}
trainer: {{steps: 2000, batch_size: 8, micro_batch_size: 4, threads_per_process: 1, ranks: 2, recover_failures: 2}}
eval: {{every_steps: 0}}
checkpoint: {{every_steps: 5}}
placement: {{backend: monarch}}
failover: {{call_timeout_s: 20}}
telemetry: {{console: false, flush_seconds: 0.3}}
"""


def test_a_trainer_drill_on_a_two_rank_sft_run_restores_it_and_training_goes_on(page, server, team, tiny_model):
    from forgeboard.experiments.services import experiment_create

    experiment = experiment_create(actor=team.owner, project=team.project, name="warm-start", recipe="sft")
    run = run_launch(actor=team.member, experiment=experiment, config_yaml=_monarch_sft_yaml(tiny_model))
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("Number(document.querySelector('figure.chart[data-key=\"loss\"]')?.dataset.points) >= 6",
                           timeout=240_000)
    assert page.locator('form[data-command="placement_change"]').count() == 0
    assert page.locator("#placement-note").is_visible()
    assert "only its 2 trainer ranks" in page.locator("#placement-note").inner_text()

    drill = page.locator('form[data-command="fault_drill"]')
    assert drill.locator('select[name="payload.role"] option').all_inner_texts() == ["trainer"]
    drill.locator('select[name="payload.kind"]').select_option("kill")
    drill.locator('input[name="payload.replica"]').fill("1")
    page.once("dialog", lambda dialog: dialog.accept())
    drill.get_by_role("button", name="Inject").click()
    page.wait_for_function("document.getElementById('command-status').textContent.includes('fault drill sent')")

    for kind in ("fault_injected", "failure_detected", "recovered"):
        page.wait_for_selector(f'#timeline li[data-kind="{kind}"]', timeout=120_000)
    recovered = page.locator('#timeline li[data-kind="recovered"]').first.inner_text()
    assert "recovered trainer" in recovered
    points = int(page.locator('figure.chart[data-key="loss"]').get_attribute("data-points"))
    page.wait_for_function("Number(document.querySelector('figure.chart[data-key=\"loss\"]')?.dataset.points) >= "
                           f"{points + 3}", timeout=120_000)
    screenshot(page, "run_page_sft_trainer_drill_recovered")

    actions = [e.payload.get("action") for e in RunEvent.objects.filter(run=run, kind="recovered")]
    assert actions == ["restored_checkpoint"]
    assert RunEvent.objects.filter(run=run, kind="replica_replaced").get().payload["role"] == "trainer"
    assert Run.objects.get(pk=run.pk).state == "running", "training goes on after the restore"
    run_cancel(actor=team.member, run=run)
    wait_for(lambda: Run.objects.get(pk=run.pk).state == "cancelled", timeout=120, what="cancelled")
