"""The demo tells the SFT-then-GRPO story: the SFT demo run, then a GRPO run from its export (parent and child),
the SFT export registered for the GRPO preset, and the start command's line with both runs' held-out figures."""

from __future__ import annotations

import sys
import time
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.core.management import call_command

from forgeboard.artifacts.models import Artifact
from forgeboard.runs import checkpoints
from forgeboard.runs.demo import (
    GRPO_METRIC,
    SFT_METRIC,
    Phase,
    demo_chain_advance,
    demo_chain_summary,
    demo_seed,
    demo_sft_launch,
    demo_sft_model_dir,
)
from forgeboard.runs.models import PendingChildRun, Run
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import MetricPoint, MetricSeries
from tests.platform.test_checkpoints import SUCCEEDING_EXPORTER
from workers.launch.local import run_dir


@pytest.fixture
def demo(db, settings, tmp_path, monkeypatch):
    """The demo seeded in a fresh data folder whose models/ is an artifact root, with its tiny model in place; export
    tasks recorded instead of sent, and a stand-in exporter (the real one is tested in test_checkpoints.py)."""
    from workers.celery import app

    settings.DATA_DIR = tmp_path / "data"
    settings.ARTIFACT_ROOTS = [Path("/"), settings.DATA_DIR / "models"]
    model = settings.DATA_DIR / "models" / "tiny-qwen3"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    sent: list[tuple[str, list, dict]] = []
    monkeypatch.setattr(app, "send_task", lambda name, args, **kw: sent.append((name, args, kw.get("kwargs") or {})))
    exporter = tmp_path / "exporter.py"
    exporter.write_text(SUCCEEDING_EXPORTER)
    monkeypatch.setattr(checkpoints, "ENGINE_COMMAND", (sys.executable, str(exporter)))
    user, created = demo_seed(username="demo", password="forgeboard-demo")
    assert created
    return SimpleNamespace(user=user, sent=sent)


def _work(sent) -> None:
    from workers.tasks import export_checkpoint

    while sent:
        name, args, kwargs = sent.pop(0)
        if name == "checkpoints.export":
            export_checkpoint.apply(args=args, kwargs=kwargs)


def _finish(run: Run, *, metric: str, values: dict[int, float]) -> None:
    """What the engine would have reported: the run succeeded with these held-out figures."""
    Run.objects.filter(pk=run.pk).update(state=RunState.SUCCEEDED)
    series = MetricSeries.objects.create(run=run, key=metric, point_count=len(values), first_step=min(values),
                                         last_step=max(values), last_value=values[max(values)])
    MetricPoint.objects.bulk_create(MetricPoint(series=series, step=s, value=v, wall_time=time.time())
                                    for s, v in values.items())


