"""The engine's torch-free half works on Python 3.12 (the GPU machines' interpreter).

The web process and the CLI validate configs without torch: config load, overrides,
field-level errors, the JSON Schema, preflight, the YAML limits, the task / reward /
replay-buffer / metrics modules and `python -m workers.engine schema` all run here in a
Python 3.12 interpreter, in a venv built once under var/ with the pydantic, PyYAML and
httpx pins of pyproject.toml. Every engine source file is also byte-compiled by 3.12.

Not skipped when 3.12 is missing: the test fails and says how to provide one
(`FORGEBOARD_PYTHON312=/path/to/python3.12`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tomllib
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KNOWN_PY312 = ("/root/.pyenv/versions/3.12.1/bin/python",)
PINNED = ("pydantic", "PyYAML", "httpx")  # what the torch-free engine modules import

CHECK = r'''
import json, os, subprocess, sys, tempfile
from pathlib import Path

assert sys.version_info[:2] == (3, 12), sys.version
checked = []

from workers.engine.config import (ConfigError, config_json_schema, config_to_yaml, load_config,
                                   load_config_file)
from workers.engine.preflight import preflight, preflight_errors

# load + overrides
cfg = load_config("recipe: grpo\nmodel: {path: /nowhere}\n",
                  overrides=["grpo.mode=async", "grpo.max_policy_age=2", "trainer.steps=3", "generator.top_p=0.9"])
assert (cfg.recipe, cfg.grpo.mode, cfg.grpo.max_policy_age, cfg.trainer.steps) == ("grpo", "async", 2, 3), cfg
assert load_config(config_to_yaml(cfg)) == cfg
checked.append("config load, overrides, YAML round trip")

# field-level errors
def fields(text, overrides=()):
    try:
        load_config(text, overrides=overrides)
    except ConfigError as exc:
        return {e.field: e.message for e in exc.errors}
    raise AssertionError("no ConfigError for " + repr(text))

errors = fields("recipe: grpo\nmodel: {path: /x}\ntrainer: {steps: 0, bogus: 1}\n")
assert "trainer.steps" in errors and errors.get("trainer.bogus") == "unknown key", errors
assert "grpo.kl_coef" in fields("recipe: grpo\nmodel: {path: /x}\n", ["grpo.kl_coef=0.1"])
assert "recipe" in fields("recipe: dpo\nmodel: {path: /x}\n")
assert "aliases" in next(iter(fields("a: &x [1]\nb: *x\n").values()))
assert "duplicate key" in next(iter(fields("recipe: grpo\nrecipe: sft\n").values()))
assert "nesting" in next(iter(fields("recipe: grpo\nx: " + "[" * 40 + "]" * 40 + "\n").values()))
checked.append("field-level errors (bounds, unknown keys, cross-field, enum, YAML limits)")

# JSON schema
schema = config_json_schema()
text = json.dumps(schema)
assert {"recipe", "model", "trainer", "grpo"} <= set(schema["properties"]), sorted(schema["properties"])
assert "additionalProperties" in text
checked.append("JSON schema")

# preflight against a fake HF folder
with tempfile.TemporaryDirectory() as tmp:
    folder = Path(tmp, "model")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 320, "max_position_embeddings": 512}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    base = f"recipe: grpo\nmodel: {{path: '{folder}', family: llama3}}\n"
    assert preflight_errors(load_config(base)) == []
    preflight(load_config(base))
    found = {e.field for e in preflight_errors(load_config(base, overrides=["model.family=qwen3", "generator.replicas=2"]))}
    assert {"model.family", "generator.replicas"} <= found, found
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "num_key_value_heads": 3}))
    built = {e.field: e.message for e in preflight_errors(load_config(base))}
    assert "num_key_value_heads: 3 does not divide" in built["model.path"], built
    missing = {e.field: e.message for e in preflight_errors(load_config("recipe: sft\nmodel: {path: /no/such/folder}\n"))}
    assert "does not exist" in missing["model.path"], missing
    config_file = Path(tmp, "run.yaml")
    config_file.write_text(base)
    assert load_config_file(config_file).model.family == "llama3"
checked.append("preflight (model folder, family, unsupported options)")

# other torch-free modules
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.replay_buffer import ReplayBuffer, RolloutBatchRecord
from workers.engine.rewards import CombinedReward
from workers.engine.tasks import build_task
from workers.engine.tasks.stream import ProblemStream
import workers.engine.telemetry_wire  # noqa: F401

task = build_task(cfg)
stream = ProblemStream(task.train, seed=0)
problems = stream.take(4)
reward = CombinedReward(["exact_math", "format"])
assert reward(problems[0], problems[0].answer, True).total == 2.0
buffer = ReplayBuffer(capacity=8, max_policy_age=1)
buffer.put(RolloutBatchRecord(prompts=[[1]], responses=[[2]], logprobs=[[-0.5]], rewards=[1.0], advantages=[0.0],
                              policy_version=0, prompt_texts=["p"], response_texts=["r"], reward_parts={}))
assert buffer.take(1) is not None
sink = MemorySink()
Recorder([sink]).log("loss", 1.0, step=1)
assert sink.records[0]["value"] == 1.0
checked.append("tasks, rewards, replay buffer, metrics, telemetry wire")

# the CLI's torch-free commands in a fresh 3.12 interpreter
out = subprocess.run([sys.executable, "-m", "workers.engine", "schema"], capture_output=True, text=True, check=True)
assert "properties" in json.loads(out.stdout)
with tempfile.TemporaryDirectory() as tmp:
    bad = Path(tmp, "bad.yaml")
    bad.write_text("recipe: grpo\nmodel: {path: /no/such/folder}\ntrainer: {steps: -1}\n")
    out = subprocess.run([sys.executable, "-m", "workers.engine", "train", "--config", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "trainer.steps" in out.stdout + out.stderr and "Traceback" not in out.stderr, out.stderr
checked.append("CLI: schema, train with a bad config exits 2")

# every engine source file compiles under 3.12 (the torch half included)
root = Path(os.environ["ENGINE_ROOT"])
sources = sorted(root.rglob("*.py"))
for path in sources:
    compile(path.read_text(encoding="utf-8"), str(path), "exec")
checked.append(f"{len(sources)} engine files compile")

assert "torch" not in sys.modules, "a torch-free module imported torch"
print(json.dumps({"python": sys.version.split()[0], "checked": checked}))
'''


def _python312() -> str:
    candidates = [os.environ.get("FORGEBOARD_PYTHON312", ""), shutil.which("python3.12") or "", *KNOWN_PY312]
    for candidate in candidates:
        if not candidate or not Path(candidate).exists():
            continue
        probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return candidate
    pytest.fail("no Python 3.12 interpreter found (looked at $FORGEBOARD_PYTHON312, python3.12 on PATH, "
                f"{', '.join(KNOWN_PY312)}): the GPU machines run 3.12, so the engine must be checked on it. "
                "Install one and/or set FORGEBOARD_PYTHON312=/path/to/python3.12.")


def _pins() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = [d for d in project["dependencies"] if d.split("==")[0].split("[")[0].lower() in {p.lower() for p in PINNED}]
    assert len(pins) == len(PINNED), f"pyproject.toml should pin {PINNED}, found {pins}"
    return sorted(pins)


def _venv(python: str) -> Path:
    """A Python 3.12 venv with the pinned pure dependencies, built once and reused (var/ is not committed)."""
    pins = _pins()
    key = hashlib.sha256(json.dumps([python, pins]).encode()).hexdigest()[:12]
    venv = REPO / "var" / f"py312-venv-{key}"
    marker = venv / "forgeboard-pins.json"
    if marker.is_file():
        return venv
    building = venv.with_name(f"{venv.name}.building-{uuid.uuid4().hex[:8]}")
    building.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([python, "-m", "venv", str(building)], check=True, capture_output=True, text=True, timeout=120)
        install = subprocess.run(
            [str(building / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "--quiet", *pins],
            capture_output=True, text=True, timeout=300,
        )
        if install.returncode != 0:
            pytest.fail(f"could not install {pins} into a Python 3.12 venv:\n{install.stdout[-2000:]}\n{install.stderr[-4000:]}")
        (building / "forgeboard-pins.json").write_text(json.dumps(pins))
        try:
            building.rename(venv)
        except OSError:  # another run finished first: use its venv
            if not marker.is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return venv


@pytest.mark.slow
def test_engine_torch_free_modules_on_python312(tmp_path: Path) -> None:
    venv = _venv(_python312())
    script = tmp_path / "check_py312.py"
    script.write_text(CHECK)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "DJANGO"))}
    env.update(PYTHONPATH=str(REPO), ENGINE_ROOT=str(REPO / "workers" / "engine"), PYTHONDONTWRITEBYTECODE="1")
    run = subprocess.run([str(venv / "bin" / "python"), str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"Python 3.12 check failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["python"].startswith("3.12.")
    assert len(report["checked"]) == 7, report
