"""Operator commands between training steps: pause holds the loop, checkpoint saves, cancel stops."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from workers.engine.run_control import RunControl


class FakeChannel:
    """Hands out queued commands the way CommandChannel does: handler(kind, payload) once each."""

    def __init__(self) -> None:
        self.queue: list[tuple[str, dict]] = []
        self.outcomes: list[tuple[str, dict | str]] = []
        self.lock = threading.Lock()

    def push(self, kind: str, payload: dict | None = None) -> None:
        with self.lock:
            self.queue.append((kind, payload or {}))

    def poll(self, handler) -> int:  # noqa: ANN001
        with self.lock:
            pending, self.queue = self.queue, []
        for kind, payload in pending:
            try:
                self.outcomes.append((kind, handler(kind, payload)))
            except Exception as exc:  # noqa: BLE001 - recorded like the real channel reports it
                self.outcomes.append((kind, str(exc)))
        return len(pending)


def _control(channel: FakeChannel) -> RunControl:
    return RunControl(channel, poll_seconds=0.0, pause_poll_seconds=0.01)


def test_checkpoint_now_and_cancel():
    channel = FakeChannel()
    control = _control(channel)
    saved: list[int] = []

    def checkpoint(step: int):
        return lambda: (saved.append(step), Path(f"/ckpt/step_{step}"))[1]

    channel.push("checkpoint")
    assert control.between_steps(step=3, checkpoint=checkpoint(3)) is True
    channel.push("cancel")
    assert control.between_steps(step=4, checkpoint=checkpoint(4)) is False
    assert saved == [3, 4]
    assert channel.outcomes == [("checkpoint", {"step": 3, "path": "/ckpt/step_3"}),
                                ("cancel", {"step": 4, "path": "/ckpt/step_4"})]


def test_pause_holds_the_loop_until_resume():
    channel = FakeChannel()
    control = _control(channel)
    channel.push("pause")
    released = threading.Event()

    def step() -> None:
        control.between_steps(step=7, checkpoint=lambda: Path("/x"))
        released.set()

    worker = threading.Thread(target=step)
    worker.start()
    assert not released.wait(0.3), "a paused run must not go on"
    channel.push("resume")
    assert released.wait(5)
    worker.join()
    assert [k for k, _ in channel.outcomes] == ["pause", "resume"]


@pytest.mark.parametrize("kind", ["placement_change", "fault_drill", "load_redirect"])
def test_multi_process_commands_fail_with_a_reason_here(kind):
    channel = FakeChannel()
    channel.push(kind, {"role": "generator"})
    assert _control(channel).between_steps(step=1, checkpoint=lambda: Path("/x")) is True
    assert channel.outcomes == [(kind, f"{kind} needs the multi-process (Monarch) recipe; this run is single-process")]


def test_polling_is_rate_limited():
    channel = FakeChannel()
    control = RunControl(channel, poll_seconds=60.0)
    control.between_steps(step=1, checkpoint=lambda: Path("/x"))
    channel.push("checkpoint")
    assert control.between_steps(step=2, checkpoint=lambda: Path("/x")) is True
    assert channel.queue == [("checkpoint", {})], "not polled again within poll_seconds"


def test_operations_reach_the_recipes_operator_parsed_and_bad_ones_fail_by_field():
    from workers.engine.operations import FaultDrillRequest

    channel = FakeChannel()
    control = _control(channel)
    seen = []
    control.operator = lambda kind, op: (seen.append((kind, op)), {"ok": True})[1]
    channel.push("fault_drill", {"kind": "kill", "role": "generator", "replica": 1})
    channel.push("fault_drill", {"kind": "latency", "role": "generator"})
    channel.push("load_redirect", {"action": "drain", "host": "a", "extra": 1})
    channel.push("reboot")
    assert control.between_steps(step=2, checkpoint=lambda: Path("/x")) is True
    assert seen == [("fault_drill", FaultDrillRequest(kind="kill", role="generator", replica=1))]
    assert channel.outcomes == [("fault_drill", {"ok": True}),
                                ("fault_drill", "latency_ms: required for kind 'latency'"),
                                ("load_redirect", "extra: unknown key"),
                                ("reboot", "unknown command 'reboot'")]
