"""What-if plans on the platform (#18): /api/v1/plans for a config before launch, calibrated from a run of the same
project (its stored step timelines: telemetry recorded from real Monarch runs on this machine by
tests/bench/bench_whatif.py), hostile input refused at its field, and each regression stage's step predicted from
the suite run's first stage beside the step it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeboard.accounts.services import api_token_create, project_create
from forgeboard.experiments.services import experiment_create
from forgeboard.regressions.models import SuiteRun
from forgeboard.regressions.services import suite_create, suite_launch, suite_run_refresh
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.ingest import telemetry_ingest
from workers.engine.config import load_config
from workers.engine.models.tiny import make_tiny_model
from workers.engine.planning.devices import cpu_device
from workers.engine.planning.fitting import calibrate_from_records, measured_steps, median_step
from workers.engine.planning.report import model_shape
from workers.engine.planning.whatif import Placement, predict, workload_for
from workers.engine.telemetry_wire import StepTimeline, TelemetryBatch

RECORDED = Path(__file__).parents[1] / "support" / "recorded" / "whatif"
# The bench's common settings (tests/bench/bench_whatif.py), as the stage configs write them.
BENCH_YAML = """\
recipe: grpo
model:
  path: {model}
placement:
  backend: monarch
trainer:
  device: cpu
  threads_per_process: 1
  steps: 10
  batch_size: 8
  micro_batch_size: 32
grpo:
  group_size: 4
generator:
  max_new_tokens: 32
eval:
  every_steps: 0
  rollout_samples: 0
"""
REPLICAS2 = ["generator.replicas=2"]


def _as_sft(grpo_yaml: str) -> str:
    """The same settings as an SFT config: its recipe, without GRPO's own section (an SFT run refuses it)."""
    return grpo_yaml.replace("recipe: grpo", "recipe: sft").replace("grpo:\n  group_size: 4\n", "")


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory) -> Path:
    """The bench's tiny Qwen3 (its shape is what the recorded runs ran)."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-h192-l4", hidden_size=192, num_layers=4,
                           num_heads=4, num_kv_heads=2, intermediate_size=384)


@pytest.fixture
def bench_yaml(bench_model, settings) -> str:
    settings.ARTIFACT_ROOTS = [bench_model.parent]
    return BENCH_YAML.format(model=bench_model)


def recorded(name: str) -> list[dict]:
    return [json.loads(line) for line in (RECORDED / f"{name}.jsonl").read_text().splitlines() if line.strip()]


def ingest(run: Run, records: list[dict]) -> None:
    """Store a recorded run's telemetry through the real ingest path, as its engine would have sent it."""
    metrics = [{"key": r["key"], "step": r["step"], "value": r["value"], "time": 1_764_700_000.0 + r["step"]}
               for r in records if r["kind"] == "metric"]
    events = [{"kind": "step_timeline", "payload": {k: v for k, v in r.items() if k in StepTimeline.model_fields},
               "time": r["start"] + r["seconds"]} for r in records if r.get("name") == "step_timeline"]
    telemetry_ingest(run=run, batches=[TelemetryBatch.model_validate({"seq": 1, "metrics": metrics, "events": events})])


@pytest.fixture
def calibration_run(team, bench_yaml) -> Run:
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=bench_yaml)
    ingest(run, recorded("calibrate"))
    Run.objects.filter(pk=run.pk).update(state=RunState.SUCCEEDED)
    return run


@pytest.fixture
def bearer(team) -> dict[str, str]:
    _, token = api_token_create(actor=team.member, project=team.project, name="planner", scope="read")
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def plan(client, bearer, **body):
    body = {"project": "alpha", "recipe": "grpo"} | body
    return client.post("/api/v1/plans", data=json.dumps(body), content_type="application/json", **bearer)


def refused(response, field: str) -> str:
    assert response.status_code == 400, response.content[:500]
    body = response.json()
    assert body["code"] == "validation_failed" and field in [e["field"] for e in body["errors"]], body
    return body["message"]


