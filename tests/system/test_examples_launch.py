"""Every file in examples/configs launched through the control plane's API, as a user of the dashboard would.

A real web server, Celery worker and engine: each CPU example reaches its first step (a metric at step >= 1
is stored), the drills example injects its first fault and recovers from it, and each GPU example is refused
at validation with the reason where no host has a GPU. Runs are short (overrides) and cancelled once they
have shown it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from django.conf import settings

from forgeboard.accounts.services import api_token_create
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Run
from forgeboard.runs.states import TERMINAL_STATES
from forgeboard.telemetry.models import MetricPoint, RunEvent
from tests.support.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))]

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.yaml"))
GPU = {"llama3_8b_grpo.yaml": "config.placement.trainer.gpus_per_proc", "qwen3_1_7b_grpo.yaml": "config.trainer.device"}
# Short runs: a few small steps, no console, quick telemetry. The drills example keeps its drills.
SHORT = ["trainer.steps=12", "trainer.batch_size=2", "data.eval_size=8", "eval.every_steps=50",
         "eval.rollout_samples=1", "telemetry.console=false", "telemetry.flush_seconds=0.2"]
SHORT_GRPO = ["grpo.group_size=4"]  # an SFT run refuses GRPO's options


def _api(platform, token: str) -> httpx.Client:
    return httpx.Client(base_url=f"{platform['url']}/api/v1", headers={"Authorization": f"Bearer {token}"},
                        timeout=30)


def _events(run_id: int, kind: str) -> list[dict]:
    return list(RunEvent.objects.filter(run_id=run_id, kind=kind).order_by("seq").values_list("payload", flat=True))


def _why(run_id: int) -> str:
    run = Run.objects.get(pk=run_id)
    from workers.launch.local import run_dir

    log = run_dir(run) / "supervisor.log"
    return f"run {run_id} {run.state}: {run.exit_reason}\n" + (log.read_text()[-3000:] if log.exists() else "")


def _first_step(run_id: int) -> bool:
    if Run.objects.filter(pk=run_id, state__in=TERMINAL_STATES).exists():
        raise AssertionError(_why(run_id))
    return MetricPoint.objects.filter(series__run_id=run_id, step__gte=1).exists()


def _recovered_from_first_fault(run_id: int) -> bool:
    if Run.objects.filter(pk=run_id, state__in=TERMINAL_STATES).exists():
        raise AssertionError(_why(run_id))
    injected = _events(run_id, "fault_injected")
    if not injected:
        return False
    first = injected[0]["fault_id"]
    return any(e.get("fault_id") == first for e in _events(run_id, "recovered"))


def test_every_example_launches_from_the_control_plane(platform, team, tiny_model):
    _, token = api_token_create(actor=team.member, project=team.project, name="examples", scope="write")
    experiments = {"grpo": team.experiment.pk,
                   "sft": experiment_create(actor=team.owner, project=team.project, name="warm", recipe="sft").pk}
    assert {path.name for path in EXAMPLES} >= {"cpu_demo_grpo.yaml", "cpu_demo_grpo_drills.yaml",
                                                "cpu_demo_grpo_two_hosts.yaml", "cpu_demo_sft.yaml", *GPU}
    shown: dict[str, str] = {}
    with _api(platform, token) as api:
        for path in EXAMPLES:  # one at a time: each wait below is on this run
            text = path.read_text()
            recipe = yaml.safe_load(text)["recipe"]
            body = {"config_yaml": text,
                    "overrides": [f"model.path={tiny_model}", *SHORT, *(SHORT_GRPO if recipe == "grpo" else [])]}
            check = api.post("/configs/validate", json={"recipe": recipe, "project": team.project.slug, "yaml": text,
                                                        "overrides": body["overrides"]}).json()
            response = api.post(f"/experiments/{experiments[recipe]}/runs", json=body)
            if path.name in GPU:
                assert response.status_code == 400, response.text
                fields = [e["field"] for e in response.json()["errors"]]
                assert fields == [GPU[path.name]], response.text
                assert "the largest host has 0" in response.json()["errors"][0]["message"]
                assert check["ok"] is False and [f"config.{e['field']}" for e in check["errors"]] == fields
                assert check["errors"][0]["line"] is not None
                shown[path.name] = "refused: " + response.json()["errors"][0]["message"]
                continue
            assert check == {"ok": True, "errors": []}, check
            assert response.status_code == 201, response.text
            run_id = response.json()["id"]
            wait_for(lambda: _first_step(run_id), timeout=240, interval=0.5, what=f"{path.name}: a step >= 1")
            shown[path.name] = "first step"
            if path.name == "cpu_demo_grpo_drills.yaml":
                wait_for(lambda: _recovered_from_first_fault(run_id), timeout=240, interval=0.5,
                         what=f"{path.name}: its first fault injected and recovered")
                # its first drill: a generator killed before step 10, or the reward's every 60 s if that comes first
                first = _events(run_id, "fault_injected")[0]
                assert first["fault_kind"] == "kill" and first["role"] in ("generator", "reward"), first
                assert any(e.get("fault_id") == first["fault_id"] for e in _events(run_id, "failure_detected"))
                assert any(e.get("role") == first["role"] for e in _events(run_id, "replica_replaced"))
                shown[path.name] = "first step, kill injected, recovered"
            assert api.post(f"/runs/{run_id}/cancel").status_code == 200
            wait_for(lambda: Run.objects.filter(pk=run_id, state__in=TERMINAL_STATES).exists(), timeout=120,
                     what=f"{path.name}: cancelled")
    assert set(shown) == {path.name for path in EXAMPLES}, shown
