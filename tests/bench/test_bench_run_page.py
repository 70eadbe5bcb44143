"""Benchmark: time to render a run page whose series hold 100,000 points each, beside one with 1,000.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/forgeboard_bench REDIS_URL=redis://127.0.0.1:6379/14 \
    FORGEBOARD_ENV=test DJANGO_ALLOW_ASYNC_UNSAFE=true \
        .venv/bin/python -m pytest tests/bench/test_bench_run_page.py -s -p no:cacheprovider

Measures, in real Chromium against the web server, from navigation start until every chart has drawn its
points (the websocket backlog is downsampled to at most 500 points per series by the server), and
the time to load a zoomed range at full resolution. Prints medians of 3 loads and the ratio.
"""

from __future__ import annotations

import statistics

import pytest
from django.conf import settings

from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.ingest import telemetry_ingest
from tests.e2e.conftest import login
from workers.engine.telemetry_wire import TelemetryBatch

pytestmark = [pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))]
KEYS = ["loss", "reward/mean", "reward/std", "kl", "entropy", "grad_norm", "lr", "time/step_s"]
STEPS_PER_BATCH = 2_000
LOADS = 3


def _run_with_points(team, grpo_yaml, points_per_series: int) -> Run:
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(state=RunState.SUCCEEDED)
    for seq, start in enumerate(range(0, points_per_series, STEPS_PER_BATCH), start=1):
        steps = range(start, min(start + STEPS_PER_BATCH, points_per_series))
        metrics = [{"key": k, "step": s, "value": 1.0 / (1 + s) + i, "time": 1.7e9 + s}
                   for s in steps for i, k in enumerate(KEYS)]
        telemetry_ingest(run=run, batches=[TelemetryBatch.model_validate({"seq": seq, "metrics": metrics})])
    return run


def _render_ms(page, server, run: Run) -> float:
    page.goto(f"{server['url']}/runs/{run.pk}/")
    page.wait_for_function(f"document.querySelectorAll('figure.chart[data-points]').length === {len(KEYS)}",
                           timeout=120_000)
    return page.evaluate("performance.now()")


def _zoom_ms(page, run: Run, start: int, end: int) -> float:
    return page.evaluate(f"""async () => {{
        const t = performance.now();
        const r = await fetch('/api/v1/runs/{run.pk}/metrics/loss?start_step={start}&end_step={end}&buckets=600');
        await r.json();
        return performance.now() - t;
    }}""")


def test_run_page_render_time(page, server, team, grpo_yaml):
    sizes = {"1k": 1_000, "100k": 100_000}
    runs = {name: _run_with_points(team, grpo_yaml, n) for name, n in sizes.items()}
    login(page, server, "mateo")
    render = {name: statistics.median(_render_ms(page, server, run) for _ in range(LOADS)) for name, run in runs.items()}
    zoom = {name: statistics.median(_zoom_ms(page, run, n // 4, n // 2) for _ in range(LOADS))
            for (name, run), n in zip(runs.items(), sizes.values())}
    drawn = page.evaluate("Number(document.querySelector('figure.chart[data-key=\"loss\"]').dataset.points)")
    assert drawn <= 600, "the backlog is downsampled"
    print(f"\nrun page, {len(KEYS)} series, navigation start -> all charts drawn (median of {LOADS}):")
    for name in sizes:
        print(f"  {name:>5} points/series  render {render[name]:7.0f} ms   zoomed range at full resolution {zoom[name]:6.0f} ms")
    print(f"  ratio 100k / 1k render: {render['100k'] / render['1k']:.2f}x  ({drawn} points drawn per series)")
