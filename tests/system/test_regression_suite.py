"""A regression suite end to end on CPU: `forgeboard ci run` launches two stages of real training runs,
passes against its own baseline, and fails (exit 1, JUnit failure) once a stage cannot learn."""

from __future__ import annotations

import subprocess
import sys
from xml.etree import ElementTree

import pytest
from django.conf import settings

from forgeboard.accounts.services import api_token_create
from forgeboard.regressions.models import Suite
from forgeboard.regressions.services import suite_create
from tests.support.configs import sft_yaml
from tests.support.processes import REPO_DIR, platform_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))]


def _ci_run(url: str, token: str, junit) -> tuple[int, str]:  # noqa: ANN001
    result = subprocess.run(
        [sys.executable, "-m", "forgeboard.cli", "ci", "run", "smoke", "--project", "alpha", "--url", url,
         "--token", token, "--wait", "--timeout", "300", "--junit", str(junit)],
        cwd=REPO_DIR, env=platform_env(), capture_output=True, text=True, timeout=400,
    )
    return result.returncode, result.stdout + result.stderr


def _failures(junit) -> dict[str, list[str]]:  # noqa: ANN001
    root = ElementTree.parse(junit).getroot()
    return {suite.get("name"): [case.get("name") for case in suite if case.find("failure") is not None]
            for suite in root}


def test_suite_passes_against_its_baseline_and_fails_on_a_regression(platform, team, tiny_model, tmp_path):
    experiment = team.experiment
    experiment.recipe = "sft"
    experiment.save(update_fields=["recipe"])
    checks = [
        {"name": "final-loss", "metric": "loss", "direction": "lower_is_better"},
        {"name": "throughput", "metric": "throughput/train_tokens_per_s", "direction": "higher_is_better",
         "gate": False, "baseline": {"kind": "history", "min_tolerance": 0.9}},
    ]
    config = sft_yaml(tiny_model, steps=30)
    spec = {"stages": [
        {"name": "batch-8", "experiment_id": experiment.pk, "config_yaml": config,
         "overrides": ["trainer.batch_size=8"], "checks": checks},
        {"name": "batch-16", "experiment_id": experiment.pk, "config_yaml": config,
         "overrides": ["trainer.batch_size=16", "trainer.micro_batch_size=16"], "checks": checks},
    ]}
    suite = suite_create(actor=team.member, project=team.project, name="smoke", spec=spec)
    _, token = api_token_create(actor=team.member, project=team.project, name="ci", scope="write")

    code, out = _ci_run(platform["url"], token, tmp_path / "first.xml")
    assert code == 0, out
    assert "no_baseline" in out and _failures(tmp_path / "first.xml") == {"batch-8": [], "batch-16": []}

    code, out = _ci_run(platform["url"], token, tmp_path / "second.xml")
    assert code == 0, out
    assert "verdict: passed" in out and "passed      final-loss" in out

    # Make one stage unable to learn, deterministically: its loss at the end stays near the start.
    spec["stages"][1]["overrides"].append("trainer.optimizer.lr=1e-9")
    Suite.objects.filter(pk=suite.pk).update(spec=spec)
    code, out = _ci_run(platform["url"], token, tmp_path / "third.xml")
    assert code == 1, out
    assert "verdict: failed" in out
    assert _failures(tmp_path / "third.xml") == {"batch-8": [], "batch-16": ["final-loss"]}
