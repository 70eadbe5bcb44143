"""How a call ends and the waits on calls (actors/calls.py): the straggler deadline and wait_all."""

from __future__ import annotations

import time
from typing import Any

from workers.engine.config import FailoverConfig


def test_a_straggler_deadline_follows_the_roles_typical_request_time_within_its_bounds() -> None:
    from workers.engine.actors.calls import request_deadline

    off = FailoverConfig(call_timeout_s=30.0)
    assert request_deadline(typical_s=0.5, config=off) == 30.0, "off by default: only the call timeout"
    on = FailoverConfig(call_timeout_s=30.0, straggler_factor=8.0, straggler_min_s=2.0)
    assert request_deadline(typical_s=None, config=on) == 30.0, "nothing measured yet"
    assert request_deadline(typical_s=0.5, config=on) == 4.0
    assert request_deadline(typical_s=0.1, config=on) == 2.0, "never under straggler_min_s"
    assert request_deadline(typical_s=10.0, config=on) == 30.0, "never over the call timeout"


class Answer:
    """A future that answers after `after_s` (never when None), or fails with `error`."""

    def __init__(self, after_s: float | None, value: Any = None, error: Exception | None = None):
        self.ready_at = None if after_s is None else time.monotonic() + after_s
        self.value, self.error = value, error

    def get(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        if self.ready_at is None or time.monotonic() < self.ready_at:
            time.sleep(timeout or 0)
            raise TimeoutError
        return self.value


def test_wait_all_declares_a_straggler_hung_long_before_the_call_timeout() -> None:
    from workers.engine.actors.calls import CallFailed, wait_all

    config = FailoverConfig(call_timeout_s=60.0, straggler_factor=4.0, straggler_min_s=0.3, poll_seconds=0.05)
    ticks: list[float] = []
    started = time.monotonic()
    outcomes = wait_all([Answer(0.02, "a"), Answer(None), Answer(0.0, error=RuntimeError("actor raised"))],
                        config=config, tick=lambda: ticks.append(time.monotonic()))
    assert time.monotonic() - started < 5.0, "the stopped one was declared hung at max(0.3, 4 x 0.02) s"
    assert outcomes[0] == "a"
    assert isinstance(outcomes[1], CallFailed) and outcomes[1].hung and "no answer within 0.3 s" in str(outcomes[1])
    assert isinstance(outcomes[2], CallFailed) and not outcomes[2].hung and "actor raised" in str(outcomes[2])
    assert ticks, "failures and drills are looked at while waiting"


def test_wait_all_without_a_straggler_factor_waits_for_the_call_timeout() -> None:
    from workers.engine.actors.calls import CallFailed, wait_all

    config = FailoverConfig(call_timeout_s=0.5, poll_seconds=0.05)
    started = time.monotonic()
    outcomes = wait_all([Answer(0.01, 1), Answer(None)], config=config, tick=lambda: None)
    assert outcomes[0] == 1 and isinstance(outcomes[1], CallFailed) and outcomes[1].hung
    assert time.monotonic() - started >= 0.5
