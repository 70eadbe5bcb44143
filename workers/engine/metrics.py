"""One recording API for metrics, events and rollout samples, fanned out to sinks.

    recorder = Recorder([ConsoleSink(total_steps=100), JsonlSink("run/metrics.jsonl")])
    recorder.log("loss", 0.3, step=1)
    recorder.event("checkpoint_saved", step=10, path="...")
    recorder.rollout(step=1, prompt="1+2=", completion="3", reward=1.0)

Every record is a plain JSON-able dict with a `kind` ("metric", "event", "rollout"), a
monotonically increasing `seq` (the control-plane client uses it to send idempotently),
and a wall-clock `time`. A sink is anything with `write(record)` and `close()`.

Recording never ends the run: an OSError from a sink (a full disk, a console whose pipe closed) drops that record
for that sink alone, counted in `Recorder.dropped` by sink and logged once an outage; the sinks that write files
(`JsonlSink`, the control plane's spool) also handle it themselves, so that they resume whole once the disk takes
lines again.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

from workers.engine.line_file import LineFile, Outages

logger = logging.getLogger(__name__)
Record = dict[str, Any]
JSONL_BUFFER_CHARS = 8192  # a JSONL sink writes once it holds this much, whatever its flush_seconds


class Sink(Protocol):
    def write(self, record: Record) -> None: ...

    def close(self) -> None: ...


class Recorder:
    def __init__(self, sinks: list[Sink] | None = None, *, start_seq: int = 0):
        self.sinks: list[Sink] = list(sinks or [])
        self.seq = start_seq
        self._outages: dict[int, tuple[str, Outages]] = {}  # by id(sink): a sink that raised an OSError

    @property
    def dropped(self) -> dict[str, int]:
        """Records a sink raised an OSError on, by the sink's class name (those it dropped itself are its own)."""
        counts: dict[str, int] = {}
        for name, outages in self._outages.values():
            counts[name] = counts.get(name, 0) + outages.dropped
        return counts

    def _emit(self, record: Record) -> None:
        self.seq += 1
        record = {"seq": self.seq, "time": time.time(), **record}
        for sink in self.sinks:
            try:
                sink.write(record)
            except OSError as error:
                name = type(sink).__name__
                _, outages = self._outages.setdefault(id(sink), (name, Outages(f"the recorder's sink {name}")))
                outages.failed(error, dropped=1)
            else:
                if self._outages and id(sink) in self._outages:
                    self._outages[id(sink)][1].succeeded()

    def log(self, key: str, value: float, step: int) -> None:
        self._emit({"kind": "metric", "key": key, "value": float(value), "step": step})

    def log_many(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.log(key, value, step)

    def event(self, name: str, *, step: int | None = None, **fields: Any) -> None:
        self._emit({"kind": "event", "name": name, "step": step, **fields})

    def rollout(self, *, step: int, prompt: str, completion: str, reward: float, **fields: Any) -> None:
        self._emit({"kind": "rollout", "step": step, "prompt": prompt, "completion": completion, "reward": float(reward), **fields})

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except OSError as error:
                logger.warning("closing the recorder's sink %s failed: %s", type(sink).__name__, error)


class MemorySink:
    """Keeps every record; tests and benchmarks read them back."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def write(self, record: Record) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r["step"], r["value"]) for r in self.records if r["kind"] == "metric" and r["key"] == key]

    def events(self, name: str) -> list[Record]:
        return [r for r in self.records if r["kind"] == "event" and r["name"] == name]

    def last(self, key: str) -> float:
        values = self.series(key)
        if not values:
            raise KeyError(key)
        return values[-1][1]


class JsonlSink:
    """One JSON object per line, written at most every flush_seconds (or once JSONL_BUFFER_CHARS are held; and on
    close). Lines the disk does not take are dropped and counted (`dropped`), the file never left with part of one
    (`line_file.py`)."""

    def __init__(self, path: str | Path, *, flush_seconds: float = 1.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = LineFile(self.path, what="the metrics JSONL")
        self._file.open()
        self._held: list[str] = []
        self._held_chars = 0
        self.flush_seconds = flush_seconds
        self._last_flush = time.monotonic()

    @property
    def dropped(self) -> int:
        """Records not written, so far."""
        return self._file.dropped

    def write(self, record: Record) -> None:
        line = json.dumps(record) + "\n"
        self._held.append(line)
        self._held_chars += len(line)
        if self._held_chars >= JSONL_BUFFER_CHARS or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        if self._held:
            self._file.append("".join(self._held), lines=len(self._held))
            self._held, self._held_chars = [], 0
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._file.close()


class ConsoleSink:
    """A progress bar over training steps showing the latest headline metrics, plus events as lines."""

    HEADLINE = {
        "loss": "loss", "reward/mean": "reward", "eval/accuracy": "eval_acc", "eval/reward_mean": "eval_reward",
        "throughput/train_tokens_per_s": "train_tok/s", "time/step_s": "step_s",
    }

    def __init__(self, *, total_steps: int, stream: TextIO | None = None, desc: str = "train"):
        from tqdm import tqdm

        self.stream = stream or sys.stderr
        self.bar = tqdm(total=total_steps, desc=desc, file=self.stream, dynamic_ncols=True, leave=True)
        self.latest: dict[str, float] = {}
        self.step = 0

    def write(self, record: Record) -> None:
        if record["kind"] == "metric":
            if record["key"] in self.HEADLINE:
                self.latest[self.HEADLINE[record["key"]]] = record["value"]
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in self.latest.items()}, refresh=False)
            step = record["step"]
            if step > self.step:
                self.bar.update(step - self.step)
                self.step = step
        elif record["kind"] == "event":
            fields = {k: v for k, v in record.items() if k not in ("seq", "time", "kind", "name")}
            self.bar.write(f"[{record['name']}] {fields}", file=self.stream)

    def close(self) -> None:
        self.bar.close()
