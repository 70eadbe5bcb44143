"""The local backend: the engine runs as a subprocess on the worker's host, watched by a supervisor process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from django.conf import settings

from forgeboard.runs.models import Run
from forgeboard.runs.tokens import run_token_issue

REPO_DIR = Path(__file__).resolve().parents[2]


def run_dir(run: Run) -> Path:
    return Path(settings.DATA_DIR) / "runs" / f"{run.pk}-{run.uid.hex[:12]}"


def engine_config_yaml(run: Run) -> str:
    """The run's resolved config for its engine. Restarts are the control plane's job (the reconciler): the engine runs once."""
    return yaml.safe_dump(run.config.parsed | {"max_restarts": 0}, sort_keys=False)


def write_run_files(*, run: Run, folder: Path) -> Path:
    """The engine's config.yaml and a fresh run token (readable by its owner only) in `folder`; the token's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(engine_config_yaml(run), encoding="utf-8")
    token_file = folder / "run_token"
    token_file.touch(mode=0o600)
    token_file.write_text(run_token_issue(run=run))
    return token_file


def start_local(*, run: Run) -> int:
    """Write the run's resolved config and start its supervisor, detached; returns the supervisor's pid."""
    folder = run_dir(run)
    token_file = write_run_files(run=run, folder=folder)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR / "platform"), str(REPO_DIR)])
    env |= {
        "FORGEBOARD_URL": settings.PUBLIC_URL,
        "FORGEBOARD_RUN_ID": str(run.pk),
        "FORGEBOARD_RUN_TOKEN_FILE": str(token_file),
        "FORGEBOARD_SPOOL_DIR": str(folder / "spool"),
    }
    with open(folder / "supervisor.log", "ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "workers.launch.local_supervisor", str(run.pk)],
            cwd=REPO_DIR, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return supervisor.pid
