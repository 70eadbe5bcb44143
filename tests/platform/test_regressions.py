"""Regression suites: validation, baselines (pinned and history), one-sided verdicts, gates and warnings."""

from __future__ import annotations

import pytest

from forgeboard.errors import ValidationFailed
from forgeboard.regressions.models import Suite, SuiteRun
from forgeboard.regressions.services import suite_create, suite_launch, suite_run_refresh
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.ingest import telemetry_ingest
from workers.engine.telemetry_wire import TelemetryBatch


def spec_for(experiment, grpo_yaml, **check) -> dict:
    checks = [
        {"name": "reward", "metric": "eval/reward_mean", "direction": "higher_is_better"} | check,
        {"name": "step-time", "metric": "time/step_s", "direction": "lower_is_better", "gate": False},
    ]
    return {"stages": [{"name": "1-proc", "experiment_id": experiment.pk, "config_yaml": grpo_yaml,
                        "checks": checks}]}


def finish(suite_run: SuiteRun, *, reward: float, step_time: float = 1.0, state: RunState = RunState.SUCCEEDED):
    """Stand in for the engine: report the metrics of every stage run and end it."""
    for stage in suite_run.stages.select_related("run"):
        metrics = [{"key": "eval/reward_mean", "step": 10, "value": reward, "time": 1.0},
                   {"key": "time/step_s", "step": 10, "value": step_time, "time": 1.0}]
        telemetry_ingest(run=stage.run, batches=[TelemetryBatch.model_validate({"seq": 1, "metrics": metrics})])
        Run.objects.filter(pk=stage.run_id).update(state=state, exit_reason="" if state == "succeeded" else "boom")
    return suite_run_refresh(suite_run=SuiteRun.objects.get(pk=suite_run.pk))


@pytest.fixture
def suite(team, grpo_yaml) -> Suite:
    return suite_create(actor=team.member, project=team.project, name="smoke",
                        spec=spec_for(team.experiment, grpo_yaml))


def _verdicts(suite_run: SuiteRun) -> dict[str, str]:
    return {c.name: c.verdict for s in suite_run.stages.all() for c in s.checks.all()}


def test_history_baseline_passes_equal_and_better_and_fails_worse(team, suite):
    first = finish(suite_launch(actor=team.member, suite=suite), reward=0.50)
    assert first.verdict == "passed" and _verdicts(first)["reward"] == "no_baseline"
    same = finish(suite_launch(actor=team.member, suite=suite), reward=0.50)
    assert same.verdict == "passed" and _verdicts(same) == {"reward": "passed", "step-time": "passed"}
    better = finish(suite_launch(actor=team.member, suite=suite), reward=0.52, step_time=0.5)
    assert better.verdict == "passed", "an improvement never fails"
    within = finish(suite_launch(actor=team.member, suite=suite), reward=0.49)
    assert within.verdict == "passed", "inside the tolerance"
    worse = finish(suite_launch(actor=team.member, suite=suite), reward=0.30)
    assert worse.verdict == "failed"
    check = worse.stages.get().checks.get(name="reward")
    assert check.baseline == pytest.approx(0.50) and check.value == pytest.approx(0.30)
    # tolerance = max(5% of 0.5, 3 sigma of [0.5, 0.5, 0.52, 0.49])
    assert check.threshold == pytest.approx(0.5 - 3 * 0.010897247, rel=1e-4)
    assert "worse than the threshold" in check.detail
    after = finish(suite_launch(actor=team.member, suite=suite), reward=0.49)
    assert after.verdict == "passed", "a failed run does not become the baseline"
    huge = finish(suite_launch(actor=team.member, suite=suite), reward=5.0, step_time=0.01)
    assert huge.verdict == "passed", "however large, an improvement never fails"


def test_non_gating_check_warns(team, suite):
    finish(suite_launch(actor=team.member, suite=suite), reward=0.5, step_time=1.0)
    slow = finish(suite_launch(actor=team.member, suite=suite), reward=0.5, step_time=3.0)
    assert slow.verdict == "warned" and _verdicts(slow)["step-time"] == "warned"


def test_a_stage_whose_run_failed_is_an_error(team, suite):
    broken = finish(suite_launch(actor=team.member, suite=suite), reward=0.5, state=RunState.FAILED)
    assert broken.verdict == "error"
    assert "ended failed: boom" in broken.stages.get().checks.get().detail


def test_verdict_waits_for_every_stage(team, suite):
    suite_run = suite_launch(actor=team.member, suite=suite)
    assert suite_run_refresh(suite_run=suite_run).verdict == "running"
    assert suite_run.stages.get().run.state == RunState.QUEUED


