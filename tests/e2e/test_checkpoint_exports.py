"""The run page's checkpoints table says how each checkpoint's export stands, a lost and re-queued one included."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from forgeboard.runs.models import CheckpointExport, Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from tests.e2e.conftest import login, screenshot
from tests.platform.conftest import TINY_GRPO_YAML
from workers.engine.checkpoint_folders import STATE_FILE
from workers.launch.local import run_dir


def _write(path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_the_checkpoints_table_tells_a_requeued_export_from_a_fresh_one(page, server, team, settings):
    with transaction.atomic():  # a run that already ran: the worker skips it, it is not queued once this commits
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(state=RunState.SUCCEEDED, started_at=timezone.now(),
                                             finished_at=timezone.now())
    for step in (2, 4, 6, 8):
        _write(run_dir(run) / "checkpoints" / f"step_{step:06d}" / STATE_FILE, 1000 * step)
    _write(run_dir(run) / "exports" / "step_6" / "config.json", 10)
    _write(run_dir(run) / "exports" / "step_6" / "model.safetensors", 10)
    now = timezone.now()
    CheckpointExport.objects.create(run=run, step=2, state="queued", attempt=2, requeues=1, requested_by="user:mateo",
                                    updated_at=now)
    CheckpointExport.objects.create(run=run, step=4, state="queued", requested_by="user:mateo", updated_at=now)

    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    table = page.locator("#checkpoints")
    table.scroll_into_view_if_needed()
    cells = {step: table.locator("tbody tr", has=page.locator("td.num", has_text=str(step))).first.locator("td.export")
             for step in (2, 4, 6, 8)}
    requeues = settings.EXPORT_REQUEUES
    assert cells[2].inner_text() == f"queued again after it was lost (requeue 1 of {requeues})"
    assert cells[4].inner_text() == "queued"
    assert cells[6].inner_text() == "exported"
    assert cells[8].inner_text() == ""
    section = page.locator("section[aria-labelledby='checkpoints-h']").bounding_box()
    for words in (cells[2].locator(".state"), cells[2].locator(".muted"), cells[4].locator(".state")):
        box = words.bounding_box()
        assert box["width"] > 0 and box["height"] > 0, "the words are shown"
        assert section["x"] <= box["x"] and box["x"] + box["width"] <= section["x"] + section["width"], \
            "inside the card, not cut off at its edge"
    size = table.locator("tbody tr").first.locator("td.num").nth(1)
    lines = size.evaluate("td => { const r = document.createRange(); r.selectNodeContents(td); "
                          "return new Set([...r.getClientRects()].map(rect => Math.round(rect.top))).size; }")
    assert (size.inner_text(), lines) == ("2.0 KiB", 1), "a size stays on one line beside the new column"
    buttons = table.get_by_role("button", name="Start a new run from here")
    assert buttons.count() == 4
    last = buttons.nth(0).bounding_box()
    assert last["x"] + last["width"] <= section["x"] + section["width"], "the new column pushes no button out"
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), "no sideways scroll"
    screenshot(page, "checkpoints_export_states")
