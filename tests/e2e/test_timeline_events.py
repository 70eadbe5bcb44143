"""The run page's event list: a run's events of an unexpected shape (what a broken or hostile run can send) read as
text, each on its own line, and never stop the lines that come after them, from the backlog or live."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import EventKind
from forgeboard.telemetry.services import event_append
from tests.e2e.conftest import login, outside_the_browser_loop, screenshot
from tests.platform.conftest import TINY_GRPO_YAML

MARKUP = "<img src=x onerror=window.__pwned=1>"
HOSTILE = [
    (EventKind.MESSAGE, {"name": "meshes_ready", "seconds": "soon", "trainer_ranks": MARKUP, "trainer_hosts": "h1",
                         "generator_replicas": [1]}),
    (EventKind.MESSAGE, {"name": "dataset", "task": {"a": 1}, "source": None, "train": None, "held_out": MARKUP}),
    (EventKind.MESSAGE, {"name": "staleness_histogram", "counts": "many"}),
    (EventKind.FAILURE_DETECTED, {"role": "generator", "replica": 0, "reason": 42}),  # threw on .slice before
    (EventKind.PLACEMENT_APPLIED, {"role": MARKUP, "plan": None, "hosts": "h2"}),
    (EventKind.ROLLOUT, {"step": 3, "prompt": MARKUP, "completion": 7, "reward": "high"}),
]


def test_events_of_an_unexpected_shape_read_as_text_and_never_stop_the_list(page, server, team):
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, started_at=timezone.now())
    for kind, payload in HOSTILE:
        event_append(run=run, kind=kind, payload=payload)
    event_append(run=run, kind=EventKind.CHECKPOINT_SAVED, payload={"step": 5})
    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    page.locator("#timeline-all").check()
    lines = page.locator("#timeline li")
    page.wait_for_function("document.querySelectorAll('#timeline li').length >= 8", timeout=15_000)
    texts = lines.all_inner_texts()
    assert any(t.endswith("checkpoint saved checkpoint at step 5") for t in texts), texts
    assert any(" failure detected " in t and '"reason":42' in t for t in texts), "drawn as its JSON, not thrown on"
    assert any(" procs ready in " in t and MARKUP in t and " on h1" in t for t in texts), texts
    assert any(" placement applied " in t and MARKUP + " placed: h2" in t for t in texts), texts
    assert any(t.endswith("policy age of the trained batches: none trained") for t in texts), texts
    assert any(" rollout step 3: " in t and MARKUP in t and "reward high" in t for t in texts), texts
    assert page.locator("#timeline img, #timeline script").count() == 0 and page.evaluate("window.__pwned") is None

    outside_the_browser_loop(event_append, run=run, kind=EventKind.CHECKPOINT_SAVED, payload={"step": 6})
    page.wait_for_function("[...document.querySelectorAll('#timeline li')].some("
                           "(li) => li.innerText.endsWith('checkpoint at step 6'))", timeout=15_000)
    first = lines.first
    assert first.inner_text().endswith("checkpoint at step 6"), "live, newest first"
    box = first.bounding_box()
    assert box and box["height"] > 10 and box["width"] > 200
    page.locator("#timeline").scroll_into_view_if_needed()
    screenshot(page, "run_page_timeline_hostile_events")