def test_the_demo_chain_runs_sft_then_grpo_from_its_export(demo, django_capture_on_commit_callbacks):
    assert demo_chain_advance(actor=demo.user).phase == Phase.NONE
    with django_capture_on_commit_callbacks(execute=True):
        sft = demo_sft_launch(actor=demo.user)
    assert sft is not None and sft.config.parsed["trainer"]["steps"] == 240, "the example config, as it is"
    assert sft.config.parsed["model"]["artifact"] == "tiny-qwen3"
    assert demo_sft_launch(actor=demo.user) is None, "one demo chain at a time"
    assert demo_chain_advance(actor=demo.user).phase == Phase.SFT

    for step in (120, 240):
        folder = run_dir(sft) / "checkpoints" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "trainer.pt").write_bytes(b"x")
    _finish(sft, metric=SFT_METRIC, values={0: 0.0, 240: 0.41})
    demo.sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        exporting = demo_chain_advance(actor=demo.user)
    assert (exporting.phase, exporting.step) == (Phase.EXPORTING, 240), "from the last checkpoint"
    with django_capture_on_commit_callbacks(execute=True):
        assert demo_chain_advance(actor=demo.user).phase == Phase.EXPORTING
    assert [name for name, _, _ in demo.sent] == ["checkpoints.export"], "queued once"
    assert [pending.experiment.name for pending in PendingChildRun.objects.filter(parent=exporting.sft)] == [
        "arithmetic-grpo"], "one GRPO run waits for it"
    assert "exporting SFT step 240" in demo_chain_summary(exporting)

    _work(demo.sent)
    chain = demo_chain_advance(actor=demo.user)
    grpo = chain.grpo
    assert chain.phase == Phase.GRPO and grpo is not None
    assert (grpo.parent, grpo.experiment.name, grpo.experiment.recipe) == (sft, "arithmetic-grpo", "grpo")
    assert grpo.config.yaml_text.startswith("# CPU demo, part 2") and grpo.config.parsed["trainer"]["steps"] == 200
    assert grpo.config.parsed["model"]["artifact"] == f"run:{sft.pk}@step:240"
    registered = Artifact.objects.get(project=sft.experiment.project, name="tiny-qwen3-sft")
    assert registered.kind == "model" and registered.path == str(demo_sft_model_dir())
    assert (demo_sft_model_dir() / "model.safetensors").read_bytes() == b"weights", "a copy of the SFT export"

    _finish(grpo, metric=GRPO_METRIC, values={0: 0.39, 100: 0.52, 200: 0.66})
    done = demo_chain_advance(actor=demo.user)
    assert done.phase == Phase.DONE and done.finished
    assert demo_chain_summary(done, base_url="http://127.0.0.1:8000") == (
        f"demo: SFT run arithmetic-sft #1 done, held-out accuracy 0.41 · GRPO run arithmetic-grpo #1 "
        f"(from SFT step 240) done, held-out reward 0.39 -> 0.66 · http://127.0.0.1:8000/runs/{grpo.pk}/")

    # a restart of serve: nothing new is launched; the follower prints the figures and ends
    out = StringIO()
    with django_capture_on_commit_callbacks(execute=True):
        call_command("seed_demo", "--launch", "--follow", stdout=out)
    assert "the demo run is already under way or done" in out.getvalue()
    assert "held-out reward 0.39 -> 0.66" in out.getvalue().splitlines()[-1]
    assert Run.objects.count() == 2 and demo.sent == []


def test_a_failed_demo_run_is_reported_and_tried_again(demo, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        sft = demo_sft_launch(actor=demo.user)
    Run.objects.filter(pk=sft.pk).update(state=RunState.FAILED, exit_reason="engine exited with 1")
    chain = demo_chain_advance(actor=demo.user)
    assert chain.phase == Phase.FAILED and chain.finished
    assert demo_chain_summary(chain) == "demo: SFT run arithmetic-sft #1 failed · the SFT run failed: engine exited with 1"
    with django_capture_on_commit_callbacks(execute=True):
        again = demo_sft_launch(actor=demo.user)
    assert again is not None and again.number == 2


def test_a_succeeded_sft_run_without_checkpoints_says_why_no_grpo_run_started(demo, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        sft = demo_sft_launch(actor=demo.user)
    _finish(sft, metric=SFT_METRIC, values={240: 0.4})
    chain = demo_chain_advance(actor=demo.user)
    assert chain.phase == Phase.FAILED and "left no checkpoint" in chain.reason
    assert Run.objects.count() == 1 and not Artifact.objects.filter(name="tiny-qwen3-sft").exists()


def test_serve_demo_follows_the_chain_in_a_one_shot_supervised_child():
    from forgeboard.supervisor import Child

    assert settings.REPO_DIR  # the child runs manage.py from the checkout
    child = Child("job", [sys.executable, "-c", "raise SystemExit(0)"], env={}, cwd=Path("."), once=True)
    child.start(0.0)
    child.process.wait()
    assert child.exited(1.0) and not child.due(1e9), "a one-shot child that finished is not started again"
    failing = Child("job", [sys.executable, "-c", "raise SystemExit(3)"], env={}, cwd=Path("."), once=True)
    failing.start(0.0)
    failing.process.wait()
    assert failing.exited(1.0) and failing.due(1e9) and failing.history == [3], "one that failed is"
