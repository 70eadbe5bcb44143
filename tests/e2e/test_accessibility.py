"""Every page works at laptop and phone widths without sideways scrolling, is keyboard reachable, and its
form controls have names; text contrast on the main surfaces meets WCAG AA (4.5:1)."""

from __future__ import annotations

import pytest

from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from tests.e2e.conftest import login, screenshot

CONTRAST = """(selector) => {
  const lum = (rgb) => { const [r, g, b] = rgb.match(/\\d+/g).slice(0, 3).map(Number).map((c) => {
    c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const background = (el) => { while (el) { const c = getComputedStyle(el).backgroundColor;
    if (c && !c.startsWith("rgba(0, 0, 0, 0)")) return c; el = el.parentElement; } return "rgb(255, 255, 255)"; };
  return Array.from(document.querySelectorAll(selector)).filter((el) => el.offsetParent !== null).map((el) => {
    const [a, b] = [lum(getComputedStyle(el).color), lum(background(el))];
    return { text: el.textContent.trim().slice(0, 40), ratio: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05) };
  });
}"""
UNNAMED = """() => Array.from(document.querySelectorAll('input:not([type=hidden]), select, textarea, button'))
  .filter((el) => el.offsetParent !== null)
  .filter((el) => !(el.labels && el.labels.length) && !el.getAttribute('aria-label') && !el.textContent.trim()
                  && !el.getAttribute('title'))
  .map((el) => el.outerHTML.slice(0, 120))"""


@pytest.fixture
def pages(team, grpo_yaml_monarch):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml_monarch)
    # A launched run's log file (a worker may launch it first, with its own path as long): one unbroken word
    Run.objects.filter(pk=run.pk).update(log_path=f"/var/lib/forgeboard/data/runs/{run.pk}-402a5a989c2d/engine.log")
    return ["/", "/p/alpha/", f"/runs/{run.pk}/", "/p/alpha/launch/", "/cluster/", "/p/alpha/members/",
            "/p/alpha/artifacts/", "/settings/tokens/"]


@pytest.fixture
def grpo_yaml_monarch():
    from tests.platform.conftest import TINY_MONARCH_GRPO_YAML

    return TINY_MONARCH_GRPO_YAML


@pytest.mark.parametrize("width", [1280, 1024, 390])
def test_pages_fit_the_width_and_name_their_controls(page, server, team, pages, width):
    page.set_viewport_size({"width": width, "height": 800})
    login(page, server, "mateo")
    for path in pages:
        page.goto(f"{server['url']}{path}")
        page.wait_for_load_state("networkidle")
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"{path} scrolls sideways by {overflow}px at {width}px"
        assert page.evaluate(UNNAMED) == [], f"{path} has controls without a name"
        low = [c for c in page.evaluate(CONTRAST, "p, td, th, label, a, h1, h2, dt, dd, .state, button")
               if c["ratio"] < 4.5]
        assert low == [], f"{path} has low-contrast text: {low[:5]}"
        if width == 390:
            screenshot(page, f"narrow{path.strip('/').replace('/', '_') or '_home'}")


def test_the_controls_are_reachable_by_keyboard(page, server, team, pages):
    login(page, server, "mateo")
    page.goto(f"{server['url']}{pages[2]}")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    reached = set()
    for _ in range(80):
        page.keyboard.press("Tab")
        reached.add(page.evaluate("document.activeElement.closest('form')?.dataset.command || ''"))
    assert {"fault_drill", "placement_change", "load_redirect", "run"} <= reached
