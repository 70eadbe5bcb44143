"""A run's telemetry on disk, between the recorder and the control plane: the spool folder and every file in it.

The spool holds the journal of records as they are written (`open.jsonl`), the numbered batches sealed from it
(`batch-<seq>.json`, sent in the order of their numbers by `control_plane.py`), the last number given (`last_seq`),
the count of items dropped so far (`dropped`) and the batches set aside (`refused/`). No HTTP here: the sender asks
for the batches, removes those applied, and tells the spool what the control plane's answers mean for the files.

What it guarantees, whenever the controller is killed (a SIGKILL, an OOM kill, a power cut):
- Exactly once: each record is in exactly one batch, and a batch keeps the number the control plane knows it by
  (its file's name; the seq inside is set from it when sent), so a batch sent again is applied once.
- Nothing lost at any point: every file is written beside its place, fsynced and renamed over it, and the folder
  fsynced; the changes of several steps leave what the next spool on the folder finishes (`finish_interrupted`):
  records being sealed stay in `sealing-<seq>.jsonl` until all their batches are written; a split's halves go to
  `split-<seq>.json` first; a renumbering stopped midway leaves a gap that the next `realign` closes.
- A refused item never blocks what comes after: items are removed from their batch (`remove_items`), a batch is
  set aside in `refused/` leaving an empty batch of its number (`quarantine`), a batch over the size limit is split
  in two, the later ones renumbered one up (`split`).

`last_seq` holds the last number given, for a spool whose batches were all delivered; when it cannot be read,
batches are numbered far ahead (`FAR_AHEAD_SEQ`) and renumbered from the control plane's `sequence_gap` answer.
`dropped` holds the count of items dropped so far; one that cannot be read is copied aside and said so
(`dropped_unreadable`), the count going on from 0: never reset silently.

A full disk never ends the run (the training loop appends): a record the journal cannot take is dropped and counted
by section (`take_unwritten`, for the sender to report once the journal takes records again), logged once an
outage (`line_file.py`), and the journal is never left with part of a line before the next record. The spool's other
writes (sealing, splitting, the markers) run in the sender's thread; one that fails leaves the files as a kill there
would, finished by a later seal once there is space.

Durability: journal lines are written (one write(2) each), not fsynced: a controller killed loses none, and the
sender seals the journal every `flush_seconds`, off the training loop, into batch files that are fsynced. So a power
cut loses at most the records of the last seconds, never a batch, and the training loop pays no fsync per record or
step. A `.tmp` file left by a kill between a write and its rename is removed when the next spool opens the folder
(it is never read: its write is done again from what it was made of).
Django-free: this runs on GPU nodes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from workers.engine.line_file import LineFile
from workers.engine.telemetry_wire import (
    MAX_EVENTS_PER_BATCH,
    MAX_LOGS_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_REQUEST_BYTES,
)

logger = logging.getLogger(__name__)
BATCH_FILE_DIGITS = 12
FAR_AHEAD_SEQ = 10 ** (BATCH_FILE_DIGITS - 1)  # past any run's batches: the control plane answers sequence_gap
SECTION_LIMITS = {"metrics": MAX_METRICS_PER_BATCH, "events": MAX_EVENTS_PER_BATCH, "logs": MAX_LOGS_PER_BATCH}
MAX_BATCH_BYTES = MAX_REQUEST_BYTES // 2  # a sealed batch is split above this
TEMPORARY_SUFFIX = ".tmp"  # a file written beside its place, then renamed over it


@dataclass(frozen=True)
class SpooledBatch:
    """A batch file in the spool, numbered by its file's name."""

    seq: int
    path: Path

    @classmethod
    def at(cls, path: Path) -> SpooledBatch:
        return cls(seq=_seq_of(path), path=path)