def test_pinned_baseline(team, grpo_yaml):
    pinned = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    telemetry_ingest(run=pinned, batches=[TelemetryBatch.model_validate(
        {"seq": 1, "metrics": [{"key": "eval/reward_mean", "step": 10, "value": 0.8, "time": 1.0},
                               {"key": "time/step_s", "step": 10, "value": 1.0, "time": 1.0}]})])
    suite = suite_create(actor=team.member, project=team.project, name="pinned", spec=spec_for(
        team.experiment, grpo_yaml, baseline={"kind": "pinned", "run_id": pinned.pk, "tolerance": 0.1}))
    assert finish(suite_launch(actor=team.member, suite=suite), reward=0.75).verdict == "passed"
    assert finish(suite_launch(actor=team.member, suite=suite), reward=0.70).verdict == "failed"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda s: s["stages"][0].update(experiment_id=999999), "spec.stages.0.experiment_id"),
        (lambda s: s["stages"][0].update(config_yaml="recipe: grpo\nmodel: {path: /m}\ntrainer: {steps: 0}\n"),
         "spec.stages.0.config.trainer.steps"),
        (lambda s: s["stages"][0]["checks"][0].update(direction="sideways"), "spec.stages.0.checks.0.direction"),
        (lambda s: s["stages"].append(dict(s["stages"][0])), "spec"),
        (lambda s: s["stages"][0].update(checks=[]), "spec.stages.0.checks"),
        (lambda s: s["stages"][0]["checks"][0].update(baseline={"kind": "pinned", "run_id": 424242}),
         "spec.stages.0.checks.0.baseline.run_id"),
    ],
)
def test_bad_suites_are_refused_with_the_field(team, grpo_yaml, mutate, field):
    spec = spec_for(team.experiment, grpo_yaml)
    mutate(spec)
    with pytest.raises(ValidationFailed) as caught:
        suite_create(actor=team.member, project=team.project, name="bad", spec=spec)
    assert field in [p.field for p in caught.value.problems], caught.value.problems
    assert Suite.objects.count() == 0


@pytest.mark.parametrize("name", ["", "   ", "x" * 101, 7])
def test_bad_suite_names_are_refused(team, grpo_yaml, name):
    with pytest.raises(ValidationFailed) as caught:
        suite_create(actor=team.member, project=team.project, name=name, spec=spec_for(team.experiment, grpo_yaml))
    assert caught.value.problems[0].field == "name"
    assert Suite.objects.count() == 0


def test_viewers_cannot_define_or_launch(team, suite, grpo_yaml):
    from forgeboard.errors import PermissionDenied

    with pytest.raises(PermissionDenied):
        suite_create(actor=team.viewer, project=team.project, name="v", spec=spec_for(team.experiment, grpo_yaml))
    with pytest.raises(PermissionDenied):
        suite_launch(actor=team.viewer, suite=suite)
    assert SuiteRun.objects.count() == 0


def test_ci_command_writes_junit_and_exits_by_verdict(team, suite, tmp_path, monkeypatch, wsgi_in_process):
    """`forgeboard ci run` against the API (in process): exit 0 on a pass, 1 on a regression, JUnit either way."""
    import httpx
    from xml.etree import ElementTree

    from forgeboard import ci, client
    from forgeboard.accounts.services import api_token_create
    from forgeboard.wsgi import application

    _, token = api_token_create(actor=team.member, project=team.project, name="ci", scope="write")
    transport = httpx.WSGITransport(app=application)
    monkeypatch.setattr(client.ForgeboardClient, "wait_suite_run", lambda self, i, timeout_s: _finish_and_read(self, i))
    original = client.ForgeboardClient.__init__
    monkeypatch.setattr(client.ForgeboardClient, "__init__",
                        lambda self, url, tok, **kw: original(self, url, tok, transport=transport))
    rewards = iter([0.5, 0.5, 0.2])

    def _finish_and_read(self, suite_run_id):
        finish(SuiteRun.objects.get(pk=suite_run_id), reward=next(rewards))
        return self.suite_run(suite_run_id)

    codes = []
    for i in range(3):
        args = ci.build_args(["run", "smoke", "--project", "alpha", "--url", "http://testserver", "--token", token,
                              "--wait", "--junit", str(tmp_path / f"{i}.xml")])
        codes.append(ci.run_suite(args))
    assert codes == [0, 0, 1]
    failed = ElementTree.parse(tmp_path / "2.xml").getroot()
    assert [c.get("name") for c in failed.iter("testcase") if c.find("failure") is not None] == ["reward"]
    assert ci.run_suite(ci.build_args(["run", "smoke", "--url", "http://testserver", "--token", token])) == 2
