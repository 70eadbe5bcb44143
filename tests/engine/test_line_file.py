"""An append-only file of lines on a disk that fills up and frees: never raising, never left with part of a line."""

from __future__ import annotations

import logging
import os

from tests.support.small_disk import small_disk
from workers.engine.line_file import LineFile, Outages


def test_a_full_disk_drops_whole_lines_logs_once_and_the_file_resumes_whole(tmp_path, monkeypatch, caplog):
    with small_disk(tmp_path / "disk", size=64 * 1024, monkeypatch=monkeypatch) as disk:
        lines = LineFile(disk.folder / "lines.txt", what="the test's lines")
        assert lines.append("before\n") is True
        disk.fill()
        with caplog.at_level(logging.WARNING, logger="workers.engine.line_file"):
            # longer than what is left of the file's last page: written in part, then refused
            refused = [lines.append("lost " + "y" * 6000 + "\n") for _ in range(50)]
            assert lines.append("one\n" + "two " + "y" * 6000 + "\n", lines=2) is False
            assert not any(refused) and lines.dropped == 52 and lines.outages.going_on
            assert (disk.folder / "lines.txt").read_text() == "before\n", "the part written of a line is cut off"
            disk.free()
            assert lines.append("after\n") is True
        lines.close()
        assert (disk.folder / "lines.txt").read_text() == "before\nafter\n"
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2, warnings
    assert "cannot be written (OSError: [Errno 28]" in warnings[0] and "the run goes on" in warnings[0]
    assert "written again" in warnings[1] and "52 dropped meanwhile, 52 in all" in warnings[1]


def test_a_file_ending_in_part_of_a_line_gets_a_newline_before_the_next(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("whole\ncut sh")  # a power cut in the middle of a line
    lines = LineFile(path, what="the test's lines")
    assert lines.append("next\n") is True and lines.append("and on\n") is True
    lines.close()
    assert path.read_text().splitlines() == ["whole", "cut sh", "next", "and on"]


def test_outages_that_come_and_go_are_logged_at_the_first_second_fourth_and_eighth_only(caplog):
    outages = Outages("a flapping disk")
    with caplog.at_level(logging.WARNING, logger="workers.engine.line_file"):
        for _ in range(10):
            for _ in range(3):
                outages.failed(OSError(28, "No space left on device"), dropped=1)
            outages.succeeded()
    starts = [record.getMessage() for record in caplog.records if "cannot be written" in record.getMessage()]
    assert len(starts) == 4 and "outage 8; the next logged is outage 16" in starts[-1]
    assert outages.count == 10 and outages.dropped == 30 and not outages.going_on


def test_a_close_that_reports_a_failed_write_back_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    lines = LineFile(tmp_path / "lines.jsonl", what="the test file")
    assert lines.append("{}\n")
    close = os.close

    def write_back_failed(fd: int) -> None:
        close(fd)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "close", write_back_failed)
    with caplog.at_level(logging.WARNING):
        lines.close()
    monkeypatch.undo()
    assert "closing it failed ([Errno 5] Input/output error): its last lines may be lost" in caplog.text
    lines.close()  # closed already: nothing to do
    assert (tmp_path / "lines.jsonl").read_text() == "{}\n"
