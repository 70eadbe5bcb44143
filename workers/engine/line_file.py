"""An append-only file of lines whose writes never raise: what the disk does not take is dropped and counted.

A run's recording must never end its training: a full disk (ENOSPC), a quota (EDQUOT), an I/O error (EIO) while a
line is written loses that line, counted in `dropped`, and the next line is tried again, so recording resumes by
itself once the disk takes it. Each write goes to the file in write(2) calls at the OS boundary, with no buffer of
ours that a failed write would leave half full and flush later; a line cut short by a write that failed midway is
cut off again (the file truncated back to its last whole line), or, when even that fails, ended by a newline before
the next one, so the lines after it read whole (a reader skips a line that is not whole JSON).

`Outages` logs the trouble once an outage (with the first error, and how many lines were dropped once it is over),
and a disk that keeps filling and freeing is logged at its 1st, 2nd, 4th, 8th... outage only: never a flood.
Lines are written, not fsynced: a process killed (SIGKILL, OOM) loses none of them; a power cut may lose the last
seconds the kernel had not written out (see `telemetry_spool.py`, which fsyncs what it seals).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


class Outages:
    """The outages of something written (a file, the telemetry spool): each logged once, at its start and its end."""

    def __init__(self, what: str, *, meanwhile: str = "what it cannot take is dropped and counted") -> None:
        self.what = what
        self.meanwhile = meanwhile
        self.count = 0  # outages so far
        self.dropped = 0  # what was not written, in all of them
        self.error = ""  # the first error of the latest outage
        self.going_on = False
        self._dropped_at_start = 0

    def failed(self, error: OSError, *, dropped: int) -> None:
        self.dropped += dropped
        if self.going_on:
            return
        self.count += 1
        self.going_on, self.error = True, f"{type(error).__name__}: {error}"
        self._dropped_at_start = self.dropped - dropped
        if self._logged():
            logger.warning("%s cannot be written (%s): the run goes on, and %s until it can%s", self.what,
                           self.error, self.meanwhile, self._later_outages())

    def succeeded(self) -> None:
        if not self.going_on:
            return
        self.going_on = False
        if self._logged():
            counts = f": {self.dropped - self._dropped_at_start} dropped meanwhile, {self.dropped} in all"
            logger.warning("%s is written again after %s%s", self.what, self.error, counts if self.dropped else "")

    def _logged(self) -> bool:
        """Only the 1st, 2nd, 4th, 8th... outage is logged."""
        return self.count & (self.count - 1) == 0

    def _later_outages(self) -> str:
        return "" if self.count == 1 else f" (outage {self.count}; the next logged is outage {2 * self.count})"


class LineFile:
    """Lines appended to one file (opened when first needed, and again after a failed open), never raising OSError."""

    def __init__(self, path: str | Path, *, what: str) -> None:
        self.path = Path(path)
        self.outages = Outages(f"{what} {self.path}")
        self._fd: int | None = None
        self._size = 0  # bytes up to the end of the last whole line
        self._torn = False  # the file ends in part of a line that could not be cut off

    @property
    def dropped(self) -> int:
        """Lines not written, so far."""
        return self.outages.dropped

    @property
    def empty(self) -> bool:
        """Whether the file holds nothing, as far as this writer knows (a file not yet opened: its size on disk)."""
        if self._fd is None:
            try:
                return self.path.stat().st_size == 0
            except OSError:
                return True
        return self._size == 0 and not self._torn

    def append(self, text: str, *, lines: int = 1) -> bool:
        """Append `text` (`lines` whole lines, each ending in a newline); whether the file took it all. When it did
        not, the `lines` are dropped and counted, and none of them is left in part."""
        data = memoryview(text.encode("utf-8"))
        written = 0
        try:
            if self._fd is None:
                self._open()
            if self._torn:
                self._write(b"\n")
                self._size, self._torn = self._size + 1, False
            while written < len(data):
                written += self._write(data[written:])
        except OSError as error:
            if written:
                self._cut_back()
            self.outages.failed(error, dropped=lines)
            return False
        self._size += written
        self.outages.succeeded()
        return True

    def open(self) -> None:
        """Open (or create) the file now, when it can be; else the next append tries again."""
        if self._fd is None:
            try:
                self._open()
            except OSError as error:
                self.outages.failed(error, dropped=0)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError as error:  # a close can report a write-back that failed: those lines may be lost
                logger.warning("%s: closing it failed (%s): its last lines may be lost", self.path, error)

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # read: its last byte, below
        self._size = os.fstat(self._fd).st_size
        self._torn = self._size > 0 and os.pread(self._fd, 1, self._size - 1) != b"\n"

    def _write(self, data: bytes | memoryview) -> int:
        assert self._fd is not None
        return os.write(self._fd, data)

    def _cut_back(self) -> None:
        """Remove the part of a line a failed write left (truncating frees space, so it works on a full disk)."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            self._torn = True