def engine_expectation(model: Path, *, overrides: list[str]) -> tuple[float, float]:
    """(predicted, measured) step seconds computed by the engine's own functions from the recorded runs."""
    config = load_config(BENCH_YAML.format(model=model))
    shape = model_shape(config)
    calibration, workload, _ = calibrate_from_records(shape, config=config, records=recorded("calibrate"),
                                                      device=cpu_device())
    target = load_config(BENCH_YAML.format(model=model), overrides=overrides)
    case = workload_for(target, measured=workload)
    predicted = predict(shape, case, Placement.from_config(target), device=cpu_device(), calibration=calibration)
    name = "replicas2" if overrides else "calibrate"
    timelines = [r for r in recorded(name) if r.get("name") == "step_timeline"]
    return predicted.step_s, median_step(measured_steps(timelines)).seconds


def test_a_plan_of_a_config_before_launch(client, team, bearer, bench_yaml):
    response = plan(client, bearer, yaml=bench_yaml, device="h100", gpus=[3, 12, 48, 192])
    assert response.status_code == 200, response.content[:500]
    body = response.json()
    assert body["device"] == "h100" and body["calibration_note"] == "the defaults (no measured run)"
    assert body["model"] == {"name": "tiny-qwen3-h192-l4", "params": body["model"]["params"]}
    assert 1_400_000 < body["model"]["params"] < 1_500_000
    assert [s["devices"] for s in body["scales"]] == [3, 12, 48, 192]
    for scale in body["scales"]:
        assert scale["best"]["step_s"] <= scale["as_written"]["step_s"] and scale["gain"] >= 1.0
        assert scale["best"]["devices"] <= scale["devices"]
        assert scale["as_written"]["bottleneck"] in ("generation", "training", "weight sync", "reward and reference",
                                                     "controller overhead")
    assert body["as_configured"]["devices"] == 2  # 1 trainer rank + 1 generator replica


def test_a_plan_calibrated_on_a_run_reproduces_that_run(client, team, bearer, bench_yaml, bench_model,
                                                        calibration_run):
    body = plan(client, bearer, yaml=bench_yaml, device="cpu", gpus=[3], calibration_run=calibration_run.pk).json()
    assert body["calibration_note"] == f"fitted from run {calibration_run.pk} on cpu"
    assert body["calibration"]["source"]["run_id"] == calibration_run.pk
    predicted, measured = engine_expectation(bench_model, overrides=[])
    assert body["as_configured"]["step_s"] == pytest.approx(predicted) == pytest.approx(measured, rel=1e-6)
    # the same config with two replicas: the engine's prediction from the recorded calibration, within 30% of the
    # step the recorded two-replica run measured
    two = plan(client, bearer, yaml=bench_yaml, overrides=REPLICAS2, device="cpu", gpus=[3],
               calibration_run=calibration_run.pk).json()
    predicted, measured = engine_expectation(bench_model, overrides=REPLICAS2)
    assert two["as_configured"]["step_s"] == pytest.approx(predicted)
    assert abs(predicted - measured) / measured < 0.30
    # a CPU calibration says nothing about an H100: not applied there, and the note says so
    on_gpu = plan(client, bearer, yaml=bench_yaml, device="h100", calibration_run=calibration_run.pk).json()
    assert on_gpu["calibration_note"] == "the defaults: the measured run was on cpu, not h100"


def test_a_calibration_run_of_another_project_is_not_found(client, team, bearer, bench_yaml):
    other = project_create(actor=team.outsider, slug="beta", name="Beta")
    experiment = experiment_create(actor=team.outsider, project=other, name="theirs", recipe="grpo")
    theirs = run_launch(actor=team.outsider, experiment=experiment, config_yaml=bench_yaml)
    ingest(theirs, recorded("calibrate"))
    response = plan(client, bearer, yaml=bench_yaml, device="cpu", calibration_run=theirs.pk)
    assert response.status_code == 404 and response.json()["message"] == f"no run {theirs.pk} in alpha"
    missing = plan(client, bearer, yaml=bench_yaml, device="cpu", calibration_run=theirs.pk + 1000)
    assert missing.status_code == 404 and missing.json()["message"] == f"no run {theirs.pk + 1000} in alpha"
    # and the outsider cannot plan in alpha at all
    _, token = api_token_create(actor=team.outsider, project=other, name="beta", scope="read")
    outsider = plan(client, {"HTTP_AUTHORIZATION": f"Bearer {token}"}, yaml=bench_yaml)
    assert outsider.status_code == 404


