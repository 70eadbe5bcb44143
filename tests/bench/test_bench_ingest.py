"""Benchmark: telemetry ingestion into the database, COPY path vs generic bulk insert, side by side.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/forgeboard FORGEBOARD_ENV=test \
        .venv/bin/python -m pytest tests/bench/test_bench_ingest.py -s

Prints points/s for each path and their ratio (goal on Postgres: >= 50,000 points/s).
"""

from __future__ import annotations

import time
from unittest import mock

import pytest
from django.db import connection

from forgeboard.telemetry import ingest
from forgeboard.telemetry.models import MetricPoint
from workers.engine.telemetry_wire import TelemetryBatch

KEYS = [f"metric/{i}" for i in range(20)]
STEPS_PER_BATCH = 500  # 20 keys x 500 steps = 10,000 points a batch
BATCHES = 20


def _batches(start_seq: int) -> list[TelemetryBatch]:
    out = []
    for b in range(BATCHES):
        base = b * STEPS_PER_BATCH
        metrics = [{"key": k, "step": base + s, "value": s * 0.001, "time": 1.7e9 + s}
                   for s in range(STEPS_PER_BATCH) for k in KEYS]
        out.append(TelemetryBatch.model_validate({"seq": start_seq + b, "metrics": metrics}))
    return out


def _measure(run, batches) -> float:
    started = time.perf_counter()
    for batch in batches:
        ingest.telemetry_ingest(run=run, batches=[batch])
    return time.perf_counter() - started


@pytest.mark.django_db(transaction=True)
def test_ingestion_points_per_second(running_run, team, grpo_yaml):
    from forgeboard.runs.services import run_launch

    run, _ = running_run
    total = BATCHES * STEPS_PER_BATCH * len(KEYS)
    results = {}
    if connection.vendor == "postgresql":
        results["copy"] = _measure(run, _batches(1))
        other = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
        with mock.patch.object(ingest, "_insert_points_postgres", ingest._insert_points_generic):
            results["bulk_insert"] = _measure(other, _batches(1))
    else:
        results["bulk_insert"] = _measure(run, _batches(1))
    assert MetricPoint.objects.count() == total * len(results)
    print(f"\n{connection.vendor}: {total:,} points in {BATCHES} batches of {total // BATCHES:,}")
    for name, seconds in results.items():
        print(f"  {name:12s} {total / seconds:>12,.0f} points/s  ({seconds:.2f} s)")
    if len(results) == 2:
        print(f"  copy / bulk_insert = {results['bulk_insert'] / results['copy']:.2f}x")
