"""How a call to an actor ends, and how the controller waits for one call or for several together.

A call failed (`CallFailed`) when Monarch's supervision says its proc died, or when no answer came within
`failover.call_timeout_s` (hung; with `failover.straggler_factor`, far later than the role's typical answer:
`request_deadline`). A call that ended on a file a field named that the actor refused (`CallFailed.refused`: a model
folder changed since the start, a checkpoint) ends the run with that field's error (`refusal_ends_run`): every other
proc would read it too. `ProcFailure` ends the run when a failure is past what failover may do
(`failover.max_replacements`, `failover.max_retries`) or has nothing to fall back on (a replica that did not start at
the run's start).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from monarch.actor import ActorError

from workers.engine.config import FailoverConfig
from workers.engine.fields import ConfigError
from workers.engine.metrics import Recorder


class ProcFailure(RuntimeError):
    """The run cannot go on: the reason says which role failed and which limit was reached."""


class CallFailed(Exception):
    def __init__(self, message: str, *, hung: bool, raised: BaseException | None = None):
        super().__init__(message)
        self.hung = hung
        self.raised = raised  # what the call ended with: for an actor's exception, the one its endpoint raised

    @property
    def reason(self) -> str:
        """One line for an event: what failed, and the error it ended with."""
        lines = [line.strip() for line in str(self).splitlines() if line.strip()]
        text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
        return text[:300]

    @property
    def refused(self) -> ConfigError | None:
        """The field's error when the call ended on a file a field named that the actor refused (a model folder, a
        checkpoint): the run ends with it, as a single-process run does; a new proc would read the same file."""
        return self.raised if isinstance(self.raised, ConfigError) else None


def call_failed(error: Exception) -> CallFailed:
    """A call that ended with an error (a supervision error, an actor's exception)."""
    return CallFailed(f"{type(error).__name__}: {str(error)[:20_000]}", hung=False,
                      raised=error.exception if isinstance(error, ActorError) else error)


def refusal_ends_run(refused: ConfigError, *, recorder: Recorder, step: int, what: str) -> ConfigError:
    """A file a field named that a new proc refused (the model folder, a checkpoint: `CallFailed.refused`) ends the run
    with that field's error, as a single-process run does; no other proc is tried, it would read the same file. Said on
    the run page as "`what`: the error; not recovered: the run ends" (`what`: which proc did not do what), since mid-run
    the failure it was to recover from is told there. The error, for the caller to raise."""
    recorder.event("message", step=step, text=f"{what}: {refused}; not recovered: the run ends")
    return refused


def not_started(error: Exception) -> CallFailed:
    """A new replica whose actor failed as it spawned or as its model loaded (a supervision error, an actor's)."""
    failed = call_failed(error)
    return CallFailed(f"did not start: {failed}", hung=False, raised=failed.raised)


def wait_for(future: Any, *, timeout_s: float, poll_s: float, tick: Callable[[], None],
             gone: Callable[[], str | None] = lambda: None) -> Any:
    """A future's result, polling every poll_s (running `tick`); CallFailed when it fails or hangs.

    `gone`: the reason the callee is known dead (say its host was lost: Monarch then never fails
    the call), or None; the wait stops with that reason.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return future.get(timeout=max(0.01, min(poll_s, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise CallFailed(f"no answer within {timeout_s:g} s", hung=True) from None
            tick()
            reason = gone()
            if reason is not None:
                raise CallFailed(reason, hung=False) from None
        except Exception as error:  # noqa: BLE001 - a supervision error, an actor error: the call failed
            raise call_failed(error) from None


def answered(future: Any, wait_s: float) -> bool:
    """Whether `future` has its answer after waiting up to `wait_s` (it raises what the call raised)."""
    try:
        future.get(timeout=wait_s)
    except TimeoutError:
        return False
    return True


def request_deadline(*, typical_s: float | None, config: FailoverConfig) -> float:
    """Seconds a replica may take to answer one request before it counts as hung.

    `failover.call_timeout_s`, or with `failover.straggler_factor` that many times the role's
    typical seconds per request (never under `straggler_min_s`): a stopped replica is then
    noticed in a few seconds instead of at the call timeout.
    """
    if not config.straggler_factor or typical_s is None:
        return config.call_timeout_s
    return min(config.call_timeout_s, max(config.straggler_min_s, config.straggler_factor * typical_s))


def wait_all(futures: list[Any], *, config: FailoverConfig, tick: Callable[[], None],
             gone: list[Callable[[], str | None]] | None = None) -> list[Any]:
    """Each future's result, or the CallFailed it ended with, awaited together.

    With `failover.straggler_factor`, one that answers far later than the others (factor x the
    median time of those that answered) counts as hung; else each has `call_timeout_s`. `gone[i]`:
    the reason future i's callee is known dead (as in `wait_for`), or None.
    """
    started = last_tick = time.monotonic()
    results: dict[int, Any] = {}
    took: list[float] = []
    while len(results) < len(futures):
        for i, future in enumerate(futures):
            if i in results:
                continue
            try:
                results[i] = future.get(timeout=0.005)
                took.append(time.monotonic() - started)
            except TimeoutError:
                pass
            except Exception as error:  # noqa: BLE001 - a supervision error, an actor error: the call failed
                results[i] = call_failed(error)
        deadline = request_deadline(typical_s=sorted(took)[len(took) // 2] if took else None, config=config)
        now = time.monotonic()
        if now - started >= deadline:
            for i in range(len(futures)):
                results.setdefault(i, CallFailed(f"no answer within {deadline:g} s", hung=True))
        elif now - last_tick >= config.poll_seconds:
            tick()
            last_tick = now
            for i, reason in enumerate(g() for g in gone or []):
                if reason is not None:
                    results.setdefault(i, CallFailed(reason, hung=False))
    return [results[i] for i in range(len(futures))]


def exited(pid: int) -> bool:
    """A local process that is gone, or killed and not yet reaped (a zombie).

    Monarch's supervision can take ~10 s to report a dead proc, and a call sent to it meanwhile
    just waits; on this machine /proc says so at once. Elsewhere (no /proc) this says nothing.
    """
    if not Path("/proc/self/stat").exists():
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")
