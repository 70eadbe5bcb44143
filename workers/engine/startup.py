"""What a run does before its first step, as events a run page can show: its `startup_phase` events, and a resumed
run's `resumed` event (`record_resumed`).

    phases = StartupPhases(recorder)
    phases.enter("loading_model", "loading the model")
    ...
    phases.enter("ready", "ready")

Each event says the phase now starting: `phase` (one of PHASES, in that order; a recipe skips those
that do not apply), `label` (what a person reads), `elapsed_s` (seconds since the recipe started the
run), `previous_s` (seconds the previous phase took; None for the first) and `previous_parts` (part ->
seconds into the previous phase when that part was done, for the parts that ran side by side in it:
each role's procs loading their model; empty when it had none).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from workers.engine.checkpoint import OPTIMIZER_FROM_CHECKPOINT
from workers.engine.metrics import Recorder

PHASES = ("placing", "spawning_procs", "loading_model", "warming_generator", "ready")


class StartupPhases:
    def __init__(self, recorder: Recorder, *, clock: Callable[[], float] = time.perf_counter):
        self.recorder = recorder
        self.clock = clock
        self.started = clock()
        self.current: str | None = None
        self.current_since = self.started
        self.seconds: dict[str, float] = {}  # phases that ended -> how long each took
        self.parts: dict[str, float] = {}  # of the current phase: part -> seconds into it when it was done

    def enter(self, phase: str, label: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown startup phase {phase!r}; phases: {', '.join(PHASES)}")
        if self.current is not None and PHASES.index(phase) <= PHASES.index(self.current):
            raise ValueError(f"startup phase {phase!r} cannot follow {self.current!r}")
        now = self.clock()
        previous_s = None
        if self.current is not None:
            previous_s = round(now - self.current_since, 3)
            self.seconds[self.current] = previous_s
        parts, self.parts = self.parts, {}
        self.current, self.current_since = phase, now
        self.recorder.event("startup_phase", step=0, phase=phase, label=label, elapsed_s=round(now - self.started, 3),
                            previous_s=previous_s, previous_parts=parts)

    def await_parts(self, parts: Mapping[str, Callable[[float], bool]], *, poll_s: float = 0.02) -> None:
        """Wait for parts of the current phase that run side by side: `done(wait_s)` waits up to wait_s and says
        whether that part is done (and raises if it failed). Each part's time goes in the next event."""
        waiting = dict(parts)
        while waiting:
            for name, done in list(waiting.items()):
                if done(poll_s):
                    self.parts[name] = round(self.clock() - self.current_since, 3)
                    del waiting[name]

    def ready(self) -> None:
        """Setup is done: the next thing the run does is its first step (or the step-0 held-out evaluation)."""
        self.enter("ready", "ready")


def record_resumed(recorder: Recorder, *, step: int, path: str, progress: dict[str, Any], **fields: Any) -> None:
    """The `resumed` event of a run that starts from a checkpoint (`progress`: what `load_checkpoint` returned), with
    the optimizer settings it took from the checkpoint over its config's (the run page says them in words): the
    single-process recipes' after their load, a Monarch run's controller's after its ranks' (`TrainerRecovery.resume`)."""
    recorder.event("resumed", step=step, path=path, **fields,
                   optimizer_from_checkpoint=progress.get(OPTIMIZER_FROM_CHECKPOINT, []))
