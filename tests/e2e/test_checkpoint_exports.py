"""The run page's checkpoints table says how each checkpoint's export stands, a lost and re-queued one included."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from django.db import connection, transaction
from django.utils import timezone
from playwright.sync_api import expect

from forgeboard.cluster.models import Host
from forgeboard.runs import checkpoints
from forgeboard.runs.checkpoints import checkpoint_export_queued, checkpoint_export_request
from forgeboard.runs.models import CheckpointExport, Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from tests.e2e.conftest import login, outside_the_browser_loop, screenshot
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


def _exporter(tmp_path) -> tuple[tuple[str, ...], object, object]:
    """The engine's exporter as a script (the subprocess is this machine's edge): it waits until the test touches
    `go`, then fails with a reason if `fail` is there, else writes a Hugging Face folder."""
    go, fail = tmp_path / "go", tmp_path / "fail"
    script = (f'while [ ! -e "{go}" ]; do sleep 0.05; done; '
              f'if [ -e "{fail}" ]; then echo "no space left on the export disk" >&2; exit 3; fi; '
              'mkdir -p "$5" && echo "{}" > "$5/config.json" && : > "$5/model.safetensors"')
    return ("sh", "-c", script, "exporter"), go, fail


def test_the_export_column_follows_an_export_from_queued_to_done_or_failed_without_a_reload(
        page, server, team, tmp_path, monkeypatch):
    """The export's task moves it on (running, then exported or failed) while the page is open: the Export column
    says so as it happens, and the timeline tells each change."""
    with transaction.atomic():
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_GRPO_YAML)
        Run.objects.filter(pk=run.pk).update(state=RunState.SUCCEEDED, started_at=timezone.now(),
                                             finished_at=timezone.now(), allocation={"gpu-far": {"gpus": 1}})
    Host.objects.create(hostname="gpu-far", pool="far")  # no worker serves its pool: this test runs the task itself
    for step in (2, 4):
        _write(run_dir(run) / "checkpoints" / f"step_{step:06d}" / STATE_FILE, 1000 * step)
    command, go, fail = _exporter(tmp_path)
    monkeypatch.setattr(checkpoints, "ENGINE_COMMAND", command)

    login(page, server, "mateo")
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function("document.getElementById('conn').textContent === 'live'", timeout=30_000)
    page.evaluate("window.notReloaded = true")
    table = page.locator("#checkpoints")
    table.scroll_into_view_if_needed()

    def export_cell(step: int):
        return table.locator("tbody tr", has=page.locator("td.num", has_text=str(step))).first.locator("td.export")

    expect(export_cell(2)).to_have_text("")
    outside_the_browser_loop(checkpoint_export_request, actor=team.member, run=run, step=2)
    expect(export_cell(2)).to_have_text("queued")
    with ThreadPoolExecutor(max_workers=1) as pool:  # the task, as a worker runs it
        task = pool.submit(_in_a_thread, checkpoint_export_queued, run_id=run.pk, step=2, attempt=1)
        try:
            expect(export_cell(2)).to_have_text("running")
        finally:
            go.touch()
        assert task.result(timeout=60).state == "done"
    expect(export_cell(2)).to_have_text("exported")

    fail.touch()
    outside_the_browser_loop(checkpoint_export_request, actor=team.member, run=run, step=4)
    expect(export_cell(4)).to_have_text("queued")
    outside_the_browser_loop(checkpoint_export_queued, run_id=run.pk, step=4, attempt=1)
    expect(export_cell(4)).to_have_text(
        f"failed exporting step 4 of run {run.pk} failed (exit 3): no space left on the export disk")
    expect(export_cell(4).locator(".state")).to_be_visible()
    assert page.evaluate("window.notReloaded === true"), "the page was not reloaded"
    told = page.locator("#timeline li").all_inner_texts()
    assert any(text.endswith("export of step 2: exported") for text in told), told
    assert any(text.endswith("export of step 4: running") for text in told), told
    screenshot(page, "checkpoints_export_followed_live")


def _in_a_thread(fn, **kwargs):
    try:
        return fn(**kwargs)
    finally:
        connection.close()
