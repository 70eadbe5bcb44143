"""The Launch page in Chromium: a bad value is shown at its field and YAML line while typing, before any submit;
fixed, the run launches and the browser lands on its page; a viewer cannot launch."""

from __future__ import annotations

import re

import yaml

from forgeboard.experiments.models import Experiment
from forgeboard.runs.models import Run
from tests.e2e.conftest import login, screenshot
from tests.support.processes import wait_for


def _line_of(text: str, needle: str) -> int:
    return next(n for n, line in enumerate(text.split("\n"), start=1) if needle in line)


def test_member_sees_a_bad_value_at_its_line_fixes_it_and_launches(page, server, team, demo_model):
    login(page, server, "mateo")
    page.goto(f"{server['url']}/p/alpha/launch/")
    editor, button = page.locator("#config_yaml"), page.locator("#launch-button")
    # The first experiment is GRPO: its demo preset starts from the SFT demo's export, which this project lacks
    page.locator('#config-errors li[data-field="model.artifact"]').wait_for(timeout=30_000)
    assert page.locator("#preset-needs-sft").is_visible() and button.is_disabled()
    assert page.get_by_role("button", name="Launch the SFT demo").is_visible()

    page.locator("#experiment").select_option("new")
    page.locator("#new_name").fill("sft-from-browser")
    page.locator("#new_recipe").select_option("sft")
    page.locator("#preset").select_option("cpu_demo_sft")
    text = editor.input_value()
    assert yaml.safe_load(text)["model"]["path"] == str(demo_model) and text.startswith("# CPU demo, part 1")
    line = _line_of(text, "  steps: 240")

    editor.fill(text.replace("  source: arithmetic", "  source: csv"))  # an input event, as typing gives
    source = page.locator('#config-errors li[data-field="data.source"]')
    source.wait_for(timeout=10_000)
    assert source.inner_text().startswith(f"data.source (line {_line_of(text, 'source: arithmetic')}): ")
    assert "allowed: arithmetic, jsonl" in source.inner_text()  # the JSON Schema's choices, offered as a hint

    editor.fill(text.replace("  steps: 240", "  steps: 0"))
    problem = page.locator('#config-errors li[data-field="trainer.steps"]')
    problem.wait_for(timeout=10_000)
    assert problem.inner_text().startswith(f"trainer.steps (line {line}): Input should be greater than or equal to 1")
    assert "≥ 1" in problem.inner_text()  # the JSON Schema's bound, offered as a hint
    assert editor.get_attribute("aria-invalid") == "true" and button.is_disabled()
    assert page.locator("#config-gutter div.bad").all_inner_texts() == [str(line)]
    screenshot(page, "launch_invalid_field")
    problem.click()  # puts the cursor on the line
    selected = editor.evaluate("e => e.value.slice(e.selectionStart, e.selectionEnd)")
    assert selected == "  steps: 0"
    # The line numbers scroll with the text and are no taller than the editor.
    scrolled = editor.evaluate("""e => { e.scrollTop = 120; e.dispatchEvent(new Event('scroll'));
        const g = document.getElementById('config-gutter');
        return [e.scrollTop, g.scrollTop, e.getBoundingClientRect().height, g.getBoundingClientRect().height]; }""")
    assert scrolled[0] > 0 and scrolled[1] == scrolled[0] and abs(scrolled[2] - scrolled[3]) <= 2, scrolled
    assert Run.objects.count() == 0 and not Experiment.objects.filter(name="sft-from-browser").exists()

    editor.fill(text.replace("  steps: 240", "  steps: 3"))
    page.wait_for_function("document.getElementById('config-status').textContent === 'Config is valid.'")
    assert editor.get_attribute("aria-invalid") == "false" and not button.is_disabled()
    assert page.locator("#config-errors li").count() == 0 and page.locator("#config-gutter div.bad").count() == 0
    page.locator("#overrides").fill("trainer.batch_size=4\ntrainer.micro_batch_size=4\ndata.eval_size=8\n"
                                    "telemetry.console=false")
    page.wait_for_function("document.getElementById('config-status').textContent === 'Config is valid.'")
    screenshot(page, "launch_valid")
    button.click()

    page.wait_for_url(re.compile(r"/runs/\d+/$"), timeout=30_000)
    run = Run.objects.get(experiment__name="sft-from-browser")
    assert page.url == f"{server['url']}/runs/{run.pk}/"
    assert run.launched_by == team.member and run.experiment.recipe == "sft"
    assert run.config.parsed["trainer"]["steps"] == 3 and run.config.parsed["model"]["path"] == str(demo_model)
    assert run.config.overrides == ["trainer.batch_size=4", "trainer.micro_batch_size=4", "data.eval_size=8",
                                    "telemetry.console=false"]
    wait_for(lambda: Run.objects.get(pk=run.pk).state in ("succeeded", "failed"), timeout=180, what="the run ends")
    run.refresh_from_db()
    assert run.state == "succeeded", run.exit_reason
    # The page watched it over the websocket: chart points arrived and the badge followed the state.
    page.wait_for_function("Number(document.querySelector('figure.chart[data-key=\"loss\"]')?.dataset.points) >= 3",
                           timeout=30_000)
    page.wait_for_function("document.getElementById('run-state').dataset.state === 'succeeded'", timeout=30_000)
    screenshot(page, "launch_landed_on_run_page")


