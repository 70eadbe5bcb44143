"""The engine's client for the control plane: telemetry out (a metrics Sink), commands in.

Records are grouped into numbered batches, written to a spool folder first, then sent in order
with retries and backoff. The control plane applies each batch exactly once, so a batch sent twice
(a lost response, a restart) is harmless, and a control plane that is down loses nothing: the
spool is replayed when it is back, or by the next controller that opens the same spool folder.
Django-free: this runs on GPU nodes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from workers.engine.metrics import Record
from workers.engine.telemetry_wire import MAX_METRICS_PER_BATCH, EventKindName, TelemetryResponse

logger = logging.getLogger(__name__)
EVENT_KINDS = set(EventKindName.__args__)
BATCH_FILE_DIGITS = 12


@dataclass(frozen=True)
class ControlPlaneTarget:
    url: str
    run_id: int
    token: str

    @classmethod
    def from_environment(cls) -> ControlPlaneTarget | None:
        """FORGEBOARD_URL, FORGEBOARD_RUN_ID and FORGEBOARD_RUN_TOKEN_FILE, as the launch backends set them."""
        url, run_id, token_file = (os.environ.get(n) for n in
                                   ("FORGEBOARD_URL", "FORGEBOARD_RUN_ID", "FORGEBOARD_RUN_TOKEN_FILE"))
        if not (url and run_id and token_file):
            return None
        return cls(url=url.rstrip("/"), run_id=int(run_id), token=Path(token_file).read_text().strip())


def record_to_wire(record: Record) -> tuple[str, dict[str, Any]]:
    """('metrics' | 'events', wire item) for one recorder record."""
    if record["kind"] == "metric":
        return "metrics", {"key": record["key"], "step": int(record["step"]), "value": float(record["value"]),
                           "time": record["time"]}
    fields = {k: v for k, v in record.items() if k not in ("seq", "time", "kind", "name")}
    if record["kind"] == "rollout":
        return "events", {"kind": "rollout", "payload": fields, "time": record["time"]}
    name = record.get("name", "message")
    kind = name if name in EVENT_KINDS else "message"
    payload = fields if kind == name else {"name": name, **fields}
    return "events", {"kind": kind, "payload": json.loads(json.dumps(payload, default=str)), "time": record["time"]}


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
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._next_seq = self._highest_spooled_seq() + 1
        self._seal_batch()  # what a previous controller recorded but did not seal
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
        self._append("logs", {"line": line[:8192], "time": time.time()})

    def _append(self, section: str, item: dict) -> None:
        with self._lock:
            self._journal.write(json.dumps([section, item]) + "\n")
            self._journal.flush()
            self._journal_metrics += section == "metrics"
            full = self._journal_metrics >= MAX_METRICS_PER_BATCH
        if full:
            self._wake.set()

    def close(self, *, timeout_s: float = 30.0) -> bool:
        """Flush and send what is left; True when nothing is left in the spool."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        self._seal_batch()
        deadline = time.monotonic() + timeout_s
        while self._spooled() and time.monotonic() < deadline:
            if not self._send_spooled():
                time.sleep(0.5)
        self._client.close()
        self._journal.close()
        return not self._spooled()

    # --- spool ---------------------------------------------------------------------------------
    def _spooled(self) -> list[Path]:
        return sorted(self.spool.glob("batch-*.json"))

    def _highest_spooled_seq(self) -> int:
        marker = self.spool / "last_seq"
        seqs = [int(p.stem.split("-")[1]) for p in self._spooled()]
        if marker.exists():
            seqs.append(int(marker.read_text().strip() or 0))
        return max(seqs, default=0)

    def _seal_batch(self) -> None:
        """Turn the open journal into the next numbered batch file (written atomically)."""
        with self._lock:
            self._journal.close()
            batch: dict = {"seq": self._next_seq, "metrics": [], "events": [], "logs": []}
            for line in self._journal_path.read_text(encoding="utf-8").splitlines():
                try:
                    section, item = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                batch[section].append(item)
            if any(batch[k] for k in ("metrics", "events", "logs")):
                path = self.spool / f"batch-{batch['seq']:0{BATCH_FILE_DIGITS}d}.json"
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(batch))
                os.replace(tmp, path)
                (self.spool / "last_seq").write_text(str(batch["seq"]))
                self._next_seq += 1
            self._journal = open(self._journal_path, "w", encoding="utf-8")
            self._journal_metrics = 0

    def _send_spooled(self) -> bool:
        """Send spooled batches in order (a few per request). False on a failure worth a retry later."""
        files = self._spooled()[:16]
        if not files:
            return self._heartbeat()
        batches = [json.loads(p.read_text()) for p in files]
        try:
            response = self._client.post(f"/api/v1/controller/runs/{self.target.run_id}/telemetry", json={"batches": batches})
        except httpx.HTTPError as exc:
            logger.warning("control plane unreachable (%s); %d batches spooled", exc, len(self._spooled()))
            return False
        if response.status_code == 409 and response.json().get("code") == "sequence_gap":
            self._realign(files, expected=int(response.json()["expected_seq"]))
            return True
        if response.status_code != 200:
            logger.error("control plane refused telemetry: %s %s", response.status_code, response.text[:500])
            return False
        result = TelemetryResponse.model_validate(response.json())
        self.pending_commands = result.pending_commands
        for path in files:
            if int(path.stem.split("-")[1]) <= result.applied_seq:
                path.unlink(missing_ok=True)
        return True

    def _realign(self, files: list[Path], *, expected: int) -> None:
        """Drop batches the control plane already has; renumber if it lacks batches we no longer hold."""
        for path in files:
            if int(path.stem.split("-")[1]) < expected:
                path.unlink(missing_ok=True)
        remaining = self._spooled()
        if remaining and int(remaining[0].stem.split("-")[1]) > expected:
            logger.error("control plane expects batch %d but the spool starts later; renumbering", expected)
            with self._lock:
                for offset, path in enumerate(remaining):
                    batch = json.loads(path.read_text())
                    batch["seq"] = expected + offset
                    path.unlink()
                    target = self.spool / f"batch-{batch['seq']:0{BATCH_FILE_DIGITS}d}.json"
                    target.write_text(json.dumps(batch))
                self._next_seq = expected + len(remaining)
                (self.spool / "last_seq").write_text(str(self._next_seq - 1))

    def _heartbeat(self) -> bool:
        try:
            response = self._client.post(f"/api/v1/controller/runs/{self.target.run_id}/telemetry", json={"batches": []})
        except httpx.HTTPError:
            return False
        if response.status_code == 200:
            self.pending_commands = TelemetryResponse.model_validate(response.json()).pending_commands
            return True
        return False

    def _loop(self) -> None:
        backoff = self.flush_seconds
        while not self._stop.is_set():
            self._wake.wait(timeout=backoff)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._seal_batch()
            if self._send_spooled():
                backoff = self.flush_seconds
            else:
                backoff = min(self.max_backoff_s, backoff * 2) * random.uniform(0.8, 1.2)


