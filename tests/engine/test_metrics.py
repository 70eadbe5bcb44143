"""The recording API and its sinks."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

from tests.support.small_disk import small_disk
from workers.engine.metrics import ConsoleSink, JsonlSink, MemorySink, Record, Recorder


class ListSink:
    """A third-party sink, as the control-plane client will be: only write() and close()."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.closed = False

    def write(self, record: Record) -> None:
        self.records.append(record)

    def close(self) -> None:
        self.closed = True


def test_records_fan_out_with_increasing_sequence(tmp_path: Path) -> None:
    memory, custom = MemorySink(), ListSink()
    jsonl_path = tmp_path / "run" / "metrics.jsonl"
    recorder = Recorder([memory, custom, JsonlSink(jsonl_path, flush_seconds=60)])
    recorder.log("loss", 1.5, step=1)
    recorder.log_many({"loss": 1.0, "lr": 0.1}, step=2)
    recorder.event("checkpoint_saved", step=2, path="/x")
    recorder.rollout(step=2, prompt="1+1=", completion="2", reward=1.0, policy_version=1)
    recorder.close()

    assert [r["seq"] for r in memory.records] == [1, 2, 3, 4, 5]
    assert memory.series("loss") == [(1, 1.5), (2, 1.0)] and memory.last("lr") == 0.1
    assert custom.records == memory.records and custom.closed
    lines = [json.loads(line) for line in jsonl_path.read_text().splitlines()]
    assert lines == memory.records  # flushed on close
    assert lines[3] == {**lines[3], "kind": "event", "name": "checkpoint_saved", "path": "/x"}
    assert lines[4]["kind"] == "rollout" and lines[4]["policy_version"] == 1


def test_recorder_can_continue_a_sequence() -> None:
    memory = MemorySink()
    Recorder([memory], start_seq=41).log("x", 1, step=0)
    assert memory.records[0]["seq"] == 42


def test_console_sink_shows_progress_and_events() -> None:
    stream = io.StringIO()
    recorder = Recorder([ConsoleSink(total_steps=4, stream=stream)])
    for step in range(1, 5):
        recorder.log("loss", 1.0 / step, step=step)
    recorder.event("resumed", step=2, path="ckpt")
    recorder.close()
    text = stream.getvalue()
    assert "4/4" in text and "loss=0.25" in text
    assert "[resumed]" in text and "ckpt" in text


def test_a_full_disk_drops_and_counts_jsonl_lines_and_the_file_reads_whole_after_it(tmp_path, monkeypatch):
    with small_disk(tmp_path / "disk", size=64 * 1024, monkeypatch=monkeypatch) as disk:
        sink = JsonlSink(disk.folder / "metrics.jsonl", flush_seconds=0)
        recorder = Recorder([sink])
        recorder.log("loss", 1.0, step=1)
        disk.fill()
        for step in range(2, 12):
            recorder.event("note", step=step, text="y" * 6000)  # no exception into the training loop
        assert sink.dropped == 10
        disk.free()
        recorder.log("loss", 0.5, step=12)
        recorder.close()
        lines = [json.loads(line) for line in (disk.folder / "metrics.jsonl").read_text().splitlines()]
    assert [(line["seq"], line.get("value")) for line in lines] == [(1, 1.0), (12, 0.5)]


class BrokenPipeSink(ListSink):
    """A console whose reader went away: every write raises."""

    def write(self, record: Record) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_sink_raising_an_os_error_drops_its_records_alone_and_is_logged_once(caplog):
    memory = MemorySink()
    recorder = Recorder([BrokenPipeSink(), memory])
    with caplog.at_level(logging.WARNING, logger="workers.engine.line_file"):
        for step in range(5):
            recorder.log("loss", 1.0, step=step)
    recorder.close()
    assert len(memory.records) == 5 and recorder.dropped == {"BrokenPipeSink": 5}
    assert len(caplog.records) == 1 and "BrokenPipeSink cannot be written" in caplog.records[0].getMessage()


class FullDiskOnCloseSink(ListSink):
    """A file sink whose last flush, on close, finds the disk full."""

    def close(self) -> None:
        raise OSError(28, "No space left on device")


def test_a_sink_whose_close_raises_an_os_error_is_logged_by_name_and_the_other_sinks_still_close(caplog):
    before, after = ListSink(), ListSink()
    recorder = Recorder([before, FullDiskOnCloseSink(), after])
    recorder.log("loss", 1.0, step=1)
    with caplog.at_level(logging.WARNING, logger="workers.engine.metrics"):
        recorder.close()  # nothing raises
    assert before.closed and after.closed
    [logged] = caplog.records
    assert "FullDiskOnCloseSink" in logged.getMessage() and "No space left on device" in logged.getMessage()
