"""The engine's import boundaries and its example configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workers.engine.config import load_config_file

REPO = Path(__file__).resolve().parents[2]


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=180,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_torch_path_needs_neither_django_nor_monarch_nor_vllm() -> None:
    modules = _modules_after(
        "import workers.engine.models.hf_folder, workers.engine.sampler, workers.engine.losses, "
        "workers.engine.recipes.grpo, workers.engine.recipes.sft, workers.engine.checkpoint, workers.engine.cli"
    )
    assert "torch" in modules
    assert not {m for m in modules if m.split(".")[0] in {"django", "monarch", "vllm"}}


def test_config_and_preflight_load_without_torch() -> None:
    modules = _modules_after("import workers.engine.config, workers.engine.preflight, workers.engine.cli")
    assert "torch" not in modules and "django" not in modules


@pytest.mark.parametrize("path", sorted((REPO / "examples" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_valid(path: Path) -> None:
    config = load_config_file(path)
    assert config.recipe in {"sft", "grpo"}


def test_cpu_demo_configs_pass_preflight(tiny_qwen3: Path) -> None:
    from workers.engine.preflight import preflight_errors

    for name in ("cpu_demo_sft.yaml", "cpu_demo_grpo.yaml"):
        config = load_config_file(REPO / "examples" / "configs" / name, overrides=[f"model.path={tiny_qwen3}"])
        assert preflight_errors(config) == []
