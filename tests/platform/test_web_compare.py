"""The compare page: which selections it refuses and why, the config diff, the chart data and the summary."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from forgeboard.accounts.services import membership_set, project_create
from forgeboard.accounts.models import Role
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Run
from forgeboard.runs.selectors import config_diff, config_flatten
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.ingest import telemetry_ingest
from forgeboard.telemetry.selectors import metric_downsampled
from workers.engine.telemetry_wire import TelemetryBatch

START = 1_700_000_000.0


def _ingest(run: Run, metrics: dict[str, list[float]], *, start: float = START, seconds_per_step: float = 2.0) -> None:
    points = [{"key": key, "step": step, "value": value, "time": start + seconds_per_step * step}
              for key, values in metrics.items() for step, value in enumerate(values)]
    telemetry_ingest(run=run, batches=[TelemetryBatch(seq=run.telemetry_seq + 1, metrics=points)])
    run.refresh_from_db()


@pytest.fixture
def pair(team, grpo_yaml):
    """Two runs of alpha/math: different learning rate and steps, with loss and reward/mean reported."""
    a = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    b = run_launch(actor=team.owner, experiment=team.experiment, config_yaml=grpo_yaml,
                   overrides=["trainer.optimizer.lr=0.001", "trainer.steps=8"])
    started = timezone.now() - timedelta(minutes=5)
    Run.objects.filter(pk=a.pk).update(state=RunState.SUCCEEDED, started_at=started,
                                       finished_at=started + timedelta(seconds=125))
    Run.objects.filter(pk=b.pk).update(state=RunState.RUNNING, started_at=started)
    _ingest(a, {"loss": [1.0, 0.5, 0.25], "reward/mean": [0.0, 0.5, 0.75]})
    _ingest(b, {"loss": [2.0, 1.0, 0.5, 0.125], "kl": [0.1, 0.2]}, start=START + 100)
    a.refresh_from_db()
    b.refresh_from_db()
    return a, b


def _compare(client, query: str, slug: str = "alpha"):
    return client.get(f"/p/{slug}/compare/?{query}")


# --- which runs may be compared ---------------------------------------------------------------------------------

def test_needs_login(client, pair):
    a, b = pair
    response = _compare(client, f"runs={a.pk},{b.pk}")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.parametrize("query_of, status, reason", [
    (lambda a, b: "", 400, "choose at least 2 runs to compare, got 0"),
    (lambda a, b: f"runs={a}", 400, "choose at least 2 runs to compare, got 1"),
    (lambda a, b: f"runs={a},{a}", 400, "choose at least 2 runs to compare, got 1"),
    (lambda a, b: f"runs={a}&runs=abc", 400, "&#x27;abc&#x27; is not a run id"),
    (lambda a, b: f"runs={a},-3", 400, "&#x27;-3&#x27; is not a run id"),
    (lambda a, b: f"runs={a},0", 400, "&#x27;0&#x27; is not a run id"),
    (lambda a, b: f"runs={a},99999999999999999999999", 400, "is not a run id"),
    (lambda a, b: f"runs={a},{b + 1000}", 404, "in project &#x27;alpha&#x27;"),
])
def test_bad_selections_get_an_error_page_with_the_reason(client, team, pair, query_of, status, reason):
    a, b = pair
    client.force_login(team.viewer)
    response = _compare(client, query_of(a.pk, b.pk))
    assert response.status_code == status
    assert reason in response.content.decode()
    if status == 404:
        assert f"no run {b.pk + 1000} in project" in response.content.decode()
    assert "Traceback" not in response.content.decode()


def test_more_than_ten_runs_are_refused(client, team, grpo_yaml, pair):
    runs = [run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml) for _ in range(9)]
    ids = [r.pk for r in (*pair, *runs)]
    client.force_login(team.member)
    response = _compare(client, "runs=" + ",".join(map(str, ids)))
    assert response.status_code == 400 and "compare at most 10 runs at once" in response.content.decode()
    assert _compare(client, "runs=" + ",".join(map(str, ids[:10]))).status_code == 200


def test_another_projects_run_is_refused_by_name_to_its_members_and_unknown_to_others(client, team, pair, grpo_yaml):
    beta = project_create(actor=team.owner, slug="beta", name="Beta")
    foreign = run_launch(actor=team.owner, experiment=experiment_create(actor=team.owner, project=beta, name="x",
                                                                        recipe="grpo"), config_yaml=grpo_yaml)
    a, _ = pair
    client.force_login(team.owner)  # owner of both projects: may learn where the run belongs
    response = _compare(client, f"runs={a.pk},{foreign.pk}")
    assert response.status_code == 400
    assert "belongs to project &#x27;beta&#x27;, not &#x27;alpha&#x27;" in response.content.decode()
    client.force_login(team.viewer)  # not in beta: the run might as well not exist
    response = _compare(client, f"runs={a.pk},{foreign.pk}")
    assert response.status_code == 404 and f"no run {foreign.pk} in project" in response.content.decode()
    assert "beta" not in response.content.decode()


@pytest.mark.parametrize("slug", ["alpha", "no-such-project"])
def test_outsiders_get_not_found(client, team, pair, slug):
    a, b = pair
    client.force_login(team.outsider)
    assert _compare(client, f"runs={a.pk},{b.pk}", slug=slug).status_code == 404


def test_both_url_forms_select_the_same_runs_in_order(client, team, pair):
    a, b = pair
    client.force_login(team.viewer)
    repeated = _compare(client, f"runs={b.pk}&runs={a.pk}")
    comma = _compare(client, f"runs={b.pk},{a.pk},{b.pk}")
    assert repeated.status_code == comma.status_code == 200
    for response in (repeated, comma):
        assert [r["id"] for r in response.context["chart_data"]["runs"]] == [b.pk, a.pk]


# --- the config diff --------------------------------------------------------------------------------------------

def test_flatten_uses_dotted_keys_and_keeps_empty_values():
    flat = config_flatten(config={"a": {"b": 1, "c": {"d": "x"}}, "e": [], "f": {}, "g": ["p", {"q": None}]})
    assert flat == {"a.b": 1, "a.c.d": "x", "e": [], "f": {}, "g[0]": "p", "g[1].q": None}


def test_diff_marks_differing_and_missing_keys(pair):
    a, b = pair
    ordered = config_diff(runs=[a, b])
    assert [row.key for row in ordered] == sorted(row.key for row in ordered)  # same order on every database
    rows = {row.key: row for row in ordered}
    assert rows["trainer.optimizer.lr"].values == ["0.0001", "0.001"] and rows["trainer.optimizer.lr"].differs
    assert rows["trainer.steps"].values == ["5", "8"] and rows["trainer.steps"].differs
    assert rows["model.family"].values == ["qwen3", "qwen3"] and not rows["model.family"].differs
    assert rows["reward.functions[0]"].values == ["exact_math", "exact_math"]
    a.config.parsed["only_in_a"] = True  # in memory only: a key one run lacks differs and shows as missing
    missing = {row.key: row for row in config_diff(runs=[a, b])}["only_in_a"]
    assert missing.values == ["true", None] and missing.differs


def test_only_differences_hides_the_same_rows_without_javascript(client, team, pair):
    a, b = pair
    client.force_login(team.viewer)
    everything = _compare(client, f"runs={a.pk},{b.pk}").content.decode()
    only = _compare(client, f"runs={a.pk},{b.pk}&only=diff").content.decode()

    def row(html: str, key: str) -> str:
        return re.search(rf'<tr class="[^"]*" data-key="{re.escape(key)}"[^>]*>', html).group(0)

    assert "hidden" not in row(everything, "model.family") and "diff-same" in row(everything, "model.family")
    assert row(only, "model.family").endswith(" hidden>")
    assert "hidden" not in row(only, "trainer.optimizer.lr") and "diff-changed" in row(only, "trainer.optimizer.lr")
    assert 'name="only" value="diff" id="only-diff" checked' in only
    assert "2 of" in everything and "settings differ" in everything


# --- chart data and summary -------------------------------------------------------------------------------------

def test_chart_data_names_each_runs_series_and_time_origin(client, team, pair):
    a, b = pair
    client.force_login(team.viewer)
    response = _compare(client, f"runs={a.pk},{b.pk}")
    data = response.context["chart_data"]
    assert data["keys"] == ["kl", "loss", "reward/mean"]
    assert data["runs"][0]["label"] == f"math #{a.number}" and data["runs"][1]["label"] == f"math #{b.number}"
    assert data["runs"][0]["points"] == {"loss": 3, "reward/mean": 3}
    assert data["runs"][1]["points"] == {"kl": 2, "loss": 4}
    assert data["runs"][0]["t0"] == START  # the engine's first point is earlier than started_at here
    assert data["runs"][1]["t0"] == START + 100
    assert '<script id="compare-data" type="application/json">' in response.content.decode()


def test_points_api_gives_wall_times_for_slashed_keys(client, team, pair):
    a, _ = pair
    client.force_login(team.viewer)
    url = f"/api/v1/runs/{a.pk}/metrics/reward/mean"
    downsampled = client.get(url, {"buckets": 2}).json()
    assert downsampled["steps"] == [1, 2] and downsampled["wall_times"] == [START + 2, START + 4]
    full = client.get(url).json()
    assert full["values"] == [0.0, 0.5, 0.75] and full["wall_times"] == [START, START + 2, START + 4]
    assert [b.wall_time for b in metric_downsampled(run=a, key="loss", buckets=3)] == [START, START + 2, START + 4]


def test_summary_shows_state_who_duration_and_final_values(client, team, pair):
    a, b = pair
    client.force_login(team.viewer)
    response = _compare(client, f"runs={a.pk},{b.pk}")
    assert response.context["summary_keys"] == ["reward/mean", "loss"]
    rows = {row.run.pk: row for row in response.context["rows"]}
    assert rows[a.pk].finals == [0.75, 0.25] and rows[b.pk].finals == [None, 0.125]
    assert rows[a.pk].duration_s == 125.0
    html = response.content.decode()
    summary = html[html.index('<tr data-run="%d">' % a.pk):]
    summary = summary[:summary.index("</tr>")]
    assert "Succeeded" in summary and "mateo" in summary and "2m 05s" in summary and "0.75" in summary
    assert f'href="/runs/{a.pk}/"' in summary
    assert "<code>trainer.optimizer.lr=0.001</code> <code>trainer.steps=8</code>" in html  # b's overrides


def test_summary_falls_back_to_the_first_keys_without_key_metrics(client, team, grpo_yaml):
    runs = [run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml) for _ in range(2)]
    _ingest(runs[0], {"b": [1.0], "a": [2.0]})
    client.force_login(team.member)
    response = _compare(client, f"runs={runs[0].pk},{runs[1].pk}")
    assert response.status_code == 200 and response.context["summary_keys"] == ["a", "b"]
    assert response.context["differing"] == 0 and "The configs are identical." in response.content.decode()


def test_a_viewer_of_two_projects_can_compare_only_within_one(client, team, pair):
    membership_set(actor=team.owner, project=project_create(actor=team.owner, slug="gamma", name="G"),
                   user=team.viewer, role=Role.VIEWER)
    a, b = pair
    client.force_login(team.viewer)
    assert _compare(client, f"runs={a.pk},{b.pk}", slug="gamma").status_code == 400
