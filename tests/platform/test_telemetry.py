"""Events get per-run sequence numbers; metric points are stored once and read by range or downsampled."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from forgeboard.errors import ValidationFailed
from forgeboard.runs.services import run_launch
from forgeboard.telemetry.models import MetricPoint, MetricSeries, RunEvent
from forgeboard.telemetry.selectors import events_after, metric_downsampled, metric_range
from forgeboard.telemetry.ingest import telemetry_ingest
from forgeboard.telemetry.services import event_append
from workers.engine.telemetry_wire import TelemetryBatch


@pytest.fixture
def run(team, grpo_yaml):
    return run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)


def test_event_sequence_numbers_are_dense_and_per_run(run, team, grpo_yaml):
    other = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    for i in range(3):
        event_append(run=run, kind="message", payload={"i": i})
    event_append(run=other, kind="message")
    assert list(RunEvent.objects.filter(run=run).values_list("seq", flat=True)) == [1, 2, 3, 4]
    assert list(RunEvent.objects.filter(run=other).values_list("seq", flat=True)) == [1, 2]
    assert [e.seq for e in events_after(run=run, after_seq=2)] == [3, 4]


def test_unknown_event_kind_is_refused(run):
    with pytest.raises(ValidationFailed, match="unknown event kind"):
        event_append(run=run, kind="explosion")
    assert RunEvent.objects.filter(run=run).count() == 1  # just the launch's state change


@pytest.mark.django_db(transaction=True)
def test_concurrent_appends_get_distinct_sequence_numbers(team, grpo_yaml):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    errors: list[BaseException] = []

    def append_many() -> None:
        try:
            for _ in range(10):
                event_append(run=run, kind="message")
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=append_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    seqs = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, 42))


def _ingest(run, seq: int, points: list[tuple[str, int, float]]) -> int:
    metrics = [{"key": k, "step": step, "value": value, "time": 1000.0 + step} for k, step, value in points]
    return telemetry_ingest(run=run, batches=[TelemetryBatch(seq=seq, metrics=metrics)]).points


def test_points_are_stored_once_and_summarised(run):
    batch = [("loss", step, 1.0 / (step + 1)) for step in range(10)]
    assert _ingest(run, 1, batch) == 10
    assert _ingest(run, 2, batch[5:] + [("loss", 10, 0.05)]) == 1
    series = MetricSeries.objects.get(run=run, key="loss")
    assert (series.point_count, series.first_step, series.last_step) == (11, 0, 10)
    assert series.last_value == 0.05 and series.max_value == 1.0 and series.min_value == 0.05
    assert MetricPoint.objects.filter(series=series).count() == 11
    assert [p[0] for p in metric_range(run=run, key="loss", start_step=3, end_step=5)] == [3, 4, 5]


def test_downsampling_keeps_the_envelope(run):
    _ingest(run, 1, [("reward", step, float(step % 10)) for step in range(1000)])
    buckets = metric_downsampled(run=run, key="reward", buckets=10)
    assert len(buckets) == 10
    assert all(b.count == 100 and b.low == 0.0 and b.high == 9.0 for b in buckets)
    assert buckets[0].mean == pytest.approx(4.5)
    assert buckets[-1].step == 999
    assert metric_downsampled(run=run, key="absent", buckets=10) == []


def test_refused_items_of_a_pending_batch_store_nothing_of_the_request(run):
    from forgeboard.telemetry.ingest import ItemsRefused
    from workers.engine.telemetry_wire import screen_request

    assert _ingest(run, 1, [("loss", 0, 1.0)]) == 1
    screened = screen_request({"batches": [
        {"seq": 2, "metrics": [{"key": "loss", "step": 1, "value": 0.5, "time": 1.0}]},
        {"seq": 3, "metrics": [{"key": "loss\x00", "step": 2, "value": 0.5, "time": 1.0},
                               {"key": "loss", "step": 3, "value": 0.5, "time": 1.0}]},
    ]})
    assert [(r.seq, r.section, r.index) for r in screened.refused] == [(3, "metrics", 0)]
    assert [len(b.metrics) for b in screened.request.batches] == [1, 1], "the good items are kept for the caller"
    with pytest.raises(ItemsRefused) as refused:
        telemetry_ingest(run=run, batches=screened.request.batches, refused=screened.refused)
    assert refused.value.status == 422 and refused.value.as_dict()["applied_seq"] == 1
    assert refused.value.as_dict()["refused"][0]["field"] == "batches.1.metrics.0.key"
    run.refresh_from_db()
    assert run.telemetry_seq == 1 and MetricPoint.objects.filter(series__run=run).count() == 1


def test_duplicate_points_in_a_batch_are_counted_and_the_last_kept(run):
    points = [("loss", 1, 1.0), ("loss", 1, 2.0), ("loss", 2, 3.0), ("loss", 1, 4.0)]
    metrics = [{"key": k, "step": step, "value": value, "time": 1000.0} for k, step, value in points]
    result = telemetry_ingest(run=run, batches=[TelemetryBatch(seq=1, metrics=metrics)])
    assert result.points == 2 and result.duplicates_dropped_total == 2
    assert [(d.seq, d.key, d.step, d.index) for d in result.duplicates_dropped] == [(1, "loss", 1, 0), (1, "loss", 1, 1)]
    series = MetricSeries.objects.get(run=run, key="loss")
    assert series.point_count == 2 and series.last_value == 3.0
    assert MetricPoint.objects.get(series=series, step=1).value == 4.0
