"""The worker's console leaves out Celery's INFO lines for beat's own housekeeping tasks, and only those."""

from __future__ import annotations

import logging

import pytest
from celery.app import trace

from workers.celery import QuietRoutineTasks

ROUTINE = {"runs.schedule", "runs.reconcile"}


def _record(logger: str, level: int, msg: str, args: object) -> logging.LogRecord:
    return logging.getLogger(logger).makeRecord(logger, level, __file__, 1, msg, (args,) if isinstance(args, dict) else args, None)


def _line(logger: str, msg: str, name: str, level: int = logging.INFO) -> logging.LogRecord:
    if logger == "celery.beat":
        return _record(logger, level, msg, ("schedule-runs", name))
    return _record(logger, level, msg, {"id": "1", "name": name, "args": "()", "kwargs": "{}", "eta": None,
                                        "runtime": 0.01, "return_value": "[]", "exc": "boom", "description": "x"})


LINES = [("celery.beat", "Scheduler: Sending due task %s (%s)"), ("celery.worker.strategy", trace.LOG_RECEIVED),
         ("celery.app.trace", trace.LOG_SUCCESS)]


@pytest.fixture
def root_at_info():
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    yield
    root.setLevel(level)


@pytest.mark.parametrize(("logger", "msg"), LINES)
def test_a_routine_tasks_lines_are_left_out_and_another_tasks_kept(root_at_info, logger, msg):
    quiet = QuietRoutineTasks(ROUTINE)
    assert not quiet.filter(_line(logger, msg, "runs.schedule"))
    assert quiet.filter(_line(logger, msg, "runs.launch"))


def test_a_routine_tasks_failure_stays(root_at_info):
    failure = _line("celery.app.trace", trace.LOG_FAILURE, "runs.schedule", level=logging.ERROR)
    assert QuietRoutineTasks(ROUTINE).filter(failure)


def test_debug_shows_every_line():
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.DEBUG)
    try:
        assert all(QuietRoutineTasks(ROUTINE).filter(_line(logger, msg, "runs.schedule")) for logger, msg in LINES)
    finally:
        root.setLevel(level)


def test_a_line_of_another_shape_is_kept(root_at_info):
    odd = _record("celery.app.trace", logging.INFO, trace.LOG_SUCCESS, ("not", "a", "dict"))
    assert QuietRoutineTasks(ROUTINE).filter(odd)