def test_a_launch_that_reaches_the_server_twice_starts_one_run_and_says_so(page, server, team, demo_model):
    """The Launch button's POST arrives twice (sent again after its answer was lost, as a proxy or a second click
    sends it): one run starts, and the browser lands on it with a note that the form was already sent."""
    login(page, server, "mateo")
    page.goto(f"{server['url']}/p/alpha/launch/")
    page.locator("#experiment").select_option("new")
    page.locator("#new_name").fill("sent-twice")
    page.locator("#new_recipe").select_option("sft")
    page.locator("#preset").select_option("cpu_demo_sft")
    page.locator("#overrides").fill("trainer.steps=2\ntelemetry.console=false")
    page.wait_for_function("document.getElementById('config-status').textContent === 'Config is valid.'")
    answers: list[tuple[int, str | None]] = []

    def send_twice(route):
        for _ in range(2):
            response = route.fetch(max_redirects=0)
            answers.append((response.status, response.headers.get("idempotent-replayed")))
        route.fulfill(response=response)

    page.route("**/p/alpha/launch/", send_twice)
    page.locator("#launch-button").click()
    page.wait_for_url(re.compile(r"/runs/\d+/$"), timeout=30_000)
    run = Run.objects.get(experiment__name="sent-twice")
    assert page.url == f"{server['url']}/runs/{run.pk}/"
    assert answers == [(302, None), (302, "true")]
    note = page.get_by_text("This form was already sent")
    assert note.is_visible() and note.bounding_box()["height"] > 0
    screenshot(page, "launch_sent_twice")


def test_viewer_cannot_launch(page, server, team):
    login(page, server, "vera")
    page.goto(f"{server['url']}/p/alpha/launch/")
    notice = page.locator("#viewer-notice")
    assert notice.is_visible() and "Viewers cannot launch runs" in notice.inner_text()
    assert page.locator("#launch-button").is_disabled() and page.locator("#config_yaml").is_disabled()
    assert page.get_by_role("button", name="Launch").is_disabled()
    screenshot(page, "launch_viewer")

    # A forged submit (controls re-enabled by hand) is refused with the reason, and nothing is stored.
    with page.expect_navigation():
        page.evaluate("""() => {
            document.querySelector('fieldset.launch-fields').disabled = false;
            document.getElementById('launch-form').submit();
        }""")
    assert page.locator("h1").inner_text() == "Not allowed"
    assert "launching runs needs the member role; you are a viewer" in page.locator("p.error").inner_text()
    assert Run.objects.count() == 0
