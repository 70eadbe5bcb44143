"""Static checks that catch real mistakes: undefined names, unused imports and variables, redefinitions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]


def test_no_undefined_or_unused_names():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "F401,F811,F821,F841", "--target-version", "py311",
         "--output-format", "concise", "platform", "workers", "tests"],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
