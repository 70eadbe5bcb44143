"""Engine preflight confinement: with FORGEBOARD_ALLOWED_PATHS set (by every launcher) each path field must resolve
inside it; unset (the engine run by hand) plain local paths work."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.engine.config import load_config
from workers.engine.env import ALLOWED_PATHS_ENV
from workers.engine.preflight import PATH_FIELDS, preflight_errors

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


FILE_FIELDS = {"data.path": "data.source=jsonl"}  # the overrides a field needs beside it to be read


@pytest.mark.parametrize("confined", [True, False])
@pytest.mark.parametrize("field", PATH_FIELDS)
@pytest.mark.parametrize("kind", ["nul", "too_long", "loop"])
def test_a_path_the_filesystem_will_not_look_at_is_its_fields_error(layout: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                                     confined: bool, field: str, kind: str) -> None:
    # a NUL byte raised ValueError from realpath (a traceback) with FORGEBOARD_ALLOWED_PATHS set, and without it read as
    # "does not exist", or passed (an output path, then failing where the run first wrote); a name too long raised
    # OSError from the first is_dir / exists (a traceback); a symlink loop read as "does not exist", or passed
    if not confined:
        monkeypatch.delenv(ALLOWED_PATHS_ENV)
    root = layout["root"]
    (root / "loop").symlink_to(root / "loop")
    value = {"nul": f"{root}/a\x00b", "too_long": f"{root}/{'x' * 300}/file", "loop": f"{root}/loop/file"}[kind]
    errors = _errors(f"model.path={layout['model']}", *([FILE_FIELDS[field]] if field in FILE_FIELDS else []),
                     f"{field}={value}")
    assert list(errors) == [field]
    if kind == "nul":
        assert errors[field] == "contains a NUL byte, which no file's name can hold"
    elif kind == "too_long":  # the path cut short in the message: its start and end say which
        assert errors[field] == (f"cannot reach {value[:120]}...{value[-60:]} ({len(value)} characters) "
                                 "(File name too long)")
    else:
        assert errors[field] == f"cannot reach {value} (Too many levels of symbolic links)"


def test_a_nul_byte_in_the_allowed_paths_is_an_error_not_a_traceback(layout: dict[str, Path],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOWED_PATHS_ENV, json.dumps([str(layout["root"]) + "\x00"]))
    assert "JSON list of paths" in _errors(f"model.path={layout['model']}")[""]


@pytest.fixture
def shared(tiny_qwen3: Path) -> Iterator[dict[str, Path]]:
    """A folder every user may read (pytest's own is its user's alone) holding a model, a folder for outputs anyone
    may write in, a folder no user but root may look into (mode 000), and a file no user but root may read."""
    top = Path(tempfile.mkdtemp(prefix="forgeboard-preflight-"))
    top.chmod(0o755)
    model = _copy_model(tiny_qwen3, top / "model")
    out = top / "out"
    out.mkdir()
    out.chmod(0o777)
    locked = top / "locked"
    (locked / "step_000001").mkdir(parents=True)
    (locked / "step_000001" / "trainer.pt").write_bytes(b"")
    secret = top / "secret.jsonl"
    secret.write_text('{"prompt": "1+1=", "response": "2"}\n' * 4)
    secret.chmod(0o000)
    locked.chmod(0o000)
    try:
        yield {"top": top, "model": model, "out": out, "locked": locked, "secret": secret}
    finally:
        locked.chmod(0o700)
        shutil.rmtree(top)


def _as_a_user_the_mode_bits_bind() -> list[str]:
    """The command prefix that runs a process as a user file modes refuse: root passes them all, so as root it runs as
    `nobody` (setpriv); any other user already is one."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root, and no setpriv to run as a user that file modes refuse")
    nobody = pwd.getpwnam("nobody")
    return [setpriv, f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]


PREFLIGHT_EACH = """
import json, sys, traceback
from workers.engine.config import load_config
from workers.engine.preflight import PATH_FIELDS, preflight_errors
results = []
for overrides in json.loads(sys.argv[1]):
    try:
        config = load_config("recipe: sft\\nmodel: {path: /placeholder}\\n", overrides=overrides)
        results.append({e.field: e.message for e in preflight_errors(config)})
    except Exception:
        results.append({"traceback": traceback.format_exc()})
print(json.dumps(results))
"""


def test_a_path_this_process_may_not_look_into_is_its_fields_error(shared: dict[str, Path]) -> None:
    # PermissionError from the first is_dir / is_file / exists on a path inside a folder the process may not enter (a
    # traceback), for every path field but the two outputs; now each names its field. Run as a user the mode bits bind.
    locked, model, out, secret = shared["locked"], shared["model"], shared["out"], shared["secret"]
    cases = [  # (field, value, its error)
        ("model.path", locked / "model", f"cannot reach {locked / 'model'} (Permission denied)"),
        ("model.path", locked, f"cannot reach {locked / 'config.json'} (Permission denied)"),
        ("data.path", locked / "rows.jsonl", f"cannot reach {locked / 'rows.jsonl'} (Permission denied)"),
        ("data.path", secret, f"cannot read {secret}: Permission denied"),
        ("checkpoint.resume_from", locked / "step_000001",
         f"cannot reach {locked / 'step_000001'} (Permission denied)"),
        ("checkpoint.resume_from", locked, f"cannot reach {locked / 'trainer.pt'} (Permission denied)"),
        ("checkpoint.folder", locked / "ckpt", f"cannot reach {locked / 'ckpt'} (Permission denied)"),
        ("checkpoint.folder", locked, f"cannot write in {locked} (Permission denied)"),
        ("telemetry.jsonl_path", locked / "m.jsonl", f"cannot reach {locked / 'm.jsonl'} (Permission denied)"),
    ]
    runs = [[f"model.path={model}", f"checkpoint.folder={out / 'ckpt'}", "eval.every_steps=0",
             *([FILE_FIELDS[field]] if field in FILE_FIELDS else []), f"{field}={value}"] for field, value, _ in cases]
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1",
           "HOME": str(out)}
    result = subprocess.run([*_as_a_user_the_mode_bits_bind(), sys.executable, "-c", PREFLIGHT_EACH, json.dumps(runs)],
                            cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found == [{field: error} for field, _, error in cases]