def test_runs_that_cannot_calibrate_are_refused_at_the_field(client, team, bearer, bench_yaml):
    fresh = run_launch(actor=team.member, experiment=team.experiment, config_yaml=bench_yaml)
    assert "no step_timeline events" in refused(plan(client, bearer, yaml=bench_yaml, calibration_run=fresh.pk),
                                                "calibration_run")
    sft = experiment_create(actor=team.member, project=team.project, name="sft", recipe="sft")
    sft_run = run_launch(actor=team.member, experiment=sft, config_yaml=_as_sft(bench_yaml))
    assert "only GRPO runs calibrate" in refused(plan(client, bearer, yaml=bench_yaml, calibration_run=sft_run.pk),
                                                 "calibration_run")


@pytest.mark.parametrize("body, field", [
    ({"gpus": [1]}, "gpus.0"),
    ({"gpus": [3] * 17}, "gpus"),
    ({"gpus": []}, "gpus"),
    ({"gpus": ["x"]}, "gpus.0"),
    ({"device": "tpu"}, "device"),
    ({"model": "gpt-5"}, "model"),
    ({"batch": "huge"}, "batch"),
    ({"calibration_run": 0}, "calibration_run"),
    ({"yaml": "recipe: grpo\x00"}, "yaml"),
    ({"overrides": ["trainer.ranks=0"]}, "config.trainer.ranks"),
    ({"yaml": "recipe: grpo\nmodel: {path: /nowhere/at/all}\n"}, "config.model.path"),
])
def test_hostile_plans_are_refused_at_their_field(client, team, bearer, bench_yaml, body, field):
    refused(plan(client, bearer, **({"yaml": bench_yaml} | body)), field)


def test_an_sft_config_and_a_broken_model_folder_are_refused(client, team, bearer, bench_yaml, bench_model, tmp_path,
                                                              settings):
    sft = _as_sft(bench_yaml)
    assert "models GRPO steps" in refused(plan(client, bearer, recipe="sft", yaml=sft), "recipe")
    broken = tmp_path / "broken"
    broken.mkdir()
    settings.ARTIFACT_ROOTS = [bench_model.parent, tmp_path]
    for text in ('{"num_hidden_layers": -1, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8, '
                 '"vocab_size": 10}', "[" * 100_000, "not json", '"a string"'):
        (broken / "config.json").write_text(text)
        message = refused(plan(client, bearer, yaml=bench_yaml.replace(str(bench_model), str(broken))), "model")
        assert "config.json" in message
    # a known shape instead of the folder
    named = plan(client, bearer, yaml=bench_yaml.replace(str(bench_model), str(broken)), model="qwen3-1.7b")
    assert named.status_code == 200 and named.json()["model"]["name"] == "qwen3-1.7b"


def test_each_stage_is_predicted_from_the_first_beside_what_it_measured(client, bearer, team, bench_yaml,
                                                                        bench_model):
    checks = [{"name": "step-time", "metric": "time/step_s", "direction": "lower_is_better", "gate": False}]
    spec = {"stages": [
        {"name": "1-replica", "experiment_id": team.experiment.pk, "config_yaml": bench_yaml, "checks": checks},
        {"name": "2-replicas", "experiment_id": team.experiment.pk, "config_yaml": bench_yaml,
         "overrides": REPLICAS2, "checks": checks}]}
    suite = suite_create(actor=team.member, project=team.project, name="scale", spec=spec)
    suite_run = suite_launch(actor=team.member, suite=suite)
    for stage, name in zip(suite_run.stages.order_by("id"), ("calibrate", "replicas2")):
        ingest(stage.run, recorded(name))
        Run.objects.filter(pk=stage.run_id).update(state=RunState.SUCCEEDED)
    judged = suite_run_refresh(suite_run=SuiteRun.objects.get(pk=suite_run.pk))
    first, second = judged.stages.order_by("id")
    assert first.prediction_error == pytest.approx(0.0, abs=1e-9)  # its own calibration
    predicted, measured = engine_expectation(bench_model, overrides=REPLICAS2)
    assert second.predicted_step_s == pytest.approx(predicted) and second.measured_step_s == pytest.approx(measured)
    assert abs(second.prediction_error) < 0.30
    assert second.prediction_note == f"calibrated on math #{first.run.number} (run {first.run_id})"
    # the API's stage table says the same
    stages = client.get(f"/api/v1/suite-runs/{suite_run.pk}", **bearer).json()["stages"]
    assert [s["name"] for s in stages] == ["1-replica", "2-replicas"]
    assert stages[1]["predicted_step_s"] == pytest.approx(predicted)
    assert stages[1]["measured_step_s"] == pytest.approx(measured)
    assert stages[1]["prediction_error"] == pytest.approx((predicted - measured) / measured)
    assert stages[0]["prediction_note"].startswith("calibrated on math #")