class CommandChannel:
    """Pulls operator commands, at least once, and runs each exactly once across controller restarts.

    Executed command ids are kept in a ledger file beside the spool, written before the result is
    reported, so a restarted controller that sees a command again reports its result without redoing it.
    """

    def __init__(self, target: ControlPlaneTarget, *, ledger: str | Path, transport: httpx.BaseTransport | None = None):
        self.target = target
        self.ledger = Path(ledger)
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        self._client = httpx.Client(base_url=target.url, timeout=10.0, transport=transport,
                                    headers={"Authorization": f"Bearer {target.token}"})

    def _done(self) -> dict[int, dict]:
        if not self.ledger.exists():
            return {}
        return {int(k): v for k, v in json.loads(self.ledger.read_text() or "{}").items()}

    def _remember(self, command_id: int, outcome: dict) -> None:
        done = self._done() | {command_id: outcome}
        tmp = self.ledger.with_suffix(".tmp")
        tmp.write_text(json.dumps(done))
        os.replace(tmp, self.ledger)

    def poll(self, handler) -> int:  # noqa: ANN001 - handler(kind, payload) -> dict, raises on failure
        """Run every open command through `handler`; returns how many were executed now."""
        base = f"/api/v1/controller/runs/{self.target.run_id}/commands"
        try:
            response = self._client.get(base)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("could not pull commands: %s", exc)
            return 0
        executed = 0
        for command in response.json():
            cid = command["id"]
            outcome = self._done().get(cid)
            if outcome is None:
                self._client.post(f"{base}/{cid}/ack")
                try:
                    outcome = {"ok": True, "result": handler(command["kind"], command["payload"]) or {}}
                except Exception as exc:  # noqa: BLE001 - the failure is the command's result
                    outcome = {"ok": False, "result": {"error": str(exc)}}
                self._remember(cid, outcome)
                executed += 1
            try:
                self._client.post(f"{base}/{cid}/result", json=outcome)
            except httpx.HTTPError as exc:
                logger.warning("could not report command %s: %s (will report again)", cid, exc)
        return executed

    def close(self) -> None:
        self._client.close()