class TelemetrySpool:
    """The spool folder of one run's controller: journal, batches, markers; crash-safe, thread-safe appends."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.refused_folder = self.folder / "refused"
        _remove_stale_temporaries(self.folder, self.refused_folder)
        # Every record is appended to an open journal as it is written, so a controller killed mid-batch
        # loses nothing: the journal is in the OS's hands, and the next controller seals it first.
        self._journal_path = self.folder / "open.jsonl"
        self._journal = LineFile(self._journal_path, what="the telemetry journal")
        self._journal.open()
        self._journal_metrics = 0
        self._unwritten = {section: 0 for section in SECTION_LIMITS}  # dropped by the journal, not yet reported
        self._lock = threading.Lock()
        self.next_seq = self._first_free_seq()
        self.dropped_unreadable: str | None = None  # why the `dropped` count could not be read
        self.dropped = self._dropped_so_far()

    # --- records in -------------------------------------------------------------------------------
    def append(self, section: str, item: dict) -> bool:
        """Journal one wire item; True when the journal holds a batch's worth of metrics (time to seal). Raises no
        OSError: an item the journal cannot take (a full disk) is dropped and counted (`take_unwritten`)."""
        line = json.dumps([section, item]) + "\n"
        with self._lock:
            if not self._journal.append(line):
                self._unwritten[section] += 1
                return False
            self._journal_metrics += section == "metrics"
            return self._journal_metrics >= MAX_METRICS_PER_BATCH

    @property
    def journal_error(self) -> str:
        """The first error of the journal's latest outage ("" when it had none)."""
        return self._journal.outages.error

    def take_unwritten(self, *, even_now: bool = False) -> dict[str, int]:
        """The items dropped because the journal could not take them, by section, once it takes items again (then
        they are reported once: the counts start again from 0); nothing while it cannot, unless `even_now` (the
        last chance, at close)."""
        with self._lock:
            if (self._journal.outages.going_on and not even_now) or not any(self._unwritten.values()):
                return {}
            unwritten = {section: n for section, n in self._unwritten.items() if n}
            self._unwritten = dict.fromkeys(SECTION_LIMITS, 0)
            return unwritten

    def count_dropped(self, count: int) -> int:
        """Add `count` to the items dropped so far (kept in `dropped` for the next controller); the new total.
        Raises no OSError: a count that cannot be written now is written with the next one."""
        with self._lock:
            self.dropped += count
            try:
                _write_atomically(self.folder / "dropped", str(self.dropped))
            except OSError as error:
                logger.warning("telemetry spool %s: the count of dropped items (%d) cannot be written (%s); it is "
                               "written with the next drop", self.folder, self.dropped, error)
            return self.dropped

    def close(self) -> None:
        if any(self._unwritten.values()):
            logger.error("telemetry spool %s closed with items its journal could not take, not reported: %s",
                         self.folder, {section: n for section, n in self._unwritten.items() if n})
        self._journal.close()

    # --- sealing ----------------------------------------------------------------------------------
    def seal(self) -> None:
        """Turn the open journal into the next numbered batches, each within the limits.

        What a controller killed in the middle of a spool change left is finished first. The journal is renamed
        `sealing-<its first seq>.jsonl` (a new one opened at once), packed into batch files, then removed: killed
        before that, the next seal packs it again into the same numbers, so each record is in exactly one batch."""
        self.finish_interrupted()
        with self._lock:
            if self._journal.empty:
                return
            sealing = self.folder / f"sealing-{self.next_seq:0{BATCH_FILE_DIGITS}d}.jsonl"
            self._journal.close()
            try:
                os.replace(self._journal_path, sealing)
                self._journal_metrics = 0
            finally:
                self._journal.open()
        self._pack_journal(sealing)

    def finish_interrupted(self) -> None:
        """Finish the splits and seals a controller was killed in the middle of (in the order they were begun)."""
        for intent in _numbered(self.folder, "split-*.json"):
            self._finish_split(intent)
        for sealing in _numbered(self.folder, "sealing-*.jsonl"):
            self._pack_journal(sealing)

    def _pack_journal(self, sealing: Path) -> None:
        """Write a sealing journal's records as batches numbered from the one in its name, then remove it."""
        items = []
        for line in sealing.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                section, item = json.loads(line)
            except (ValueError, TypeError):
                continue  # a line cut short by a kill (or garbled on disk)
            if isinstance(section, str) and section in SECTION_LIMITS:
                items.append((section, item, len(line)))
        batches = _pack(items, first_seq=_seq_of(sealing))
        for batch in batches:
            self._write_batch(batch["seq"], batch)
        if batches:
            self.next_seq = max(self.next_seq, batches[-1]["seq"] + 1)
            self._write_last_seq()
        sealing.unlink()
        _sync_folder(self.folder)

    # --- batches out ------------------------------------------------------------------------------
    def batches(self) -> list[SpooledBatch]:
        """The spooled batches, in the order of their numbers."""
        return [SpooledBatch.at(path) for path in _numbered(self.folder, "batch-*.json")]

    def text_to_send(self, batch: SpooledBatch) -> str:
        """A spooled batch as it is sent: numbered by its file's name (renumbering renames the file)."""
        text = batch.path.read_text(encoding="utf-8", errors="replace")
        if text.startswith(f'{{"seq": {batch.seq}, '):
            return text
        try:
            content = json.loads(text)
        except ValueError:
            return text  # the control plane refuses it as a whole, and it is set aside (`quarantine`)
        return json.dumps(content | {"seq": batch.seq}) if isinstance(content, dict) else text

    def remove(self, batch: SpooledBatch) -> None:
        """A batch the control plane has applied."""
        batch.path.unlink(missing_ok=True)

    # --- what the control plane refuses -----------------------------------------------------------
    def remove_items(self, batch: SpooledBatch, refused: set[tuple[str, int]]) -> dict[str, int]:
        """Remove the refused (section, index) items from a batch, rewritten crash-safe; how many left each section
        (nothing for a batch that is not a JSON object: it is refused as a whole)."""
        content = _read_batch(batch.path)
        if content is None:
            return {}
        counts = {}
        for section in SECTION_LIMITS:
            items = _section(content, section)
            content[section] = [item for i, item in enumerate(items) if (section, i) not in refused]
            counts[section] = len(items) - len(content[section])
        if any(counts.values()):
            self._write_batch(batch.seq, content)
        return counts

    def quarantine(self, batch: SpooledBatch) -> dict[str, int]:
        """Copy a batch to refused/, then leave an empty batch of the same number, so the next ones follow (killed in
        between, the controller sends the batch again); how many items it held, by section."""
        content = _read_batch(batch.path)
        self.refused_folder.mkdir(exist_ok=True)
        _write_atomically(self.refused_folder / batch.path.name, batch.path.read_bytes())
        self._write_batch(batch.seq, {"metrics": [], "events": [], "logs": []})
        return {section: len(_section(content or {}, section)) for section in SECTION_LIMITS}

    def split(self, batch: SpooledBatch) -> str | None:
        """Split a batch over the size limit in two, the batches after it renumbered one up; or, for one that cannot
        be split (a single item, not a JSON object), why, leaving it as it is.

        The later batches are moved one by one from the last (killed midway, the controller leaves a gap that the
        next sequence_gap answer closes); then both halves are written to `split-<seq>.json`, and from there to
        their places (`_finish_split`, which the next controller runs when this one was killed before the end)."""
        content = _read_batch(batch.path)
        items = [(section, item) for section in SECTION_LIMITS for item in _section(content or {}, section)]
        if len(items) < 2:
            return ("a single item over the request-size limit" if content is not None else
                    "a batch over the request-size limit that is not a JSON object")
        halves = []
        for half in items[: len(items) // 2], items[len(items) // 2:]:
            part: dict = {"metrics": [], "events": [], "logs": []}
            for section, item in half:
                part[section].append(item)
            halves.append(part)
        for later in reversed([b for b in self.batches() if b.seq > batch.seq]):
            self._move(later, later.seq + 1)
        self.next_seq += 1
        self._write_last_seq()
        intent = self.folder / f"split-{batch.seq:0{BATCH_FILE_DIGITS}d}.json"
        _write_atomically(intent, json.dumps(halves))
        self._finish_split(intent)
        logger.warning("telemetry batch %d was over the size limit: split in two", batch.seq)
        return None

    def _finish_split(self, intent: Path) -> None:
        """Write a split's halves to their places, then remove its intent (a controller killed before that leaves it
        to the next one, which writes the same halves to the same places)."""
        seq = _seq_of(intent)
        try:
            halves = json.loads(intent.read_text(encoding="utf-8"))
        except ValueError:
            halves = None
        if not (isinstance(halves, list) and len(halves) == 2 and all(isinstance(h, dict) for h in halves)):
            logger.error("telemetry spool %s: %s is not a split's two halves; set aside in refused/", self.folder,
                         intent.name)  # written whole or not at all, so only a damaged disk gets here
            self.refused_folder.mkdir(exist_ok=True)
            os.replace(intent, self.refused_folder / intent.name)
            return
        self._write_batch(seq + 1, halves[1])
        self._write_batch(seq, halves[0])
        intent.unlink()
        _sync_folder(self.folder)

    def realign(self, sent: list[SpooledBatch], *, expected: int) -> None:
        """The control plane expects batch `expected` next: remove the sent batches it already has; renumber from
        `expected` if it lacks batches we no longer hold.

        The batches are renamed one by one from the first (no name is taken twice): killed midway, the controller
        leaves a gap, and the next sequence_gap answer renumbers the rest."""
        for batch in sent:
            if batch.seq < expected:
                self.remove(batch)
        remaining = self.batches()
        if remaining and remaining[0].seq > expected:
            logger.error("control plane expects batch %d but the spool starts at %d; renumbering", expected,
                         remaining[0].seq)
            for offset, batch in enumerate(remaining):
                self._move(batch, expected + offset)
            self.next_seq = expected + len(remaining)
            self._write_last_seq()

    # --- numbering ----------------------------------------------------------------------------------
    def _first_free_seq(self) -> int:
        """The next batch's number: after the spooled batches and after `last_seq`, the last number given.

        A marker that cannot be read (empty, garbled, negative, more digits than a batch file's name has) with no
        batch spooled gives FAR_AHEAD_SEQ: the control plane answers sequence_gap, and the batches are renumbered
        from the number it expects (`realign`); a lower guess would have them skipped as batches it already has."""
        highest = max((batch.seq for batch in self.batches()), default=0)
        marker = self.folder / "last_seq"
        try:
            text = marker.read_bytes().decode("ascii").strip()
        except FileNotFoundError:
            return highest + 1  # a new spool
        except (OSError, UnicodeDecodeError) as exc:
            text = f"<{type(exc).__name__}>"
        if text.isdigit() and len(text) <= BATCH_FILE_DIGITS:
            return max(highest, int(text)) + 1
        first = highest + 1 if highest else FAR_AHEAD_SEQ
        logger.error("telemetry spool %s: its last_seq marker cannot be read (%r); batches are numbered from %d, %s",
                     self.folder, text[:40], first, "after the spooled ones" if highest else
                     "until the control plane's sequence_gap answer says which number it expects")
        return first

    def _dropped_so_far(self) -> int:
        """The count kept in `dropped` (0 for a new spool). One that cannot be read is copied aside
        (`dropped.unreadable-<ns>`) and said so (`dropped_unreadable`, an error logged): the count goes on from 0."""
        marker = self.folder / "dropped"
        try:
            text = marker.read_bytes().decode("ascii").strip()
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError) as exc:
            text = f"<{type(exc).__name__}>"
        if text.isdigit():
            return int(text)
        aside = marker.with_name(f"dropped.unreadable-{time.time_ns()}")
        try:
            shutil.copyfile(marker, aside)
        except OSError as exc:
            aside = Path(f"not kept: {exc}")
        self.dropped_unreadable = f"{text[:40]!r}, kept at {aside}"
        logger.error("telemetry spool %s: the count of items dropped by earlier controllers cannot be read (%s); "
                     "counted again from 0", self.folder, self.dropped_unreadable)
        return 0

    def _batch_path(self, seq: int) -> Path:
        return self.folder / f"batch-{seq:0{BATCH_FILE_DIGITS}d}.json"

    def _write_batch(self, seq: int, batch: dict) -> None:
        """Write batch `seq` (its number first, as `text_to_send` expects), crash-safe."""
        sections = {key: value for key, value in batch.items() if key != "seq"}
        _write_atomically(self._batch_path(seq), json.dumps({"seq": seq} | sections))

    def _write_last_seq(self) -> None:
        _write_atomically(self.folder / "last_seq", str(self.next_seq - 1))

    def _move(self, batch: SpooledBatch, seq: int) -> None:
        """Renumber a spooled batch: one rename, done or not whenever the controller is killed."""
        os.rename(batch.path, self._batch_path(seq))
        _sync_folder(self.folder)