def test_a_stage_without_timelines_is_measured_as_nothing_and_still_judged(team, bench_yaml):
    checks = [{"name": "step-time", "metric": "time/step_s", "direction": "lower_is_better", "gate": False}]
    spec = {"stages": [{"name": "only", "experiment_id": team.experiment.pk, "config_yaml": bench_yaml,
                        "checks": checks}]}
    suite_run = suite_launch(actor=team.member, suite=suite_create(actor=team.member, project=team.project,
                                                                   name="bare", spec=spec))
    Run.objects.filter(pk=suite_run.stages.get().run_id).update(state=RunState.SUCCEEDED)
    judged = suite_run_refresh(suite_run=SuiteRun.objects.get(pk=suite_run.pk))
    stage = judged.stages.get()
    assert judged.verdict != "running" and stage.predicted_step_s is None and stage.measured_step_s is None
    assert stage.prediction_note.startswith("no calibration")


def test_forgeboard_plan_is_the_engines_planner(tmp_path, bench_model, capsys):
    from forgeboard.cli import main

    config = tmp_path / "config.yaml"
    config.write_text(BENCH_YAML.format(model=bench_model))
    assert main(["plan", "--config", str(config), "--gpus", "3,12", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["devices"] for s in report["scales"]] == [3, 12] and report["device"] == "h100"


def test_the_launch_page_offers_only_this_projects_runs_with_timelines(client, team, bench_yaml, calibration_run):
    from forgeboard.runs.planning import calibration_runs

    other = project_create(actor=team.outsider, slug="beta", name="Beta")
    theirs = run_launch(actor=team.outsider, experiment=experiment_create(actor=team.outsider, project=other,
                                                                          name="theirs", recipe="grpo"),
                        config_yaml=bench_yaml)
    ingest(theirs, recorded("calibrate"))
    bare = run_launch(actor=team.member, experiment=team.experiment, config_yaml=bench_yaml)
    assert calibration_runs(project=team.project) == [calibration_run]
    client.force_login(team.member)
    page = client.get("/p/alpha/launch/").content.decode()
    assert f'<option value="{calibration_run.pk}">math #{calibration_run.number}' in page
    assert f'<option value="{theirs.pk}">' not in page and f'<option value="{bare.pk}">' not in page


def test_a_run_on_a_gpu_the_table_lacks_cannot_calibrate_and_is_not_predicted(client, team, bearer, bench_yaml,
                                                                              calibration_run):
    from forgeboard.cluster.models import Device, DeviceKind, Host
    from forgeboard.runs.planning import run_calibration, run_device_kind, stage_prediction

    gpu_yaml = bench_yaml.replace("  device: cpu\n", "")  # trainer.device auto: the host's GPUs
    runs = {}
    for hostname, model, kind in (("gpu-t4", "Tesla T4", None), ("gpu-h200", "NVIDIA H200", "h200")):
        host = Host.objects.create(hostname=hostname)
        Device.objects.create(host=host, kind=DeviceKind.GPU, index=0, model=model)
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=gpu_yaml)
        Run.objects.filter(pk=run.pk).update(host=hostname)
        run.refresh_from_db()
        runs[model] = run
        ingest(run, recorded("calibrate"))
        assert run_device_kind(run=run, config=run.config.run_config) == kind
        # its step on another device kind than the calibration's is measured, not predicted
        prediction = stage_prediction(run=run, calibrated=run_calibration(run=calibration_run))
        assert prediction.predicted_step_s is None and prediction.measured_step_s is not None
        assert prediction.note == f"ran on {kind or 'an unknown GPU'}, calibrated on cpu"
    message = refused(plan(client, bearer, yaml=bench_yaml, calibration_run=runs["Tesla T4"].pk),
                      "calibration_run")
    assert "a GPU the device table does not have" in message
