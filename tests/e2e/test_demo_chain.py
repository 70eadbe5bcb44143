"""The demo's story in a browser: the SFT demo run, then GRPO from its export (a real worker, the real engine and
exporter, the example configs as they are); the GRPO run's held-out reward chart ends higher than it starts; and a
checkpoint opens the launch form for another recipe with the checkpoint as the starting model."""

from __future__ import annotations

import pytest

from forgeboard.runs.demo import GRPO_METRIC, Phase, demo_chain_advance, demo_chain_summary, demo_seed, demo_sft_launch
from forgeboard.runs.models import Run
from tests.e2e.conftest import screenshot
from tests.support.processes import wait_for

CHAIN_TIMEOUT_S = 600


def _chain(user):
    chain = demo_chain_advance(actor=user)
    return chain if chain.finished else None


@pytest.mark.timeout(CHAIN_TIMEOUT_S + 180)
def test_the_demo_chain_ends_with_the_grpo_reward_rising_on_its_page(page, server, demo_model):
    user, _ = demo_seed(username="demo", password="forgeboard-demo")
    sft = demo_sft_launch(actor=user)
    assert sft is not None
    chain = wait_for(lambda: _chain(user), timeout=CHAIN_TIMEOUT_S, interval=2, what="the demo chain to end")
    line = demo_chain_summary(chain)
    print(line)
    assert chain.phase == Phase.DONE, line
    grpo = chain.grpo
    assert grpo.parent_id == sft.pk and grpo.experiment.name == "arithmetic-grpo"

    page.goto(f"{server['url']}/login/")
    page.get_by_label("Username").fill("demo")
    page.get_by_label("Password").fill("forgeboard-demo")
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{server['url']}/")

    page.goto(f"{server['url']}/runs/{grpo.pk}/")
    page.wait_for_function("key => { const c = window.FBRunPage && window.FBRunPage.grid.charts.get(key);"
                           " return c && c.plot.data[0].length > 2; }", arg=GRPO_METRIC, timeout=90_000)
    xs, ys = page.evaluate("key => { const d = window.FBRunPage.grid.charts.get(key).plot.data;"
                           " return [Array.from(d[0]), Array.from(d[1])]; }", GRPO_METRIC)
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    assert points[0][0] == 0 and points[-1][0] == grpo.config.parsed["trainer"]["steps"], points
    assert points[-1][1] > points[0][1], f"the held-out reward did not rise: {points}"
    page.locator(f'figure.chart[data-key="{GRPO_METRIC}"]').scroll_into_view_if_needed()
    screenshot(page, "demo-chain-grpo-run")

    # any checkpoint starts any recipe: the SFT run's last checkpoint opens the launch form for GRPO
    page.goto(f"{server['url']}/runs/{sft.pk}/")
    page.locator("#checkpoints tr", has_text=f"step_{chain.step:06d}").get_by_role(
        "link", name="Choose recipe and config").click()
    page.wait_for_selector("#from-checkpoint")
    grpo_experiment = grpo.experiment
    page.locator("#experiment").select_option(str(grpo_experiment.pk))
    editor = page.locator("#config_yaml")
    wait_for(lambda: "# CPU demo, part 2" in editor.input_value(), timeout=10, what="the GRPO preset")
    assert f"model.artifact=run:{sft.pk}@step:{chain.step}" in page.locator("#overrides").input_value()
    page.wait_for_selector("#config-status.ok", timeout=15_000)
    assert page.locator("#preset-needs-sft").count() == 0
    screenshot(page, "demo-chain-checkpoint-launch-form")
    page.get_by_role("button", name="Launch").click()
    page.wait_for_url(lambda url: "/runs/" in url and f"/runs/{sft.pk}/" not in url, timeout=30_000)
    child = Run.objects.filter(parent=sft).order_by("-pk").first()
    assert child.pk != grpo.pk and child.experiment == grpo_experiment
    assert child.config.parsed["model"]["artifact"] == f"run:{sft.pk}@step:{chain.step}"
    assert page.url.endswith(f"/runs/{child.pk}/")
