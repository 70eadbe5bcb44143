"""Operator commands, as the training loop sees them: checked between steps.

The loop calls `between_steps` after each step. Pending commands are pulled through the
control plane's CommandChannel (at least once, executed once). `pause` holds the loop until a
`resume` arrives; `checkpoint` saves now; `cancel` ends the run after a final checkpoint.
Fault drills, placement changes and load redirects (`operations.py`) are parsed here and handed
to the recipe's `operator`; only the Monarch recipe sets one, so elsewhere they fail with a reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.engine.operations import OPERATIONS, Operation, parse_operation

if TYPE_CHECKING:
    from workers.engine.command_channel import CommandChannel

logger = logging.getLogger(__name__)


class StopRun(Exception):
    """Raised by a handler when the run must end (cancel)."""


class RunControl:
    def __init__(self, channel: CommandChannel, *, poll_seconds: float = 1.0, pause_poll_seconds: float = 0.5):
        self.channel = channel
        self.poll_seconds = poll_seconds
        self.pause_poll_seconds = pause_poll_seconds
        self.paused = False
        self.stop_requested = False
        self._last_poll = 0.0
        self._checkpoint: Callable[[], Path] | None = None
        self._step = 0
        # executes a parsed fault_drill / placement_change / load_redirect; returns the command's result
        self.operator: Callable[[str, Operation], dict[str, Any]] | None = None

    def between_steps(self, *, step: int, checkpoint: Callable[[], Path]) -> bool:
        """Run pending commands; False when the loop must stop (a final checkpoint has been written)."""
        now = time.monotonic()
        if now - self._last_poll < self.poll_seconds:
            return True
        self._last_poll = now
        self._checkpoint, self._step = checkpoint, step
        self.channel.poll(self._handle)
        while self.paused and not self.stop_requested:
            time.sleep(self.pause_poll_seconds)
            self.channel.poll(self._handle)
        return not self.stop_requested

    def _handle(self, kind: str, payload: dict) -> dict:
        if kind == "pause":
            self.paused = True
            return {"paused_at_step": self._step}
        if kind == "resume":
            self.paused = False
            return {"resumed_at_step": self._step}
        if kind == "checkpoint":
            return {"step": self._step, "path": str(self._checkpoint())}
        if kind == "cancel":
            self.stop_requested = True
            return {"step": self._step, "path": str(self._checkpoint())}
        if kind in OPERATIONS and self.operator is None:
            raise ValueError(f"{kind} needs the multi-process (Monarch) recipe; this run is single-process")
        if kind in OPERATIONS:
            return self.operator(kind, parse_operation(kind, payload))  # OperationError: the command fails with its fields
        raise ValueError(f"unknown command {kind!r}")
