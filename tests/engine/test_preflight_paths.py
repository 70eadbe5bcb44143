"""Engine preflight confinement: with FORGEBOARD_ALLOWED_PATHS set (by every launcher) each path field must resolve
inside it; unset (the engine run by hand) plain local paths work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.engine.config import load_config
from workers.engine.env import ALLOWED_PATHS_ENV
from workers.engine.preflight import preflight_errors

REPO = Path(__file__).resolve().parents[2]


def _copy_model(source: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    return target


@pytest.fixture
def layout(tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A run folder, a root holding a model and a dataset, and another run's folder with an export."""
    run = tmp_path / "runs" / "7-abc"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "trainer.pt").write_bytes(b"")  # what resume_from must hold
    (run / "checkpoints" / "step_000001" / "checkpoint.json").write_text('{"recipe": "sft", "step": 1}')
    root = tmp_path / "models"
    model = _copy_model(tiny_qwen3, root / "tiny")
    dataset = root / "train.jsonl"
    dataset.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": "1+2=", "response": "3"}\n')
    other = _copy_model(tiny_qwen3, tmp_path / "runs" / "8-def" / "exports" / "step_2")
    (root / "escape").symlink_to("/etc")
    monkeypatch.setenv(ALLOWED_PATHS_ENV, json.dumps([str(run), str(root)]))
    monkeypatch.chdir(run)
    return {"run": run, "root": root, "model": model, "dataset": dataset, "other": other}


def _errors(*overrides: str) -> dict[str, str]:
    config = load_config("recipe: sft\nmodel: {path: /placeholder}\n", overrides=list(overrides))
    return {e.field: e.message for e in preflight_errors(config)}


def test_paths_inside_the_allowed_ones_pass(layout: dict[str, Path]) -> None:
    assert _errors(f"model.path={layout['model']}", "data.source=jsonl", f"data.path={layout['dataset']}", "data.eval_size=1",
                   f"checkpoint.resume_from={layout['run'] / 'checkpoints'}", "checkpoint.folder=checkpoints",
                   f"telemetry.jsonl_path={layout['run'] / 'metrics.jsonl'}") == {}


@pytest.mark.parametrize("field, value", [
    ("model.path", "{other}"),                      # another run's export
    ("model.path", "{root}/../runs/8-def/exports/step_2"),
    ("model.path", "../../../etc"),                # relative, resolved from the engine's working directory
    ("model.path", "{root}/escape"),               # a symlink inside a root that points outside
    ("data.path", "/etc/shadow"),
    ("checkpoint.resume_from", "{other}"),
    ("checkpoint.folder", "/tmp/elsewhere"),
    ("telemetry.jsonl_path", "/etc/forgeboard.jsonl"),
])
def test_every_path_field_outside_is_a_field_error(layout: dict[str, Path], field: str, value: str) -> None:
    value = value.format(other=layout["other"], root=layout["root"])
    overrides = [f"model.path={layout['model']}", f"{field}={value}"]
    if field == "data.path":
        overrides.append("data.source=jsonl")
    errors = _errors(*overrides)
    assert list(errors) == [field] and "outside the paths this run may use" in errors[field]
    assert os.path.realpath(value) in errors[field]


def test_a_reference_that_reached_the_engine_is_refused(layout: dict[str, Path]) -> None:
    config = load_config("recipe: sft\nmodel: {artifact: tiny}\n")
    assert [e.field for e in preflight_errors(config)] == ["model.artifact"]


def test_a_malformed_variable_is_an_error_not_a_free_pass(layout: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOWED_PATHS_ENV, "/everything")
    assert "JSON list" in _errors(f"model.path={layout['model']}")[""]


def test_unset_means_plain_local_paths(layout: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOWED_PATHS_ENV)
    assert _errors(f"model.path={layout['other']}", "checkpoint.folder=/tmp/elsewhere") == {}
    assert "model.artifact" in {e.field for e in preflight_errors(load_config("recipe: sft\nmodel: {artifact: x}\n"))}


def test_the_cli_refuses_before_loading_anything(layout: dict[str, Path]) -> None:
    config = layout["run"] / "config.yaml"
    config.write_text(f"recipe: sft\nmodel: {{path: {layout['model']}}}\ndata: {{source: jsonl, path: /etc/shadow}}\n")
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           ALLOWED_PATHS_ENV: os.environ[ALLOWED_PATHS_ENV]}
    result = subprocess.run([sys.executable, "-m", "workers.engine", "train", "--config", str(config)], cwd=layout["run"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "data.path: /etc/shadow is outside the paths this run may use" in result.stderr
