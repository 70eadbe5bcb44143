"""A Monarch GRPO run whose trainer generates (generator.in_trainer), seen on its run page: its loss chart grows, its
step timeline has no generator lane and shows the trainer's rank generating before it trains, and its controls offer
no generator to drill or place."""

from __future__ import annotations

import re

from forgeboard.runs.models import Run
from forgeboard.runs.services import run_cancel, run_launch
from tests.e2e.conftest import login, screenshot
from tests.e2e.test_drills import _monarch_grpo_yaml
from tests.support.processes import wait_for


def _in_trainer_yaml(model) -> str:  # noqa: ANN001 - a Path
    """The drill test's Monarch GRPO run, its generator in the trainer."""
    two_replicas = "generator: {max_new_tokens: 4, replicas: 2, routing: round_robin}"
    yaml = _monarch_grpo_yaml(model)
    assert two_replicas in yaml
    return yaml.replace(two_replicas, "generator: {max_new_tokens: 4, in_trainer: true}")


def test_the_page_of_a_run_generating_in_its_trainer_draws_the_ranks_generation_and_offers_no_generator(
        page, server, team, tiny_model):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=_in_trainer_yaml(tiny_model))
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("Number(document.querySelector('figure.chart[data-key=\"loss\"]')?.dataset.points) >= 3",
                           timeout=240_000)
    page.wait_for_function("() => window.FBRunPage && FBRunPage.timeline && FBRunPage.timeline.geometry().steps.length >= 2",
                           timeout=60_000)
    geometry = page.evaluate("FBRunPage.timeline.geometry()")
    lanes = [lane["name"] for lane in geometry["lanes"]]
    assert "trainer 0" in lanes and "reward" in lanes, lanes
    assert not [lane for lane in lanes if lane.startswith("generator")], lanes
    step = geometry["steps"][-1]
    boxes = {span["phase"]: span["box"] for span in geometry["spans"] if span["lane"] == "trainer 0" and span["step"] == step}
    assert {"generate", "forward_backward"} <= set(boxes), boxes
    assert boxes["generate"]["width"] > 1 and boxes["forward_backward"]["width"] > 1, boxes
    assert boxes["generate"]["right"] <= boxes["forward_backward"]["left"] + 1, "the rank generates, then trains"

    facts = page.locator("#placement-h + dl.facts")
    assert "0 (the trainer generates)" in facts.inner_text()
    drill_roles = page.locator('form[data-command="fault_drill"] select[name="payload.role"] option').all_inner_texts()
    placed_roles = page.locator('form[data-command="placement_change"] select[name="payload.role"] option').all_inner_texts()
    assert drill_roles == ["trainer", "reference", "reward"] and placed_roles == ["reward", "reference"]
    # the start-up events read as sentences, not as their JSON payload
    lines = page.locator("#timeline li:not([hidden])").all_inner_texts()
    ready = [line for line in lines if " procs ready in " in line]
    assert len(ready) == 1 and "1 trainer rank on " in ready[0] and ready[0].endswith("; the trainer generates"), lines
    assert any(" data arithmetic: " in line and "training problems, 8 held out" in line for line in lines), lines
    assert not [line for line in lines if "{" in line], lines
    screenshot(page, "run_page_generator_in_trainer")
    page.locator("#timeline-all").check()  # the rollouts too: a sample of each step, prompt and completion quoted
    rollouts = page.locator("#timeline li.ev-rollout").all_inner_texts()
    assert rollouts and all(re.search(r' rollout step \d+, policy version \d+: "\d\+\d=" → ".*", reward [\d.]+$', line)
                            for line in rollouts[:5]), rollouts[:5]

    run_cancel(actor=team.member, run=run)
    wait_for(lambda: Run.objects.get(pk=run.pk).state == "cancelled", timeout=120, what="cancelled")
