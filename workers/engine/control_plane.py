"""The engine's client for the control plane: telemetry out (a metrics Sink); commands come in through `command_channel.py`.

Records are grouped into numbered batches, written to a spool folder first, then sent in order
with retries and backoff. The control plane applies each batch exactly once, so a batch sent twice
(a lost response, a restart) is harmless, and a control plane that is down loses nothing: the
spool is replayed when it is back, or by the next controller that opens the same spool folder.
Django-free: this runs on GPU nodes.

A batch the control plane cannot take never blocks the ones after it: items it refuses (422
`items_refused`, named by seq, section and index) are removed from the spooled batch, which is sent
again; a batch refused as a whole (another 4xx) is retried a few times, alone, then moved to
`spool/refused/` (an empty batch keeps its number). Every drop is recorded: a `message` event named
`telemetry_dropped` and the `telemetry/dropped` metric (items dropped so far). A batch over the
request-size limit is split. 5xx answers and network errors are retried with backoff, forever.

A controller killed at any point loses and doubles nothing: a batch's number is its file's name (the seq inside is
set from it when sent), so renumbering one is one rename, and every file is written beside its place, fsynced and
renamed over it. The changes of several steps leave what the next controller on the folder finishes: records being
sealed stay in `sealing-<seq>.jsonl` until all their batches are written; a split's halves go to `split-<seq>.json`
first; a renumbering stopped midway leaves a gap that the next `sequence_gap` answer closes. `last_seq` holds the last
number given, for a spool whose batches were all delivered; when it cannot be read, batches are numbered far ahead
and renumbered from the control plane's `sequence_gap` answer.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from workers.engine.env import CONTROL_PLANE_URL_ENV, RUN_ID_ENV, RUN_TOKEN_FILE_ENV, read_env, read_number
from workers.engine.metrics import Record
from workers.engine.telemetry_wire import (
    MAX_EVENTS_PER_BATCH,
    MAX_LOG_LINE_CHARS,
    MAX_LOGS_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_REQUEST_BYTES,
    EventKindName,
    TelemetryResponse,
)
from workers.engine.wire_limits import MAX_JSON_DEPTH, unstorable_reason

logger = logging.getLogger(__name__)
EVENT_KINDS = set(EventKindName.__args__)
BATCH_FILE_DIGITS = 12
FAR_AHEAD_SEQ = 10 ** (BATCH_FILE_DIGITS - 1)  # past any run's batches: the control plane answers sequence_gap
SECTION_LIMITS = {"metrics": MAX_METRICS_PER_BATCH, "events": MAX_EVENTS_PER_BATCH, "logs": MAX_LOGS_PER_BATCH}
REQUEST_BUDGET = MAX_REQUEST_BYTES - 64 * 1024  # room for the request's envelope
MAX_BATCH_BYTES = MAX_REQUEST_BYTES // 2  # a sealed batch is split above this
MAX_BATCHES_SENT = 16
MAX_REFUSALS = 3  # answers refusing one batch as a whole before it is quarantined
RETRYABLE_STATUSES = {401, 403, 404, 408, 425, 429}  # a new token, a run not yet visible, a brake: try later
MAX_PAYLOAD_TEXT = 65_536
MAX_PAYLOAD_NODES = 10_000
DROPPED_KEY = "telemetry/dropped"


def wire_text(value: str) -> str:
    """Text a database can store: NUL and lone surrogates become U+FFFD."""
    if unstorable_reason(value) is None:
        return value
    return value.replace("\x00", "\ufffd").encode("utf-8", errors="replace").decode("utf-8")


def wire_value(value: Any, *, depth: int = 0, budget: list[int] | None = None, path: frozenset = frozenset()) -> Any:
    """A JSON value the control plane stores as it is: nesting bounded, no cycles, finite numbers, storable text."""
    budget = [MAX_PAYLOAD_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        return "..."
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return wire_text(value[:MAX_PAYLOAD_TEXT])
    if id(value) in path:
        return f"<{type(value).__name__}: a cycle>"
    if depth >= MAX_JSON_DEPTH - 1:
        return f"<{type(value).__name__} nested deeper than {MAX_JSON_DEPTH} levels>"
    if isinstance(value, dict):
        inner = path | {id(value)}
        return {wire_text(k if isinstance(k, str) else str(k)): wire_value(v, depth=depth + 1, budget=budget, path=inner)
                for k, v in list(value.items())[:MAX_PAYLOAD_NODES]}
    if isinstance(value, list | tuple | set | frozenset):
        inner = path | {id(value)}
        return [wire_value(v, depth=depth + 1, budget=budget, path=inner) for v in list(value)[:MAX_PAYLOAD_NODES]]
    return wire_text(str(value)[:MAX_PAYLOAD_TEXT])


def _number(value: Any, kind: type) -> Any:
    """The value as `kind` when it converts, else as text: the control plane refuses it, and says so."""
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        return wire_text(str(value)[:200])


@dataclass(frozen=True)
class ControlPlaneTarget:
    url: str
    run_id: int
    token: str

    @classmethod
    def from_environment(cls) -> ControlPlaneTarget | None:
        """FORGEBOARD_URL, FORGEBOARD_RUN_ID and FORGEBOARD_RUN_TOKEN_FILE, as the launch backends set them."""
        url, run_id, token_file = (read_env(n) for n in (CONTROL_PLANE_URL_ENV, RUN_ID_ENV, RUN_TOKEN_FILE_ENV))
        if not (url and run_id and token_file):
            return None
        return cls(url=url.rstrip("/"), run_id=read_number(RUN_ID_ENV), token=Path(token_file).read_text().strip())


def record_to_wire(record: Record) -> tuple[str, dict[str, Any]]:
    """('metrics' | 'events', wire item) for one recorder record; never raises, whatever the record holds."""
    when = _number(record.get("time", time.time()), float)
    if record.get("kind") == "metric":
        key = record.get("key")
        return "metrics", {"key": wire_text(key if isinstance(key, str) else str(key)),
                           "step": _number(record.get("step"), int), "value": _number(record.get("value"), float),
                           "time": when}
    fields = {k: v for k, v in record.items() if k not in ("seq", "time", "kind", "name")}
    if record.get("kind") == "rollout":
        return "events", {"kind": "rollout", "payload": wire_value(fields), "time": when}
    name = record.get("name", "message")
    name = name if isinstance(name, str) else str(name)
    kind = name if name in EVENT_KINDS else "message"
    payload = fields if kind == name else {"name": name, **fields}
    return "events", {"kind": kind, "payload": wire_value(payload), "time": when}


class ControlPlaneSink:
    """A Sink that ships records to the control plane in the background, spooling to disk first."""

    def __init__(
        self,
        target: ControlPlaneTarget,
        *,
        spool_dir: str | Path,
        flush_seconds: float = 1.0,
        timeout_s: float = 10.0,
        max_backoff_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.target = target
        self.spool = Path(spool_dir)
        self.spool.mkdir(parents=True, exist_ok=True)
        self.flush_seconds = flush_seconds
        self.max_backoff_s = max_backoff_s
        self.pending_commands: list[int] = []
        # Every record is appended to an open journal as it is written, so a controller killed mid-batch
        # loses nothing: the journal is in the OS's hands, and the next controller seals it first.
        self._journal_path = self.spool / "open.jsonl"
        self._journal = open(self._journal_path, "a", encoding="utf-8")
        self._journal_metrics = 0
        self._lock = threading.Lock()
        self._round = threading.Lock()  # one round of sealing and sending at a time: two could move one batch twice
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._next_seq = self._first_free_seq()
        self._window = MAX_BATCHES_SENT
        self._narrow_until = 0
        self._refusals: dict[int, int] = {}
        self.dropped = self._dropped_so_far()
        self.dropped_by_section: dict[str, int] = {"metrics": 0, "events": 0, "logs": 0}
        try:
            self._seal_batch()  # what a previous controller recorded but did not seal
        except OSError:  # a full disk: the sender tries again, and the run starts meanwhile
            logger.exception("telemetry spool %s could not be sealed; trying again", self.spool)
        self._client = httpx.Client(
            base_url=target.url, timeout=timeout_s, transport=transport,
            headers={"Authorization": f"Bearer {target.token}"},
        )
        self._thread = threading.Thread(target=self._loop, name="forgeboard-telemetry", daemon=True)
        self._thread.start()

    # --- the Sink protocol -------------------------------------------------------------------
    def write(self, record: Record) -> None:
        self._append(*record_to_wire(record))

    def log_line(self, line: str) -> None:
        self._append("logs", {"line": wire_text(str(line)[:MAX_LOG_LINE_CHARS]), "time": time.time()})

    def _append(self, section: str, item: dict) -> None:
        with self._lock:
            self._journal.write(json.dumps([section, item]) + "\n")
            self._journal.flush()
            self._journal_metrics += section == "metrics"
            full = self._journal_metrics >= MAX_METRICS_PER_BATCH
        if full:
            self._wake.set()

    def close(self, *, timeout_s: float = 30.0) -> bool:
        """Flush and send what is left; True when nothing is left in the spool.

        Raises nothing (the recorder closes its sinks as the run ends): what cannot be sent now (the control plane
        down, a full disk) stays in the spool for the next controller on the same folder, and the log says so."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        if not self._round.acquire(timeout=timeout_s):
            logger.error("telemetry: the sender is still busy; what is not sent is left in the spool %s for the next "
                         "controller on this folder", self.spool)
            return False
        try:
            return self._flush(deadline)
        finally:
            self._client.close()
            self._journal.close()
            self._round.release()

    def _flush(self, deadline: float) -> bool:
        """Seal and send until nothing is left or the deadline passes; whether nothing is left."""
        left = None
        try:
            while True:
                self._seal_batch()  # again each time: a drop is reported as records of its own
                left = len(self._spooled())
                if not left or time.monotonic() >= deadline:
                    break
                if not self._send_spooled():
                    time.sleep(0.5)
        except Exception:  # noqa: BLE001 - a finished run stays finished: the spool keeps what was not sent
            logger.exception("telemetry: the final flush failed")
            left = None
        if left == 0:
            return True
        logger.error("telemetry not all sent: %s left in the spool %s, for the next controller on this folder",
                     f"{left} batches" if left else "what was not sent is", self.spool)
        return False

    # --- spool ---------------------------------------------------------------------------------
    def _spooled(self) -> list[Path]:
        """The spooled batches, in the order of their numbers."""
        return _numbered(self.spool, "batch-*.json")

    def _first_free_seq(self) -> int:
        """The next batch's number: after the spooled batches and after `last_seq`, the last number given.

        A marker that cannot be read (empty, garbled, negative, more digits than a batch file's name has) with no
        batch spooled gives FAR_AHEAD_SEQ: the control plane answers sequence_gap, and the batches are renumbered
        from the number it expects (`_realign`); a lower guess would have them skipped as batches it already has."""
        highest = max((_seq_of(path) for path in self._spooled()), default=0)
        marker = self.spool / "last_seq"
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
                     self.spool, text[:40], first, "after the spooled ones" if highest else
                     "until the control plane's sequence_gap answer says which number it expects")
        return first

    def _batch_path(self, seq: int) -> Path:
        return self.spool / f"batch-{seq:0{BATCH_FILE_DIGITS}d}.json"

    def _write_batch(self, seq: int, batch: dict) -> None:
        """Write batch `seq` (its number first, as `_batch_text` expects), crash-safe."""
        sections = {key: value for key, value in batch.items() if key != "seq"}
        _write_atomically(self._batch_path(seq), json.dumps({"seq": seq} | sections))

    def _write_last_seq(self) -> None:
        _write_atomically(self.spool / "last_seq", str(self._next_seq - 1))

    def _move(self, path: Path, seq: int) -> None:
        """Renumber a spooled batch: one rename, done or not whenever the controller is killed."""
        os.rename(path, self._batch_path(seq))
        _sync_folder(self.spool)

    def _seal_batch(self) -> None:
        """Turn the open journal into the next numbered batches, each within the limits.

        What a controller killed in the middle of a spool change left is finished first. The journal is renamed
        `sealing-<its first seq>.jsonl` (a new one opened at once), packed into batch files, then removed: killed
        before that, the next seal packs it again into the same numbers, so each record is in exactly one batch."""
        self._finish_interrupted()
        with self._lock:
            if os.fstat(self._journal.fileno()).st_size == 0:
                return
            sealing = self.spool / f"sealing-{self._next_seq:0{BATCH_FILE_DIGITS}d}.jsonl"
            self._journal.close()
            try:
                os.replace(self._journal_path, sealing)
                self._journal_metrics = 0
            finally:
                self._journal = open(self._journal_path, "a", encoding="utf-8")
        self._pack_journal(sealing)

    def _finish_interrupted(self) -> None:
        """Finish the splits and seals a controller was killed in the middle of (in the order they were begun)."""
        for intent in _numbered(self.spool, "split-*.json"):
            self._finish_split(intent)
        for sealing in _numbered(self.spool, "sealing-*.jsonl"):
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
            self._next_seq = max(self._next_seq, batches[-1]["seq"] + 1)
            self._write_last_seq()
        sealing.unlink()
        _sync_folder(self.spool)

    def _send_spooled(self) -> bool:
        """Send spooled batches in order (a few per request, within the size limit). False: retry later."""
        files = self._spooled()[:self._window]
        if not files:
            return self._heartbeat()
        texts: list[str] = []
        sent: list[Path] = []
        size = 0
        for path in files:
            text = _batch_text(path)
            length = len(text.encode("utf-8")) + 2
            if length > REQUEST_BUDGET and not sent:
                self._split(path)
                return True
            if size + length > REQUEST_BUDGET:
                break
            texts.append(text)
            sent.append(path)
            size += length
        body = ('{"batches": [' + ", ".join(texts) + "]}").encode("utf-8")
        try:
            response = self._client.post(f"/api/v1/controller/runs/{self.target.run_id}/telemetry", content=body,
                                         headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            logger.warning("control plane unreachable (%s); %d batches spooled", exc, len(self._spooled()))
            return False
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        answer = answer if isinstance(answer, dict) else {}
        status, code = response.status_code, answer.get("code")
        expected = answer.get("expected_seq")
        if status == 409 and code == "sequence_gap" and isinstance(expected, int) and not isinstance(expected, bool):
            self._realign(sent, expected=expected)
            return True
        if status == 422 and code == "items_refused":
            return self._drop_refused(sent, answer)
        if status == 413 and len(sent) == 1:
            self._split(sent[0])
            return True
        if status != 200:
            logger.error("control plane refused telemetry: %s %s", status, response.text[:500])
            if status >= 500 or status in RETRYABLE_STATUSES:
                return False
            return self._refused_whole(sent, reason=f"HTTP {status}: {str(answer.get('message', ''))[:300]}")
        try:
            result = TelemetryResponse.model_validate(answer)
        except ValidationError:
            logger.error("control plane answered telemetry with what is not its answer: %s", response.text[:500])
            return False
        self.pending_commands = result.pending_commands
        for path in sent:
            if _seq_of(path) <= result.applied_seq:
                path.unlink(missing_ok=True)
                self._refusals.pop(_seq_of(path), None)
        if result.applied_seq >= self._narrow_until:
            self._window = MAX_BATCHES_SENT
        if result.duplicates_dropped_total:
            seqs = sorted({d.seq for d in result.duplicates_dropped})
            self._record_dropped(
                {"metrics": result.duplicates_dropped_total}, seq=seqs[0] if seqs else 0,
                reasons=[f"{d.key} step {d.step}: a later value in the same batch was kept"
                         for d in result.duplicates_dropped[:5]])
        return True

    # --- what the control plane refuses ---------------------------------------------------------
    def _drop_refused(self, sent: list[Path], answer: dict) -> bool:
        """Remove the refused items from their spooled batches (rewritten atomically); the rest is sent again."""
        by_seq: dict[int, set[tuple[str, int]]] = {}
        reasons: dict[int, list[str]] = {}
        for item in answer.get("refused") or []:
            try:
                seq, section, index = int(item["seq"]), str(item["section"]), int(item["index"])
            except (KeyError, TypeError, ValueError):
                continue
            by_seq.setdefault(seq, set()).add((section, index))
            reasons.setdefault(seq, []).append(f"{item.get('field', section)}: {item.get('reason', '')}"[:300])
        removed_any = False
        for path in sent:
            seq = _seq_of(path)
            if seq not in by_seq:
                continue
            batch = _read_batch(path)
            if batch is None:
                continue
            counts = {}
            for section in SECTION_LIMITS:
                items = _section(batch, section)
                batch[section] = [item for i, item in enumerate(items) if (section, i) not in by_seq[seq]]
                counts[section] = len(items) - len(batch[section])
            if not any(counts.values()):
                continue
            removed_any = True
            self._write_batch(seq, batch)
            self._record_dropped(counts, seq=seq, reasons=reasons[seq][:5])
        if not removed_any:  # the answer names nothing we hold: count it as a refusal of the batch
            return self._refused_whole(sent, reason="items refused that this spool does not hold")
        return True

    def _refused_whole(self, sent: list[Path], *, reason: str) -> bool:
        """A batch refused as a whole: find which (one batch a request), retry it a few times, then quarantine it."""
        if len(sent) > 1:
            self._window, self._narrow_until = 1, _seq_of(sent[-1])
            return True
        seq = _seq_of(sent[0])
        self._refusals[seq] = self._refusals.get(seq, 0) + 1
        if self._refusals[seq] < MAX_REFUSALS:
            return False
        self._quarantine(sent[0], reason=reason)
        return True

    def _quarantine(self, path: Path, *, reason: str) -> None:
        """Copy a batch to spool/refused/, then leave an empty batch of the same number, so the next ones follow
        (killed in between, the controller sends the batch again)."""
        seq = _seq_of(path)
        batch = _read_batch(path)
        refused_dir = self.spool / "refused"
        refused_dir.mkdir(exist_ok=True)
        _write_atomically(refused_dir / path.name, path.read_bytes())
        self._write_batch(seq, {"metrics": [], "events": [], "logs": []})
        self._refusals.pop(seq, None)
        logger.error("telemetry batch %d refused %d times (%s); moved to %s", seq, MAX_REFUSALS, reason, refused_dir)
        counts = {section: len(_section(batch or {}, section)) for section in SECTION_LIMITS}
        self._record_dropped(counts if any(counts.values()) else {"batches": 1}, seq=seq, reasons=[reason])

    def _split(self, path: Path) -> None:
        """Split a spooled batch over the size limit in two, the batches after it renumbered one up.

        The later batches are moved one by one from the last (killed midway, the controller leaves a gap that the
        next sequence_gap answer closes); then both halves are written to `split-<seq>.json`, and from there to
        their places (`_finish_split`, which the next controller runs when this one was killed before the end)."""
        batch = _read_batch(path)
        items = [(section, item) for section in SECTION_LIMITS for item in _section(batch or {}, section)]
        if len(items) < 2:
            self._quarantine(path, reason="a single item over the request-size limit" if batch is not None else
                             "a batch over the request-size limit that is not a JSON object")
            return
        seq = _seq_of(path)
        halves = []
        for half in items[: len(items) // 2], items[len(items) // 2:]:
            part: dict = {"metrics": [], "events": [], "logs": []}
            for section, item in half:
                part[section].append(item)
            halves.append(part)
        for later in reversed([p for p in self._spooled() if _seq_of(p) > seq]):
            self._move(later, _seq_of(later) + 1)
        self._next_seq += 1
        self._write_last_seq()
        intent = self.spool / f"split-{seq:0{BATCH_FILE_DIGITS}d}.json"
        _write_atomically(intent, json.dumps(halves))
        self._finish_split(intent)
        logger.warning("telemetry batch %d was over the size limit: split in two", seq)

    def _finish_split(self, intent: Path) -> None:
        """Write a split's halves to their places, then remove its intent (a controller killed before that leaves it
        to the next one, which writes the same halves to the same places)."""
        seq = _seq_of(intent)
        try:
            halves = json.loads(intent.read_text(encoding="utf-8"))
        except ValueError:
            halves = None
        if not (isinstance(halves, list) and len(halves) == 2 and all(isinstance(h, dict) for h in halves)):
            logger.error("telemetry spool %s: %s is not a split's two halves; set aside in refused/", self.spool,
                         intent.name)  # written whole or not at all, so only a damaged disk gets here
            (self.spool / "refused").mkdir(exist_ok=True)
            os.replace(intent, self.spool / "refused" / intent.name)
            return
        self._write_batch(seq + 1, halves[1])
        self._write_batch(seq, halves[0])
        intent.unlink()
        _sync_folder(self.spool)

    def _dropped_so_far(self) -> int:
        try:
            return int((self.spool / "dropped").read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _record_dropped(self, counts: dict[str, int], *, seq: int, reasons: list[str]) -> None:
        """Count what the control plane will never have, and report it (an event and the telemetry/dropped metric)."""
        count = sum(counts.values())
        if count <= 0:
            return
        with self._lock:
            self.dropped += count
            for section, n in counts.items():
                self.dropped_by_section[section] = self.dropped_by_section.get(section, 0) + n
            total = self.dropped
            _write_atomically(self.spool / "dropped", str(total))
        logger.warning("telemetry dropped: %d items of batch %d (%s)", count, seq, "; ".join(reasons)[:500])
        now = time.time()
        self._append("events", {"kind": "message", "time": now, "payload": wire_value(
            {"name": "telemetry_dropped", "seq": seq, "items": count, "total": total,
             "by_section": {k: v for k, v in counts.items() if v}, "reasons": reasons[:5]})})
        self._append("metrics", {"key": DROPPED_KEY, "step": total, "value": float(total), "time": now})

    def _realign(self, files: list[Path], *, expected: int) -> None:
        """Drop batches the control plane already has; renumber if it lacks batches we no longer hold.

        The batches are renamed one by one from the first (no name is taken twice): killed midway, the controller
        leaves a gap, and the next sequence_gap answer renumbers the rest."""
        for path in files:
            if _seq_of(path) < expected:
                path.unlink(missing_ok=True)
        remaining = self._spooled()
        if remaining and _seq_of(remaining[0]) > expected:
            logger.error("control plane expects batch %d but the spool starts at %d; renumbering", expected,
                         _seq_of(remaining[0]))
            for offset, path in enumerate(remaining):
                self._move(path, expected + offset)
            self._next_seq = expected + len(remaining)
            self._write_last_seq()

    def _heartbeat(self) -> bool:
        try:
            response = self._client.post(f"/api/v1/controller/runs/{self.target.run_id}/telemetry", json={"batches": []})
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        try:
            self.pending_commands = TelemetryResponse.model_validate(response.json()).pending_commands
        except ValueError:  # not JSON, or not the control plane's answer (a proxy's page)
            return False
        return True

    def _loop(self) -> None:
        backoff = self.flush_seconds
        while not self._stop.is_set():
            self._wake.wait(timeout=backoff)
            self._wake.clear()
            with self._round:
                if self._stop.is_set():
                    return
                try:
                    self._seal_batch()
                    sent = self._send_spooled()
                except Exception:  # noqa: BLE001 - a dead sender stops the heartbeats, and the run is taken for lost
                    logger.exception("telemetry round failed; trying again")
                    sent = False
            if sent:
                backoff = self.flush_seconds
            else:
                backoff = min(self.max_backoff_s, backoff * 2) * random.uniform(0.8, 1.2)


def _seq_of(path: Path) -> int:
    return int(_number_text(path))


def _number_text(path: Path) -> str:
    return path.name.split("-")[1].split(".")[0]


def _numbered(folder: Path, pattern: str) -> list[Path]:
    """The files of `folder` matching `pattern` (`name-*.ext`) whose * is a number (ASCII digits: int() refuses
    another script's), in the order of their numbers."""
    paths = [path for path in folder.glob(pattern) if _number_text(path).isascii() and _number_text(path).isdigit()]
    return sorted(paths, key=_seq_of)


def _batch_text(path: Path) -> str:
    """A spooled batch as it is sent: numbered by its file's name (renumbering renames the file)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    seq = _seq_of(path)
    if text.startswith(f'{{"seq": {seq}, '):
        return text
    try:
        batch = json.loads(text)
    except ValueError:
        return text  # the control plane refuses it as a whole, and it is set aside (`_refused_whole`)
    return json.dumps(batch | {"seq": seq}) if isinstance(batch, dict) else text


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
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        with open(tmp, "wb") as file:
            file.write(data.encode("utf-8") if isinstance(data, str) else data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


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