def _seq_of(path: Path) -> int:
    return int(_number_text(path))


def _number_text(path: Path) -> str:
    return path.name.split("-")[1].split(".")[0]


def _numbered(folder: Path, pattern: str) -> list[Path]:
    """The files of `folder` matching `pattern` (`name-*.ext`) whose * is a number (ASCII digits: int() refuses
    another script's), in the order of their numbers."""
    paths = [path for path in folder.glob(pattern) if _number_text(path).isascii() and _number_text(path).isdigit()]
    return sorted(paths, key=_seq_of)


def _read_batch(path: Path) -> dict | None:
    """A spooled batch, or None when it is not a JSON object (the control plane refuses it as a whole)."""
    try:
        batch = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return None
    return batch if isinstance(batch, dict) else None


def _section(batch: dict, section: str) -> list:
    items = batch.get(section)
    return items if isinstance(items, list) else []


def _write_atomically(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old file or the new one whole: written beside it,
    fsynced, renamed over it."""
    tmp = path.with_name(f"{path.name}{TEMPORARY_SUFFIX}")
    view = memoryview(data.encode("utf-8") if isinstance(data, str) else data)
    try:
        descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while view:
                view = view[os.write(descriptor, view):]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def _remove_stale_temporaries(*folders: Path) -> None:
    """Remove the `.tmp` files a controller killed between a write and its rename left (space, on a full disk)."""
    for folder in folders:
        for stale in folder.glob(f"*{TEMPORARY_SUFFIX}"):
            try:
                stale.unlink()
            except OSError as exc:
                logger.warning("telemetry spool: %s could not be removed: %s", stale, exc)


def _sync_folder(folder: Path) -> None:
    """Make the renames and removals in `folder` durable."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _pack(items: list[tuple[str, dict, int]], *, first_seq: int) -> list[dict]:
    """Journal items (section, item, size) in order, as consecutive batches within the count and size limits."""
    batches: list[dict] = []
    batch: dict | None = None
    size = 0
    for section, item, length in items:
        full = batch is not None and (len(batch[section]) >= SECTION_LIMITS[section] or size + length > MAX_BATCH_BYTES)
        if batch is None or (full and size > 0):  # a batch holds at least one item, however large
            batch = {"seq": first_seq + len(batches), "metrics": [], "events": [], "logs": []}
            batches.append(batch)
            size = 0
        batch[section].append(item)
        size += length
    return batches
