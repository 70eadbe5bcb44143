"""The engine's client for the control plane: telemetry out (a metrics Sink); commands come in through `command_channel.py`.

Records go to a `TelemetrySpool` (`telemetry_spool.py`: the journal and the numbered batch files, crash-safe) as they
are written; a background sender seals them into batches and sends those in order, a few a request, with retries and
backoff. This module keeps no file of its own: what an answer means for the spooled batches it asks the spool to do.
Django-free: this runs on GPU nodes.

What it guarantees:
- Exactly once: the control plane applies each numbered batch once, so a batch sent twice (a lost response, a
  restart) is harmless; a batch is removed from the spool only once the control plane says it applied it.
- Nothing lost: a control plane that is down loses nothing (5xx answers, network errors, a token not yet valid are
  retried with backoff, forever); what is left at close stays in the spool and is sent by the next controller that
  opens the same folder, and the spool keeps it whole whenever the controller is killed.
- A refused item never blocks what comes after: items the control plane refuses (422 `items_refused`, named by seq,
  section and index) are removed from the spooled batch, which is sent again; a request refused as a whole (another
  4xx) is sent again a batch at a time, and a batch refused `MAX_REFUSALS` times is quarantined (an empty batch keeps
  its number); a batch over the request-size limit is split. Every drop is recorded: a `message` event named
  `telemetry_dropped` and the `telemetry/dropped` metric (items dropped so far).
- A spool numbered other than the control plane expects (a garbled `last_seq`, a renumbering stopped midway) is
  renumbered from its `sequence_gap` answer.
- Recording never ends the run: `write` raises nothing a full disk (or another OSError) causes. What the spool's
  journal cannot take is dropped, and reported like a refused item once it takes records again (`telemetry_dropped`,
  its reason saying so); a round whose seal fails (no space for the batches) only tells the control plane the run
  is alive (a heartbeat, so that it is not taken for lost), and sealing resumes by itself once there is space.
  Each outage is logged once (`line_file.Outages`).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from workers.engine.env import CONTROL_PLANE_URL_ENV, RUN_ID_ENV, RUN_TOKEN_FILE_ENV, read_env, read_number
from workers.engine.line_file import Outages
from workers.engine.metrics import Record
from workers.engine.telemetry_spool import SpooledBatch, TelemetrySpool
from workers.engine.telemetry_wire import MAX_LOG_LINE_CHARS, MAX_REQUEST_BYTES, EventKindName, TelemetryResponse
from workers.engine.wire_limits import MAX_JSON_DEPTH, unstorable_reason

logger = logging.getLogger(__name__)
EVENT_KINDS = set(EventKindName.__args__)
REQUEST_BUDGET = MAX_REQUEST_BYTES - 64 * 1024  # room for the request's envelope
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


@dataclass
class SendWindow:
    """How many spooled batches a request carries: up to MAX_BATCHES_SENT, or one at a time after a request was
    refused as a whole, until its last batch is applied (so that the refused batch is found, and only it held back)."""

    size: int = MAX_BATCHES_SENT
    narrow_until: int = 0

    def narrow(self, *, until: int) -> None:
        self.size, self.narrow_until = 1, until

    def applied(self, seq: int) -> None:
        if seq >= self.narrow_until:
            self.size = MAX_BATCHES_SENT


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
        self._spool = TelemetrySpool(spool_dir)
        self.flush_seconds = flush_seconds
        self.max_backoff_s = max_backoff_s
        self.pending_commands: list[int] = []
        self._round = threading.Lock()  # one round of sealing and sending at a time: two could move one batch twice
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._window = SendWindow()
        self._refusals: dict[int, int] = {}  # batch seq -> answers that refused it as a whole
        self.dropped_by_section: dict[str, int] = {"metrics": 0, "events": 0, "logs": 0}
        self._sealing = Outages(f"the telemetry batches of the spool {self.spool}",
                                meanwhile="records wait in its journal (the control plane hears the run is alive)")
        if self._spool.dropped_unreadable is not None:
            self._append("events", {"kind": "message", "time": time.time(), "payload": wire_value(
                {"name": "telemetry_dropped_count_lost", "reason": "the count of items dropped by earlier controllers "
                 f"cannot be read ({self._spool.dropped_unreadable}): counted again from 0"})})
        try:
            self._spool.seal()  # what a previous controller recorded but did not seal
        except OSError as error:  # a full disk: the sender tries again, and the run starts meanwhile
            self._sealing.failed(error, dropped=0)
        self._url = f"/api/v1/controller/runs/{target.run_id}/telemetry"
        self._client = httpx.Client(
            base_url=target.url, timeout=timeout_s, transport=transport,
            headers={"Authorization": f"Bearer {target.token}"},
        )
        self._thread = threading.Thread(target=self._loop, name="forgeboard-telemetry", daemon=True)
        self._thread.start()

    @property
    def spool(self) -> Path:
        """The spool's folder (the command ledger is kept there too)."""
        return self._spool.folder

    @property
    def dropped(self) -> int:
        """Items the control plane will never have, so far (counted across the controllers on this spool)."""
        return self._spool.dropped

    # --- the Sink protocol -------------------------------------------------------------------
    def write(self, record: Record) -> None:
        self._append(*record_to_wire(record))

    def log_line(self, line: str) -> None:
        self._append("logs", {"line": wire_text(str(line)[:MAX_LOG_LINE_CHARS]), "time": time.time()})

    def _append(self, section: str, item: dict) -> None:
        if self._spool.append(section, item):
            self._wake.set()
        self._report_unwritten()

    def _report_unwritten(self, *, even_now: bool = False) -> None:
        """Report what the journal could not take, once it takes records again (or at close: `even_now`)."""
        unwritten = self._spool.take_unwritten(even_now=even_now)
        if unwritten:
            self._record_dropped(unwritten, seq=self._spool.next_seq, reasons=[
                f"not written: the spool's journal could not take them ({self._spool.journal_error})"])

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
            self._spool.close()
            self._round.release()

    def _flush(self, deadline: float) -> bool:
        """Seal and send until nothing is left or the deadline passes; whether nothing is left."""
        left = None
        try:
            self._report_unwritten(even_now=True)  # the run's last records may be what ended an outage, or not
            while True:
                self._spool.seal()  # again each time: a drop is reported as records of its own
                left = len(self._spool.batches())
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

    # --- the sender ----------------------------------------------------------------------------
    def _loop(self) -> None:
        backoff = self.flush_seconds
        while not self._stop.is_set():
            self._wake.wait(timeout=backoff)
            self._wake.clear()
            with self._round:
                if self._stop.is_set():
                    return
                try:
                    self._spool.seal()
                    self._sealing.succeeded()
                    sent = self._send_spooled()
                except OSError as error:  # a full disk: nothing is sent until the seal is done (it numbers batches)
                    self._sealing.failed(error, dropped=0)
                    sent = self._heartbeat()
                except Exception:  # noqa: BLE001 - a dead sender stops the heartbeats, and the run is taken for lost
                    logger.exception("telemetry round failed; trying again")
                    sent = False
            if sent:
                backoff = self.flush_seconds
            else:
                backoff = min(self.max_backoff_s, backoff * 2) * random.uniform(0.8, 1.2)

    def _send_spooled(self) -> bool:
        """Send spooled batches in order (a few per request, within the size limit). False: retry later."""
        batches = self._spool.batches()[:self._window.size]
        if not batches:
            return self._heartbeat()
        texts: list[str] = []
        sent: list[SpooledBatch] = []
        size = 0
        for batch in batches:
            text = self._spool.text_to_send(batch)
            length = len(text.encode("utf-8")) + 2
            if length > REQUEST_BUDGET and not sent:
                self._split(batch)
                return True
            if size + length > REQUEST_BUDGET:
                break
            texts.append(text)
            sent.append(batch)
            size += length
        body = ('{"batches": [' + ", ".join(texts) + "]}").encode("utf-8")
        try:
            response = self._client.post(self._url, content=body, headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            logger.warning("control plane unreachable (%s); %d batches spooled", exc, len(self._spool.batches()))
            return False
        return self._take_answer(response, sent)

    def _heartbeat(self) -> bool:
        try:
            response = self._client.post(self._url, json={"batches": []})
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        try:
            self.pending_commands = TelemetryResponse.model_validate(response.json()).pending_commands
        except ValueError:  # not JSON, or not the control plane's answer (a proxy's page)
            return False
        return True

    # --- what the control plane answers ------------------------------------------------------------
    def _take_answer(self, response: httpx.Response, sent: list[SpooledBatch]) -> bool:
        """Do what the control plane's answer to `sent` says. False: send them again later."""
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        answer = answer if isinstance(answer, dict) else {}
        status, code = response.status_code, answer.get("code")
        expected = answer.get("expected_seq")
        if status == 409 and code == "sequence_gap" and isinstance(expected, int) and not isinstance(expected, bool):
            self._spool.realign(sent, expected=expected)
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
        self._applied(sent, result)
        return True

    def _applied(self, sent: list[SpooledBatch], result: TelemetryResponse) -> None:
        """Remove the batches the control plane applied; record the duplicate points it dropped."""
        self.pending_commands = result.pending_commands
        for batch in sent:
            if batch.seq <= result.applied_seq:
                self._spool.remove(batch)
                self._refusals.pop(batch.seq, None)
        self._window.applied(result.applied_seq)
        if result.duplicates_dropped_total:
            seqs = sorted({d.seq for d in result.duplicates_dropped})
            self._record_dropped(
                {"metrics": result.duplicates_dropped_total}, seq=seqs[0] if seqs else 0,
                reasons=[f"{d.key} step {d.step}: a later value in the same batch was kept"
                         for d in result.duplicates_dropped[:5]])

    def _drop_refused(self, sent: list[SpooledBatch], answer: dict) -> bool:
        """Remove the refused items from their spooled batches; the rest is sent again."""
        refused, reasons = _refused_items(answer)
        removed_any = False
        for batch in sent:
            if batch.seq not in refused:
                continue
            counts = self._spool.remove_items(batch, refused[batch.seq])
            if not any(counts.values()):
                continue
            removed_any = True
            self._record_dropped(counts, seq=batch.seq, reasons=reasons[batch.seq][:5])
        if not removed_any:  # the answer names nothing we hold: count it as a refusal of the batch
            return self._refused_whole(sent, reason="items refused that this spool does not hold")
        return True

    def _refused_whole(self, sent: list[SpooledBatch], *, reason: str) -> bool:
        """A batch refused as a whole: find which (one batch a request), retry it a few times, then quarantine it."""
        if len(sent) > 1:
            self._window.narrow(until=sent[-1].seq)
            return True
        seq = sent[0].seq
        self._refusals[seq] = self._refusals.get(seq, 0) + 1
        if self._refusals[seq] < MAX_REFUSALS:
            return False
        self._quarantine(sent[0], reason=reason)
        return True

    def _split(self, batch: SpooledBatch) -> None:
        """A batch over the request-size limit: split in two, or quarantined when it cannot be."""
        unsplittable = self._spool.split(batch)
        if unsplittable is not None:
            self._quarantine(batch, reason=unsplittable)

    def _quarantine(self, batch: SpooledBatch, *, reason: str) -> None:
        counts = self._spool.quarantine(batch)
        self._refusals.pop(batch.seq, None)
        logger.error("telemetry batch %d refused %d times (%s); moved to %s", batch.seq, MAX_REFUSALS, reason,
                     self._spool.refused_folder)
        self._record_dropped(counts if any(counts.values()) else {"batches": 1}, seq=batch.seq, reasons=[reason])

    def _record_dropped(self, counts: dict[str, int], *, seq: int, reasons: list[str]) -> None:
        """Count what the control plane will never have, and report it (an event and the telemetry/dropped metric)."""
        count = sum(counts.values())
        if count <= 0:
            return
        for section, n in counts.items():
            self.dropped_by_section[section] = self.dropped_by_section.get(section, 0) + n
        total = self._spool.count_dropped(count)
        logger.warning("telemetry dropped: %d items of batch %d (%s)", count, seq, "; ".join(reasons)[:500])
        now = time.time()  # appended to the spool directly: one it cannot take is counted, reported with the next
        self._spool.append("events", {"kind": "message", "time": now, "payload": wire_value(
            {"name": "telemetry_dropped", "seq": seq, "items": count, "total": total,
             "by_section": {k: v for k, v in counts.items() if v}, "reasons": reasons[:5]})})
        if self._spool.append("metrics", {"key": DROPPED_KEY, "step": total, "value": float(total), "time": now}):
            self._wake.set()


def _refused_items(answer: dict) -> tuple[dict[int, set[tuple[str, int]]], dict[int, list[str]]]:
    """An items_refused answer's items, (section, index) by batch seq, and why each was refused by batch seq."""
    by_seq: dict[int, set[tuple[str, int]]] = {}
    reasons: dict[int, list[str]] = {}
    for item in answer.get("refused") or []:
        try:
            seq, section, index = int(item["seq"]), str(item["section"]), int(item["index"])
        except (KeyError, TypeError, ValueError):
            continue
        by_seq.setdefault(seq, set()).add((section, index))
        reasons.setdefault(seq, []).append(f"{item.get('field', section)}: {item.get('reason', '')}"[:300])
    return by_seq, reasons
