"""The local backend: the engine runs as a subprocess on the worker's host, watched by a supervisor process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from django.conf import settings

from forgeboard.runs.folders import run_dir
from forgeboard.runs.models import Run
from forgeboard.runs.tokens import run_token_issue
from workers.engine.config import config_mapping
from workers.engine.env import ALLOWED_PATHS_ENV, CONTROL_PLANE_URL_ENV, RUN_ID_ENV, RUN_TOKEN_FILE_ENV, SPOOL_DIR_ENV

REPO_DIR = Path(__file__).resolve().parents[2]


def engine_config_yaml(run: Run) -> str:
    """The run's config as its user wrote it, overrides applied, for its engine: the paths resolved in its project at
    launch (Run.artifact_paths) in place of its paths and artifact references, and no restarts (the control plane's
    job, the reconciler's: the engine runs once). Defaults are the engine's schema's, never restated here."""
    config = config_mapping(run.config.yaml_text, overrides=run.config.overrides)
    for section in ("model", "data"):
        if isinstance(config.get(section), dict):
            config[section].pop("artifact", None)
    for field, path in (run.artifact_paths or {}).items():
        section, key = field.split(".")
        config.setdefault(section, {})[key] = path
    return yaml.safe_dump(config | {"max_restarts": 0}, sort_keys=False)


def engine_allowed_paths(*, run: Run, run_folder: str) -> list[str]:
    """FORGEBOARD_ALLOWED_PATHS for the run's engine: its own folder, its resolved paths, the artifact roots."""
    from forgeboard.artifacts.resolver import engine_allowed_paths as allowed

    return allowed(artifact_paths=(run.artifact_paths or {}).values(), run_folder=run_folder)


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
        CONTROL_PLANE_URL_ENV: settings.PUBLIC_URL,
        RUN_ID_ENV: str(run.pk),
        RUN_TOKEN_FILE_ENV: str(token_file),
        SPOOL_DIR_ENV: str(folder / "spool"),
        ALLOWED_PATHS_ENV: json.dumps(engine_allowed_paths(run=run, run_folder=str(folder))),
    }
    with open(folder / "supervisor.log", "ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "workers.launch.local_supervisor", str(run.pk)],
            cwd=REPO_DIR, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return supervisor.pid
