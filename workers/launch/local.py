"""The local backend: the engine runs as a subprocess on the worker's host, watched by a supervisor process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from django.conf import settings

from forgeboard.runs.folders import run_dir
from forgeboard.runs.models import Run
from forgeboard.runs.tokens import run_token_issue
from workers.engine.config import config_mapping
from workers.engine.env import ALLOWED_PATHS_ENV, CONTROL_PLANE_URL_ENV, RUN_ID_ENV, RUN_TOKEN_FILE_ENV, SPOOL_DIR_ENV

REPO_DIR = Path(__file__).resolve().parents[2]


def engine_config_yaml(run: Run, *, run_folder: Path | None = None) -> str:
    """The run's config as its user wrote it, overrides applied, for its engine: the paths resolved in its project at
    launch (Run.artifact_paths) in place of its paths and artifact references, and no restarts (the control plane's
    job, the reconciler's: the engine runs once). Defaults are the engine's schema's, never restated here.

    `run_folder`: where the engine sees the run's folder, on a filesystem that outlives an attempt. Its checkpoints go
    to `<run_folder>/checkpoints` (where the platform lists them; a checkpoint.folder of the user's is replaced) and
    the engine resumes from the newest there at start (checkpoint.resume_latest): every attempt after the first (a
    restart by the reconciler, a job SLURM requeues with this same file) goes on from the run's last checkpoint. A
    checkpoint.resume_from of the user's is kept: the warm start of an attempt that finds none there."""
    config = config_mapping(run.config.yaml_text, overrides=run.config.overrides)
    for section in ("model", "data"):
        if isinstance(config.get(section), dict):
            config[section].pop("artifact", None)
    for field, path in (run.artifact_paths or {}).items():
        section, key = field.split(".")
        config.setdefault(section, {})[key] = path
    if run_folder is not None:
        checkpoint = config.setdefault("checkpoint", {})
        checkpoint |= {"folder": str(run_folder / "checkpoints"), "resume_latest": True}
    return yaml.safe_dump(config | {"max_restarts": 0}, sort_keys=False)


def engine_allowed_paths(*, run: Run, run_folder: str) -> list[str]:
    """FORGEBOARD_ALLOWED_PATHS for the run's engine: its own folder, its resolved paths, the artifact roots."""
    from forgeboard.artifacts.resolver import engine_allowed_paths as allowed

    return allowed(artifact_paths=(run.artifact_paths or {}).values(), run_folder=run_folder)


def _write_replacing(path: Path, text: str) -> None:
    """`path` holds `text`, in a new file of this worker's that only it may read (0600): written whole beside it, then
    renamed over it. A file there before (an earlier attempt's, perhaps another account's, perhaps readable by all)
    is replaced, never rewritten in place; a write that fails leaves it as it was."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # O_CREAT|O_EXCL, mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def write_run_files(*, run: Run, folder: Path) -> Path:
    """The engine's config.yaml (resuming from the run's checkpoints in `folder`) and a fresh run token in `folder`,
    each a new file readable by its owner only; the token's path."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_replacing(folder / "config.yaml", engine_config_yaml(run, run_folder=folder))
    token_file = folder / "run_token"
    _write_replacing(token_file, run_token_issue(run=run))
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


STOP_POLL_SECONDS = 0.1
STOP_GRACE_SECONDS = 10.0  # from SIGTERM to SIGKILL, as the supervisor gives its engine


def _group_members(pgid: int) -> set[int]:
    """The live (not zombie) processes of process group `pgid` on this host (Linux's /proc)."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended meanwhile
        state, _parent, group = stat.rsplit(")", 1)[1].split()[:3]
        if int(group) == pgid and state != "Z":
            members.add(int(entry.name))
    return members


class EngineNotIdentified(PermissionError):
    """Whether the process at a lost run's engine pid is its engine cannot be told from here: stopping it might kill
    what is not the run's, taking it as exited might restart the run beside a live engine holding its GPUs."""


def _run_users(folder: Path) -> set[int]:
    """The uids the run's engines may run as: the owners of what its attempts wrote in its folder (the config and token
    the worker that started one wrote, its supervisor's lock and marks, its engine's checkpoints), and this worker's.
    A worker restarted under another account still knows its predecessor's engines by them."""
    users = {os.geteuid()}
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return users
    except PermissionError as exc:
        raise EngineNotIdentified(f"whose engine it is cannot be told: this worker (uid {os.geteuid()}) may not read "
                                  f"the run's folder {folder}") from exc
    for entry in entries:
        try:
            users.add(entry.lstat().st_uid)
        except FileNotFoundError:
            continue
    return users


def _engine_group_alive(*, run_id: int, pid: int, users: set[int]) -> bool:
    """Whether the process group the run's engine leads (its pid: the supervisor starts it in a session of its own)
    still has live processes, and is the engine's: a pid reused by another process is not. A process owned by none of
    the run's `users` (the owner of /proc/<pid>, which anyone may read, is the process's) is another's: the pid was
    reused. One of theirs that this worker may not read (it made itself non-dumpable, or it is a former account's)
    cannot be told apart from the engine: EngineNotIdentified."""
    members = _group_members(pid)
    if pid not in members:
        return bool(members)  # the engine exited, its children run on: a group id is not reused while it has members
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return bool(_group_members(pid) - {pid})  # the engine exited just now
    if owner not in users:
        return False  # another user's process: the pid was reused
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except (ProcessLookupError, FileNotFoundError):
        return bool(_group_members(pid) - {pid})  # the engine exited just now
    except PermissionError as exc:
        raise EngineNotIdentified(
            f"the process at its engine's pid {pid} is of uid {owner}, a user of the run's, and this worker (uid "
            f"{os.geteuid()}) may not read it: whether it is the run's engine cannot be told") from exc
    return f"{RUN_ID_ENV}={run_id}".encode() in environ.split(b"\0")


def _group_owners(pgid: int) -> str:
    owners = []
    for member in sorted(_group_members(pgid)):
        try:
            owners.append(f"pid {member} (uid {os.stat(f'/proc/{member}').st_uid})")
        except FileNotFoundError:
            continue
    return ", ".join(owners) or "none left"


def _group_gone_within(*, run_id: int, pid: int, users: set[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _engine_group_alive(run_id=run_id, pid=pid, users=users):
        if time.monotonic() >= deadline:
            return False
        time.sleep(STOP_POLL_SECONDS)
    return True


def stop_local_engine(*, run_id: int, pid: int, host: str, folder: Path) -> str | None:
    """Stop a lost run's engine (its whole process group) on this host, SIGTERM then SIGKILL as its supervisor would;
    what was done, or None if it outlived both. The run's `folder` tells who its engines run as. Run on `host` (the
    worker consuming its probe queue): a process on another host cannot be reached from here, so that raises OSError,
    as does one that cannot be told to be the engine or not, or that this worker may not signal."""
    if host != socket.gethostname():
        raise OSError(f"the engine runs on {host}, not on {socket.gethostname()}")
    users = _run_users(folder)
    if not _engine_group_alive(run_id=run_id, pid=pid, users=users):
        return f"its engine (pid {pid} on {host}) had exited"
    for sent, grace in ((signal.SIGTERM, STOP_GRACE_SECONDS), (signal.SIGKILL, STOP_GRACE_SECONDS)):
        try:
            os.killpg(pid, sent)
        except ProcessLookupError:
            pass
        except PermissionError as exc:  # none of the group's processes may be signalled by this worker
            raise PermissionError(
                f"its engine's process group {pid} has processes this worker (uid {os.geteuid()}) may not signal: "
                f"{_group_owners(pid)}") from exc
        if _group_gone_within(run_id=run_id, pid=pid, users=users, seconds=grace):
            return f"its engine (pid {pid} on {host}) stopped with {sent.name}"
    return None
