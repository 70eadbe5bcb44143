"""A small disk that a test fills and frees: a tmpfs of a few KiB mounted on a test's folder.

Mounting needs root (as on the test machines). Where this process may not mount, the same disk is made at the OS
boundary instead: a write(2) into the folder (`os.write`, which the engine's recording writes go through) takes only
what is left of the folder's size, then fails with ENOSPC, as the kernel's does.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


class SmallDisk:
    def __init__(self, folder: Path, size: int) -> None:
        self.folder, self.size = folder, size
        self._filler = folder / "filler"

    def fill(self) -> None:
        """Take every byte left (a file that grows until the disk refuses it)."""
        descriptor = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(descriptor, b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
        finally:
            os.close(descriptor)

    def free(self) -> None:
        self._filler.unlink()


def _used(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


@contextmanager
def small_disk(folder: Path, *, size: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallDisk]:
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, check=False).returncode == 0
    if not mounted:
        real_write = os.write

        def write(descriptor: int, data: bytes | memoryview) -> int:
            try:
                path = Path(os.readlink(f"/proc/self/fd/{descriptor}"))
            except OSError:
                return real_write(descriptor, data)
            if not path.is_relative_to(folder):
                return real_write(descriptor, data)
            room = size - _used(folder)
            if room <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(descriptor, bytes(data[:room]))

        monkeypatch.setattr(os, "write", write)
    try:
        yield SmallDisk(folder, size)
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(folder)], check=True)
