"""The telemetry spool on its own, on a real folder (no control plane): sealing, splitting, renumbering, setting
aside, and a controller killed at any point of those losing and doubling nothing."""

from __future__ import annotations

import json
import logging
import os
from functools import partial
from pathlib import Path

import pytest

from tests.support.small_disk import small_disk
from workers.engine.telemetry_spool import FAR_AHEAD_SEQ, MAX_BATCH_BYTES, TelemetrySpool
from workers.engine.telemetry_wire import MAX_LOGS_PER_BATCH, MAX_METRICS_PER_BATCH, TelemetryRequest


class Kill(BaseException):
    """The controller dies here (a SIGKILL, an OOM kill, a power cut): nothing after this line runs."""


class SpoolChanges:
    """Counts the changes made to a spool folder (every write is a rename over the old file, so renames and removals
    are all of them) and kills the controller just before the one numbered `kill_before` (None: never)."""

    def __init__(self, folder: Path, patch: pytest.MonkeyPatch, *, kill_before: int | None = None) -> None:
        self.folder, self.kill_before, self.made = str(folder), kill_before, 0
        for name in ("replace", "rename", "unlink"):
            patch.setattr(os, name, partial(self._change, getattr(os, name)))

    def _change(self, change, path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(path).startswith(self.folder):
            if self.made == self.kill_before:
                raise Kill
            self.made += 1
        return change(path, *args, **kwargs)


def _log(spool: TelemetrySpool, lines: list[str]) -> None:
    for line in lines:
        spool.append("logs", {"line": line, "time": 1.0})


def _batches(folder: Path) -> dict[int, dict]:
    """The batches on disk, by the number in their file's name."""
    return {int(path.name[6:18]): json.loads(path.read_text()) for path in sorted(folder.glob("batch-*.json"))}


def _lines(folder: Path) -> list[str]:
    """Every log line on disk, in the order the batches are sent."""
    return [item["line"] for batch in _batches(folder).values() for item in batch["logs"]]


def _in_progress(folder: Path) -> list[str]:
    """The files of a spool change left to finish (a `.tmp` file left by a kill is not one: the next spool removes it)."""
    return sorted(path.name for pattern in ("sealing-*.jsonl", "split-*.json") for path in folder.glob(pattern))


def test_a_seal_packs_the_journal_into_numbered_batches_within_the_limits(tmp_path):
    spool = TelemetrySpool(tmp_path / "spool")
    lines = [f"{i:05d} " + "y" * 4000 for i in range(2 * MAX_LOGS_PER_BATCH + 500)]
    _log(spool, lines)
    assert spool.append("metrics", {"key": "loss", "step": 1, "value": 0.5, "time": 1.0}) is False
    spool.seal()

    batches = _batches(spool.folder)
    assert list(batches) == [batch.seq for batch in spool.batches()] == list(range(1, len(batches) + 1))
    assert len(batches) >= 3 and all(len(json.dumps(batch)) <= MAX_BATCH_BYTES + 4100 for batch in batches.values())
    assert _lines(spool.folder) == lines, "every record once, in order"
    assert sum(len(batch["metrics"]) for batch in batches.values()) == 1
    assert (spool.folder / "last_seq").read_text() == str(len(batches)) and spool.next_seq == len(batches) + 1
    assert (spool.folder / "open.jsonl").read_text() == "" and _in_progress(spool.folder) == []
    first = spool.batches()[0]
    assert spool.text_to_send(first).startswith('{"seq": 1, ')
    TelemetryRequest.model_validate({"batches": [json.loads(spool.text_to_send(first))]})
    spool.seal()
    assert len(spool.batches()) == len(batches), "an empty journal seals into nothing"

    full = [spool.append("metrics", {"key": "loss", "step": i, "value": 0.5, "time": 1.0})
            for i in range(MAX_METRICS_PER_BATCH)]
    assert full[-1] is True and not any(full[:-1]), "a batch's worth of metrics asks for a seal"
    spool.close()


@pytest.mark.parametrize(("marker", "spooled", "first"), [
    (None, [], 1), ("7", [], 8), ("7", [9], 10), ("", [], FAR_AHEAD_SEQ), ("seven", [2, 3], 4),
    ("9" * 13, [], FAR_AHEAD_SEQ),
], ids=["new", "marker", "batches-past-the-marker", "empty-marker", "garbled-beside-batches", "too-long"])
def test_a_spool_numbers_on_from_its_marker_and_its_batches(tmp_path, marker, spooled, first):
    folder = tmp_path / "spool"
    folder.mkdir()
    if marker is not None:
        (folder / "last_seq").write_text(marker)
    for seq in spooled:
        (folder / f"batch-{seq:012d}.json").write_text(json.dumps({"seq": seq, "metrics": [], "events": [],
                                                                    "logs": []}))
    spool = TelemetrySpool(folder)
    assert spool.next_seq == first
    _log(spool, ["next"])
    spool.seal()
    assert spool.batches()[-1].seq == first and (folder / "last_seq").read_text() == str(first)
    spool.close()


def test_seal_split_renumber_then_recover_a_killed_split(tmp_path, monkeypatch):
    """A spool whose marker was garbled seals its batches far ahead, splits one over the size limit, is renumbered
    from the number the control plane expects, and is killed in the middle of a second split: the next spool on the
    folder finishes that split, and every record is in exactly one batch, in order."""
    folder = tmp_path / "spool"
    folder.mkdir()
    (folder / "last_seq").write_text("garbled")
    spool = TelemetrySpool(folder)
    _log(spool, ["a0", "a1", "a2", "a3"])
    spool.seal()
    _log(spool, ["b0", "b1"])
    spool.seal()
    assert [batch.seq for batch in spool.batches()] == [FAR_AHEAD_SEQ, FAR_AHEAD_SEQ + 1]

    assert spool.split(spool.batches()[0]) is None
    assert [[item["line"] for item in batch["logs"]] for batch in _batches(folder).values()] == \
        [["a0", "a1"], ["a2", "a3"], ["b0", "b1"]]
    assert list(_batches(folder)) == [FAR_AHEAD_SEQ, FAR_AHEAD_SEQ + 1, FAR_AHEAD_SEQ + 2]

    spool.realign(spool.batches()[:2], expected=4)
    assert list(_batches(folder)) == [4, 5, 6] and _batches(folder)[4]["seq"] == FAR_AHEAD_SEQ, "a rename"
    assert [json.loads(spool.text_to_send(batch))["seq"] for batch in spool.batches()] == [4, 5, 6]
    assert (folder / "last_seq").read_text() == "6" and spool.next_seq == 7

    with monkeypatch.context() as patch:
        SpoolChanges(folder, patch, kill_before=3)  # last_seq, the split's intent, its second half: then killed
        with pytest.raises(Kill):
            spool.split(spool.batches()[2])
    assert _lines(folder) == ["a0", "a1", "a2", "a3", "b0", "b1", "b1"], "killed before the first half was written"
    assert _in_progress(folder) == ["split-000000000006.json"]

    reopened = TelemetrySpool(folder)
    reopened.seal()
    assert list(_batches(folder)) == [4, 5, 6, 7] and _in_progress(folder) == []
    assert _lines(folder) == ["a0", "a1", "a2", "a3", "b0", "b1"]
    assert (folder / "last_seq").read_text() == "7" and reopened.next_seq == 8
    reopened.close()


def _seal_split_renumber(spool: TelemetrySpool, written: list[str]) -> None:
    """Two seals far ahead (a garbled marker), a split of the first batch, the three renumbered from 1."""
    for lines in (["a0", "a1", "a2"], ["b0"]):
        _log(spool, lines)
        written.extend(lines)
        spool.seal()
    spool.split(spool.batches()[0])
    spool.realign([], expected=1)


def _delivered(spool: TelemetrySpool) -> list[str]:
    """The log lines a control plane that expects batch 1 receives from the spool: it applies the batches in order of
    their numbers (each removed once applied) and answers sequence_gap to one numbered other than it expects."""
    expected, received = 1, []
    while batches := spool.batches():
        if batches[0].seq != expected:
            spool.realign(batches[:1], expected=expected)
            continue
        received += [item["line"] for item in json.loads(spool.text_to_send(batches[0]))["logs"]]
        spool.remove(batches[0])
        expected += 1
    return received


def test_a_controller_killed_at_any_point_of_a_spool_change_loses_and_doubles_nothing(tmp_path, monkeypatch):
    """Killed before each change to the folder in turn (sealing twice, splitting, renumbering), the next spool on the
    folder leaves every record written in exactly one batch, in order, and nothing half done."""
    points = 0
    while True:
        folder = tmp_path / f"killed-before-{points}"
        folder.mkdir()
        (folder / "last_seq").write_text("garbled")
        written: list[str] = []
        with monkeypatch.context() as patch:
            changes = SpoolChanges(folder, patch, kill_before=points)
            try:
                _seal_split_renumber(TelemetrySpool(folder), written)
                finished = True
            except Kill:
                finished = False
        reopened = TelemetrySpool(folder)
        assert list(folder.glob("*.tmp")) == [], "what a kill between a write and its rename left is removed"
        reopened.seal()
        assert _lines(folder) == written and _in_progress(folder) == [], f"killed before change {points}"
        if finished:
            assert list(_batches(folder)) == [1, 2, 3], "nothing killed: split in three, renumbered from 1"
        assert _delivered(reopened) == written
        reopened.close()
        if finished:
            break
        points += 1
    assert points == changes.made == 18, "two seals (4 changes each), a split (6), a renumbering (4)"


def test_refused_items_are_removed_and_a_refused_batch_is_set_aside_keeping_its_number(tmp_path):
    spool = TelemetrySpool(tmp_path / "spool")
    spool.append("metrics", {"key": "loss", "step": 1, "value": 0.5, "time": 1.0})
    spool.append("metrics", {"key": "bad\x07key", "step": 1, "value": 0.5, "time": 1.0})
    spool.append("logs", {"line": "kept", "time": 1.0})
    spool.append("logs", {"line": "refused", "time": 1.0})
    spool.seal()
    [batch] = spool.batches()

    assert spool.remove_items(batch, {("metrics", 1), ("logs", 1)}) == {"metrics": 1, "events": 0, "logs": 1}
    assert _batches(spool.folder)[1] == {"seq": 1, "metrics": [{"key": "loss", "step": 1, "value": 0.5, "time": 1.0}],
                                         "events": [], "logs": [{"line": "kept", "time": 1.0}]}
    before = batch.path.read_bytes()
    assert spool.remove_items(batch, {("events", 0)}) == {"metrics": 0, "events": 0, "logs": 0}
    assert batch.path.read_bytes() == before, "nothing to remove: the batch is left as it is"

    assert spool.quarantine(batch) == {"metrics": 1, "events": 0, "logs": 1}
    assert (spool.refused_folder / batch.path.name).read_bytes() == before
    assert _batches(spool.folder) == {1: {"seq": 1, "metrics": [], "events": [], "logs": []}}

    garbled = spool.folder / "batch-000000000002.json"
    garbled.write_text("[not, an object")
    [_, unreadable] = spool.batches()
    assert spool.remove_items(unreadable, {("metrics", 0)}) == {}
    assert spool.split(unreadable) == "a batch over the request-size limit that is not a JSON object"
    assert spool.quarantine(unreadable) == {"metrics": 0, "events": 0, "logs": 0}
    assert (spool.refused_folder / garbled.name).read_text() == "[not, an object"
    spool.close()


def test_a_single_item_cannot_be_split_and_is_left_as_it_is(tmp_path):
    spool = TelemetrySpool(tmp_path / "spool")
    _log(spool, ["alone"])
    spool.seal()
    [batch] = spool.batches()
    before = batch.path.read_bytes()
    assert spool.split(batch) == "a single item over the request-size limit"
    assert batch.path.read_bytes() == before and spool.next_seq == 2 and _in_progress(spool.folder) == []
    spool.close()


def test_the_count_of_dropped_items_is_kept_for_the_next_controller(tmp_path):
    spool = TelemetrySpool(tmp_path / "spool")
    assert spool.dropped == 0
    assert spool.count_dropped(2) == 2 and spool.count_dropped(1) == 3
    spool.close()
    reopened = TelemetrySpool(tmp_path / "spool")
    assert reopened.dropped == 3 and (reopened.folder / "dropped").read_text() == "3"
    assert reopened.count_dropped(1) == 4
    reopened.close()


def test_a_garbled_count_of_dropped_items_is_kept_aside_and_said_not_reset_silently(tmp_path, caplog):
    folder = tmp_path / "spool"
    folder.mkdir()
    (folder / "dropped").write_text("12\x0034")
    with caplog.at_level(logging.ERROR, logger="workers.engine.telemetry_spool"):
        spool = TelemetrySpool(folder)
    [aside] = folder.glob("dropped.unreadable-*")
    assert aside.read_text() == "12\x0034"
    assert spool.dropped == 0 and str(aside) in spool.dropped_unreadable
    assert "cannot be read" in caplog.text
    assert spool.count_dropped(2) == 2 and aside.read_text() == "12\x0034", "the garbled count stays where it was kept"
    spool.close()
    reopened = TelemetrySpool(folder)
    assert reopened.dropped == 2 and reopened.dropped_unreadable is None
    reopened.close()


def test_a_stale_temporary_file_is_removed_when_a_spool_opens_its_folder(tmp_path):
    folder = tmp_path / "spool"
    (folder / "refused").mkdir(parents=True)
    for name in ("batch-000000000001.json.tmp", "last_seq.tmp", "refused/batch-000000000003.json.tmp"):
        (folder / name).write_text("x" * 1000)  # a kill between the write and the rename
    spool = TelemetrySpool(folder)
    assert sorted(p.name for p in folder.rglob("*.tmp")) == []
    _log(spool, ["next"])
    spool.seal()
    assert _lines(folder) == ["next"] and spool.batches()[0].seq == 1
    spool.close()


def test_a_full_disk_drops_and_counts_records_and_what_was_written_is_sealed_once(tmp_path, monkeypatch, caplog):
    """The journal refuses records on a full disk (one written in part is cut off); a seal that finds no space leaves
    its records to the next; once space is back every record written is in exactly one batch, in order, and the ones
    dropped are counted by section, reported once."""
    with small_disk(tmp_path / "disk", size=64 * 1024, monkeypatch=monkeypatch) as disk:
        spool = TelemetrySpool(disk.folder / "spool")
        _log(spool, ["before-0", "before-1"])
        disk.fill()
        with caplog.at_level(logging.WARNING):
            for i in range(30):  # longer than what is left of the journal's last page: written in part, refused
                assert spool.append("logs", {"line": f"lost-{i} " + "y" * 6000, "time": 1.0}) is False
            assert spool.append("metrics", {"key": "m" * 6000, "step": 1, "value": 0.5, "time": 1.0}) is False
            assert spool.take_unwritten() == {}, "reported only once the journal takes records again"
            with pytest.raises(OSError):
                spool.seal()  # the sender's thread: it logs once and tries again
            assert _lines(spool.folder) == []
        assert len([r for r in caplog.records if "cannot be written" in r.getMessage()]) == 1
        disk.free()
        _log(spool, ["after-0", "after-1"])
        assert spool.take_unwritten() == {"logs": 30, "metrics": 1} and spool.take_unwritten() == {}
        spool.seal()
        assert _lines(spool.folder) == ["before-0", "before-1", "after-0", "after-1"]
        assert _in_progress(spool.folder) == []
        spool.close()
