"""A fault drill from the run page of a multi-process (Monarch) GRPO run: the operator confirms it, the
engine kills a generator replica, and the timeline shows the injection, the detection and the recovery."""

from __future__ import annotations

from forgeboard.runs.models import Command, Run
from forgeboard.runs.services import run_cancel, run_launch
from forgeboard.telemetry.models import RunEvent
from tests.e2e.conftest import login, screenshot
from tests.support.processes import wait_for


def _monarch_grpo_yaml(model) -> str:  # noqa: ANN001 - a Path
    return f"""\
recipe: grpo
model: {{family: qwen3, path: {model}}}
data: {{source: arithmetic, max_operand: 9, eval_size: 8, seq_len: 128}}
generator: {{max_new_tokens: 4, replicas: 2, routing: round_robin}}
trainer: {{steps: 2000, batch_size: 4, micro_batch_size: 8, threads_per_process: 1}}
grpo: {{group_size: 4}}
eval: {{every_steps: 0}}
checkpoint: {{every_steps: 0}}
placement: {{backend: monarch}}
failover: {{call_timeout_s: 20}}
telemetry: {{console: false, flush_seconds: 0.3}}
"""


def test_a_drill_from_the_page_shows_its_recovery_in_the_timeline(page, server, team, tiny_model):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=_monarch_grpo_yaml(tiny_model))
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("Number(document.querySelector('figure.chart[data-key=\"loss\"]')?.dataset.points) >= 2",
                           timeout=240_000)

    drill = page.locator('form[data-command="fault_drill"]')
    drill.locator('select[name="payload.kind"]').select_option("kill")
    drill.locator('select[name="payload.role"]').select_option("generator")
    drill.locator('input[name="payload.replica"]').fill("0")
    page.once("dialog", lambda dialog: dialog.accept())
    drill.get_by_role("button", name="Inject").click()
    page.wait_for_function("document.getElementById('command-status').textContent.includes('fault drill sent')")

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
    run_cancel(actor=team.member, run=run)
    wait_for(lambda: Run.objects.get(pk=run.pk).state == "cancelled", timeout=120, what="cancelled")


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
