"""The source layout: `platform` is always the standard library module; the engine never pulls in Django."""

from __future__ import annotations

import subprocess
import sys
import sysconfig

import pytest

from tests.support.processes import REPO_DIR, platform_env

STDLIB = sysconfig.get_paths()["stdlib"]
CHECK_PLATFORM = "import platform, sys; assert platform.__file__.startswith(sys.argv[-1]), platform.__file__; platform.system()"


def _python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO_DIR, env=env or platform_env(),
                          capture_output=True, text=True, timeout=120)


def test_platform_folder_is_not_a_package():
    assert not (REPO_DIR / "platform" / "__init__.py").exists()
    import platform

    assert platform.__file__.startswith(STDLIB)


@pytest.mark.parametrize(
    "process",
    [
        "import django; django.setup()",  # the web process and manage.py
        "import workers.celery",  # the Celery worker
        "import forgeboard.cli",  # the forgeboard command
        "import workers.engine.config",  # the engine
    ],
)
def test_every_process_sees_the_standard_library_platform(process, db):
    result = _python(f"{process}\n{CHECK_PLATFORM}", STDLIB)
    assert result.returncode == 0, result.stderr


def test_manage_py_sees_the_standard_library_platform(db):
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", "import platform; print(platform.__file__)"],
        cwd=REPO_DIR, env=platform_env(), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith(STDLIB)


@pytest.mark.parametrize("module", ["workers.engine.config", "workers.engine.cli", "workers", "forgeboard.cli"])
def test_engine_side_imports_without_django(module):
    result = _python(f"import sys, {module}; assert 'django' not in sys.modules, 'django was imported'")
    assert result.returncode == 0, result.stderr


def test_config_schema_loads_without_torch():
    code = (
        "import sys\n"
        "from workers.engine.config import load_config, config_json_schema\n"
        "cfg = load_config('recipe: sft\\nmodel: {path: /m}\\n')\n"
        "assert cfg.recipe == 'sft' and 'properties' in config_json_schema()\n"
        "assert 'torch' not in sys.modules and 'django' not in sys.modules\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr


def test_workers_package_init_is_empty():
    assert (REPO_DIR / "workers" / "__init__.py").read_text().strip() == ""


def test_forgeboard_command_runs_without_importing_django():
    code = (
        "import sys\nfrom forgeboard.cli import build_parser\n"
        "args = build_parser().parse_args(['serve', '--port', '9000', '--demo'])\n"
        "assert args.port == 9000 and args.demo\n"
        "assert 'django' not in sys.modules\n"
    )
    assert _python(code).returncode == 0
    result = subprocess.run([sys.executable, "-m", "forgeboard.cli", "--help"], cwd=REPO_DIR, env=platform_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "serve" in result.stdout and "manage" in result.stdout
