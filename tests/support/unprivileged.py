"""Run code as a user who lacks a permission, for the branches a suite run as root (CI's) never reaches otherwise.

Root passes every file mode and may signal and read every process; a check that should refuse is tested here in a
process that has really dropped to an unprivileged uid, not by faking the refusal. Run as another user the suite
needs none of this: its own uid already lacks what root has.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

NOBODY = 65534  # Debian's `nobody` (and its group `nogroup`)
OTHER_USER = 65533  # no account: a uid that is neither root nor nobody, to be another user than `nobody`

T = TypeVar("T")


def suite_is_root() -> bool:
    return os.geteuid() == 0


def unprivileged_uid() -> int:
    """The uid a check that needs a user without root's powers runs as: `nobody` under root, else the suite's own."""
    return NOBODY if suite_is_root() else os.geteuid()


class ChildFailed(RuntimeError):
    """The child died, or raised what could not be sent back (its traceback is the message)."""


def call_as(uid: int, fn: Callable[..., T], /, *args: object, **kwargs: object) -> T:
    """`fn(*args, **kwargs)` in a forked child of this process that runs as `uid` (its group `uid` too, and no other
    groups), and what it returned, or what it raised raised here. The child has this process's modules and memory,
    so `fn` may be any callable; it must not use this process's database connection (the child ends with os._exit,
    leaving it open for the parent). A fork, not a fresh interpreter: this one may lie where only root may read (a
    pyenv Python under /root). For this process's own uid there is nothing to drop: `fn` is called here."""
    if uid == os.geteuid():
        return fn(*args, **kwargs)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's stack (pytest's)
        try:
            os.close(read)
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                outcome: tuple[bool, object] = (True, fn(*args, **kwargs))
            except BaseException as exc:  # all of it goes back to the parent
                outcome = (False, exc)
            try:
                data = pickle.dumps(outcome)
            except Exception:
                data = pickle.dumps((False, ChildFailed("".join(traceback.format_exception(outcome[1])))))
            with os.fdopen(write, "wb") as pipe:
                pipe.write(data)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise ChildFailed(f"the child running as uid {uid} sent nothing back (wait status {status})")
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value


def start_as(uid: int, argv: list[str], **popen: object) -> subprocess.Popen:
    """A process started as `uid` (group `uid`, no other groups), in a session of its own, from `/`; root only."""
    assert suite_is_root(), "only root starts another user's process"
    return subprocess.Popen(argv, user=uid, group=uid, extra_groups=[], cwd="/", start_new_session=True, **popen)


@contextmanager
def folder_for(uid: int) -> Iterator[Path]:
    """A fresh folder that `uid` owns, under the system's temp folder (pytest's own is root's alone, 0700, so no other
    user reaches into it); removed afterwards, whatever was made in it."""
    folder = Path(tempfile.mkdtemp(prefix="forgeboard-unprivileged-"))
    try:
        for above in folder.parents:
            assert os.stat(above).st_mode & 0o001, f"{above} cannot be passed through by other users"
        if uid != os.geteuid():
            os.chown(folder, uid, uid)
        folder.chmod(0o755)
        yield folder
    finally:
        for path in [folder, *folder.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o700)  # a read-only folder that the test made, so that it can be removed
        shutil.rmtree(folder)


def copy_readable(source: Path, into: Path, *, uid: int) -> Path:
    """A copy of the folder `source` inside `into`, owned by `uid`, so that a process running as `uid` may read it."""
    copy = Path(shutil.copytree(source, into / source.name))
    if uid != os.geteuid():
        for path in [copy, *copy.rglob("*")]:
            os.chown(path, uid, uid, follow_symlinks=False)
    return copy


def other_users_group_leader() -> int:
    """A live process of another user that leads its process group, for a suite not run as root (which cannot start
    one): the first found, init's usually."""
    me = os.geteuid()
    for entry in sorted(Path("/proc").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
        if not entry.name.isdigit():
            continue
        try:
            owner = entry.stat().st_uid
            state, _parent, group = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if owner != me and int(group) == int(entry.name) and state != "Z":
            return int(entry.name)
    raise AssertionError("no process of another user leads a process group on this host: run the suite as root")
