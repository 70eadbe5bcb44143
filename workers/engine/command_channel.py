"""The operator command channel: a run's controller pulls commands, acknowledges each and runs it at most once.

The control plane side is `forgeboard/api/controller.py` (pull, ack, result) over `forgeboard/runs/services.py`.
A pull answers a page of the open commands; the channel pages through all of them (a command whose result it gave
up reporting stays open, and a page of those must not hide a newer command), a bounded number of pages a poll.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from workers.engine.control_plane import ControlPlaneTarget, wire_text, wire_value

logger = logging.getLogger(__name__)

# What the control plane's answer to an acknowledgement means (see the ack endpoint in forgeboard/api/controller.py).
RUN, SKIP, LATER = "run", "skip", "later"
FINISHED_COMMAND_STATES = ("expired", "succeeded", "failed")
COMMANDS_PAGE_SIZE = 100  # the most open commands one pull answers (the control plane pages with `after`)
MAX_PAGES_PER_POLL = 10  # a poll that stops here goes on from there at the next one
RESULT_REFUSED_STATUSES = {400, 413, 422}  # the result itself is refused: the same report gets the same answer
MAX_COMMAND_ERROR_CHARS = 4000
KILLED_WHILE_RUNNING = ("the controller stopped while it was running this command (it may have run in part); "
                        "it is not run again")
LEDGER_LOST = ("this run's controller took this command before, and its command ledger could not be read ({why}): "
               "it may have run, so it is not run again")


@dataclass(frozen=True)
class PulledCommand:
    id: int
    kind: str
    payload: dict
    state: str


@dataclass(frozen=True)
class AckAnswer:
    """RUN: the command is this controller's to run. SKIP: never run it (`reason`: expired, finished, no such
    command). LATER: the answer says nothing of the command (`reason`: a network error, a 5xx, a 429...): do not run
    it now, acknowledge it again at the next poll."""

    verdict: str
    reason: str = ""


class CommandChannel:
    """Pulls operator commands (at least once) and runs each at most once, and only once the control plane answers
    its acknowledgement `delivered`: a command that expired meanwhile (its run ended or was lost) is never run.

    The ledger, a JSON file beside the spool (replaced atomically), holds what this run's controller did with each
    command: `{"running": true}`, written before it runs; then its outcome `{"ok", "result"}`, reported until the
    control plane takes it (a result refused as such is replaced once by why, `replaced`, then given up on,
    `unreported`); or `{"skipped": reason}` for one its acknowledgement said not to run. A controller restarted on
    the same spool reports an outcome without running the command again, and fails one it was running when it
    stopped. An unreadable ledger (cut short by a crash, garbled) is copied aside, and the commands already taken
    (delivered) are failed rather than run again.

    `poll` raises nothing that the network, the control plane's answers, the ledger or a command's result can cause:
    the training loop calls it between steps, and an exception there ends the run as failed.
    """

    def __init__(self, target: ControlPlaneTarget, *, ledger: str | Path, transport: httpx.BaseTransport | None = None):
        self.target = target
        self.ledger = Path(ledger)
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        self._base = f"/api/v1/controller/runs/{target.run_id}/commands"
        self._client = httpx.Client(base_url=target.url, timeout=10.0, transport=transport,
                                    headers={"Authorization": f"Bearer {target.token}"})
        self._entries, self._unreadable = self._load()
        self._after = 0  # the next pull starts after this command id: where a poll that stopped at its bound stopped

    def poll(self, handler) -> int:  # noqa: ANN001 - handler(kind, payload) -> dict, raises on failure
        """Run every open command through `handler`; returns how many were executed now."""
        pulled = self._pull()
        if pulled is None:
            return 0
        commands, to_the_end = pulled
        if self._unreadable is not None:
            self._recover(commands, to_the_end=to_the_end)
        executed = 0
        for command in commands:
            entry = self._entries.get(command.id)
            if entry is None:
                entry = self._take(command, handler)
                if entry is None:
                    continue
                executed += 1
            elif entry.get("running"):
                entry = {"ok": False, "result": {"error": KILLED_WHILE_RUNNING}}
                self._record(command.id, entry)
            if "ok" in entry and "unreported" not in entry:
                self._report(command.id, entry)
        return executed

    def close(self) -> None:
        self._client.close()

    # --- the control plane -----------------------------------------------------------------------------------------
    def _pull(self) -> tuple[list[PulledCommand], bool] | None:
        """The open commands after `_after`, page by page, at most MAX_PAGES_PER_POLL pages, and whether they reach
        the last one (the next pull starts from the first again); None when nothing could be pulled."""
        commands: list[PulledCommand] = []
        for _ in range(MAX_PAGES_PER_POLL):
            page = self._pull_page()
            if page is None:
                return (commands, False) if commands else None
            answered, pulled = page
            commands += pulled
            last = max((command.id for command in pulled), default=self._after)
            if answered < COMMANDS_PAGE_SIZE or last <= self._after:
                self._after = 0
                return commands, True
            self._after = last
        return commands, False

    def _pull_page(self) -> tuple[int, list[PulledCommand]] | None:
        """How many items the control plane answered after `_after`, and those in the API's shape."""
        try:
            response = self._client.get(self._base, params={"after": self._after})
            response.raise_for_status()
            items = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("could not pull commands: %s", str(exc)[:300])
            return None
        if not isinstance(items, list):
            logger.warning("could not pull commands: the answer is not a list of commands")
            return None
        commands = [command for command in map(_pulled, items) if command is not None]
        if len(commands) < len(items):
            logger.warning("%d pulled commands not in the API's shape were left alone", len(items) - len(commands))
        return len(items), commands

    def _take(self, command: PulledCommand, handler) -> dict | None:  # noqa: ANN001
        """Acknowledge the command and run it when the answer says so: its outcome, or None when it did not run."""
        answer = self._acknowledge(command.id)
        if answer.verdict == LATER:
            logger.warning("command %s not run now (%s): acknowledged again at the next poll", command.id,
                           answer.reason)
            return None
        if answer.verdict == SKIP:
            logger.warning("command %s (%s) not run: %s", command.id, command.kind, answer.reason)
            self._record(command.id, {"skipped": answer.reason})
            return None
        if not self._record(command.id, {"running": True}):
            del self._entries[command.id]  # unwritten, it could not stop a second run after a restart
            logger.error("command %s not run now: its ledger could not be written", command.id)
            return None
        outcome = _run(handler, command)
        self._record(command.id, outcome)
        return outcome

    def _acknowledge(self, command_id: int) -> AckAnswer:
        try:
            response = self._client.post(f"{self._base}/{command_id}/ack")
        except httpx.HTTPError as exc:
            return AckAnswer(LATER, f"control plane unreachable: {str(exc)[:300]}")
        answer = _json_object(response)
        if response.status_code == 200 and answer.get("id") == command_id:
            state = answer.get("state")
            if state == "delivered":
                return AckAnswer(RUN)
            if state in FINISHED_COMMAND_STATES:
                return AckAnswer(SKIP, f"{state}: {str(answer.get('reason') or 'the control plane said so')[:1000]}")
        if response.status_code == 404 and _names_field(answer, "command_id"):
            return AckAnswer(SKIP, f"no such command: {str(answer.get('message', ''))[:1000]}")
        return AckAnswer(LATER, f"HTTP {response.status_code}: {response.text[:300]}")

    def _report(self, command_id: int, entry: dict) -> None:
        """Send the outcome; a result the control plane refuses as such is replaced once by why, then given up on."""
        for _ in range(2):
            try:
                response = self._client.post(f"{self._base}/{command_id}/result", json=_result_body(entry))
            except httpx.HTTPError as exc:
                logger.warning("could not report command %s: %s (reported again at the next poll)", command_id, exc)
                return
            if response.status_code == 200:
                return
            answer = _json_object(response)
            why = f"HTTP {response.status_code}: {str(answer.get('message') or response.text)[:1000]}"
            gone = response.status_code == 404 and _names_field(answer, "command_id")
            if not gone and response.status_code not in RESULT_REFUSED_STATUSES:
                logger.warning("could not report command %s: %s (reported again at the next poll)", command_id, why)
                return
            if gone or entry.get("replaced"):
                logger.error("command %s's result is not reported: %s", command_id, why)
                self._record(command_id, entry | {"unreported": why})
                return
            logger.error("the control plane refused command %s's result (%s): reporting why instead", command_id, why)
            entry = {"ok": entry.get("ok") is True, "result": {"result_refused": why}, "replaced": True}
            self._record(command_id, entry)

    # --- the ledger ---------------------------------------------------------------------------------------------------
    def _load(self) -> tuple[dict[int, dict], str | None]:
        """The ledger's entries, and why it could not be read (None when it could, or when there is none yet)."""
        try:
            text = self.ledger.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}, None
        except (OSError, UnicodeDecodeError) as exc:
            return self._unreadable_ledger(f"{type(exc).__name__}: {exc}")
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"a JSON {type(data).__name__}, not an object")
            entries = {int(key): value for key, value in data.items()}
            if not all(isinstance(value, dict) for value in entries.values()):
                raise ValueError("an entry that is not an object")
        except (ValueError, RecursionError) as exc:
            return self._unreadable_ledger("it is empty" if not text else str(exc)[:200] or type(exc).__name__)
        return entries, None

    def _unreadable_ledger(self, why: str) -> tuple[dict[int, dict], str]:
        aside = self.ledger.with_name(f"{self.ledger.name}.unreadable-{time.time_ns()}")
        try:
            shutil.copyfile(self.ledger, aside)
        except OSError as exc:
            aside = f"not kept: {exc}"
        logger.error("the command ledger %s could not be read (%s; kept at %s): commands this controller took "
                     "before are failed, not run again", self.ledger, why, aside)
        return {}, why

    def _recover(self, commands: list[PulledCommand], *, to_the_end: bool) -> None:
        """After an unreadable ledger: each command taken before (delivered) may have run; fail it, do not run it.
        Done once the pulls, from the first open command on (`_after` starts at 0), have reached the last one."""
        for command in commands:
            if command.state == "delivered" and command.id not in self._entries:
                self._entries[command.id] = {"ok": False, "result": {"error": LEDGER_LOST.format(why=self._unreadable)}}
        if self._save() and to_the_end:
            self._unreadable = None

    def _record(self, command_id: int, entry: dict) -> bool:
        """Keep the entry (in memory whatever happens); whether the ledger file has it."""
        self._entries[command_id] = entry
        return self._save()

    def _save(self) -> bool:
        tmp = self.ledger.with_name(f"{self.ledger.name}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as file:
                json.dump({str(k): v for k, v in self._entries.items()}, file)
                file.flush()
                os.fsync(file.fileno())  # a crash after the rename must not leave an empty ledger
            os.replace(tmp, self.ledger)
        except OSError as exc:
            logger.error("could not write the command ledger %s: %s", self.ledger, exc)
            return False
        return True


def _pulled(item: Any) -> PulledCommand | None:
    """A pulled command in the API's shape, else None."""
    if not isinstance(item, dict):
        return None
    command_id, kind, payload, state = (item.get(k) for k in ("id", "kind", "payload", "state"))
    if type(command_id) is not int or not isinstance(kind, str) or not isinstance(payload, dict):
        return None
    return PulledCommand(id=command_id, kind=kind, payload=payload, state=state if isinstance(state, str) else "")


def _run(handler, command: PulledCommand) -> dict:  # noqa: ANN001
    """The command's outcome as the control plane stores it, `{"ok", "result"}`; a failure's result is its error."""
    try:
        result = handler(command.kind, command.payload)
    except Exception as exc:  # noqa: BLE001 - the failure is the command's result
        return {"ok": False, "result": {"error": _error_text(exc)}}
    result = {} if result is None else result
    return {"ok": True, "result": wire_value(result if isinstance(result, dict) else {"value": result})}


def _error_text(exc: Exception) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a message that cannot be read is not the command's failure
        return f"{type(exc).__name__} (its message could not be read)"
    return wire_text((text or type(exc).__name__)[:MAX_COMMAND_ERROR_CHARS])


def _result_body(entry: dict) -> dict:
    """The result report for a ledger entry, JSON the control plane reads (a ledger of an older engine included)."""
    result = entry.get("result")
    return {"ok": entry.get("ok") is True, "result": wire_value(result if isinstance(result, dict) else {})}


def _json_object(response: httpx.Response) -> dict:
    try:
        answer = response.json()
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _names_field(answer: dict, field: str) -> bool:
    """Whether an error answer in the API's shape names `field` among its errors."""
    errors = answer.get("errors")
    return isinstance(errors, list) and any(isinstance(e, dict) and e.get("field") == field for e in errors)
