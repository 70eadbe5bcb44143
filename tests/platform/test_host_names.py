"""Host names mean the same to the scheduler and the engine, and what cannot run here is refused at validation.

The rule (placement.<role>.hosts in workers/engine/config.py): with placement.local_hosts the names are the
run's simulated hosts, all on one inventory host; on the monarch backend a generator's names that are not
inventory hosts label its procs on the run's host; every other name is an inventory host.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.utils import timezone

from forgeboard.cluster.models import Device, DeviceKind, Health, Host, HostLiveness
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Run
from forgeboard.runs.demand import LOCAL_HOST
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
MODEL = "model.path=/models/tiny-qwen3"
VALIDATE = "/api/v1/configs/validate"


def _example(name: str) -> str:
    return (EXAMPLES / name).read_text()


def _host(name: str, gpus: int = 0) -> Host:
    host = Host.objects.create(hostname=name, liveness=HostLiveness.UP, health=Health.HEALTHY)
    for index in range(gpus):
        Device.objects.create(host=host, kind=DeviceKind.GPU, index=index, model="H200", health=Health.HEALTHY)
    return host


def _check(client, team, text: str, overrides: list[str], recipe: str = "grpo") -> dict:
    client.force_login(team.member)
    response = client.post(VALIDATE, {"recipe": recipe, "project": "alpha", "yaml": text, "overrides": overrides},
                           content_type="application/json")
    assert response.status_code == 200
    return response.json()


@pytest.fixture(autouse=True)
def two_slots(settings):
    settings.LOCAL_RUN_SLOTS = 2


@pytest.mark.parametrize("inventory", [[], ["this-machine"]])
@pytest.mark.parametrize("example", ["cpu_demo_grpo_drills.yaml", "cpu_demo_grpo_two_hosts.yaml"])
def test_simulated_hosts_and_labels_are_valid_and_scheduled_on_one_inventory_host(client, team, example, inventory):
    for name in inventory:  # the embedded default's worker registers its own machine (cluster.probe)
        _host(name)
    assert _check(client, team, _example(example), [MODEL]) == {"ok": True, "errors": []}
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=_example(example), overrides=[MODEL])
    assert runs_schedule(now=timezone.now()) == [run.pk]
    run.refresh_from_db()
    assert run.state == RunState.LAUNCHING
    assert run.allocation == {(inventory or [LOCAL_HOST])[0]: {"gpus": 0, "slots": 1}}


def test_a_generator_name_that_is_an_inventory_host_pins_the_run_there(team):
    _host("a")
    _host("b")
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=_example("cpu_demo_grpo_drills.yaml"),
                     overrides=[MODEL, "placement.generator.hosts=[b, node-x]"])
    assert runs_schedule(now=timezone.now()) == [run.pk]
    assert Run.objects.get(pk=run.pk).allocation == {"b": {"gpus": 0, "slots": 1}}


@pytest.mark.parametrize(("overrides", "field"), [
    # the monarch engine places a trainer only on a Monarch worker (a simulated host or an inventory host's)
    (["placement.trainer.hosts=[node-a]"], "placement.trainer.hosts"),
    # the local backend runs in one process on an inventory host
    (["placement.backend=local", "placement.generator.hosts=[]", "drills=[]", "generator.replicas=1",
      "trainer.recover_failures=0", "failover={}", "placement.replay_buffer.hosts=[nowhere]"], "placement.replay_buffer.hosts"),
])
def test_names_that_cannot_be_scheduled_are_refused_at_their_field_and_line(client, team, overrides, field):
    _host("this-machine")
    text = _example("cpu_demo_grpo_drills.yaml")
    body = _check(client, team, text, [MODEL, *overrides])
    assert body["ok"] is False
    [problem] = body["errors"]
    assert problem["field"] == field and "not in the cluster inventory (hosts: this-machine)" in problem["message"]
    assert problem["line"] == next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("placement:"))
    assert problem["override"] is not None
    response = client.post(f"/api/v1/experiments/{team.experiment.pk}/runs",
                           {"config_yaml": text, "overrides": [MODEL, *overrides]}, content_type="application/json")
    assert response.status_code == 400 and Run.objects.count() == 0
    assert [e["field"] for e in response.json()["errors"]] == [f"config.{field}"]


@pytest.mark.parametrize(("example", "field", "needs"), [
    ("llama3_8b_grpo.yaml", "placement.trainer.gpus_per_proc", "needs 6 GPUs"),
    ("qwen3_1_7b_grpo.yaml", "trainer.device", "needs 1 GPU (trainer 1×1 GPU)"),
])
@pytest.mark.parametrize("inventory", ["none", "cpu host"])
def test_gpu_examples_are_refused_where_no_host_has_a_gpu(client, team, example, field, needs, inventory):
    if inventory == "cpu host":
        _host("this-machine")
    text = _example(example)
    body = _check(client, team, text, [MODEL])
    assert body["ok"] is False
    [problem] = body["errors"]
    assert problem["field"] == field and needs in problem["message"] and "the largest host has 0" in problem["message"]
    key = field.split(".")[-1]
    assert key in text.splitlines()[problem["line"] - 1]
    response = client.post(f"/api/v1/experiments/{team.experiment.pk}/runs", {"config_yaml": text, "overrides": [MODEL]},
                           content_type="application/json")
    assert response.status_code == 400 and Run.objects.count() == 0
    assert response.json()["errors"][0]["field"] == f"config.{field}"


def test_gpu_examples_are_valid_where_the_inventory_has_the_gpus(client, team):
    _host("gpu-1", gpus=8)
    for example in ("llama3_8b_grpo.yaml", "qwen3_1_7b_grpo.yaml"):
        assert _check(client, team, _example(example), [MODEL]) == {"ok": True, "errors": []}


def test_simulated_hosts_hold_all_their_gpus_on_one_inventory_host(client, team):
    _host("two-a", gpus=2)
    _host("two-b", gpus=2)
    text = _example("cpu_demo_grpo_two_hosts.yaml")
    gpus = [MODEL, "placement.trainer.gpus_per_proc=1", "placement.generator.gpus_per_proc=1"]
    body = _check(client, team, text, gpus)
    assert [(e["field"], "needs 3 GPUs on one host" in e["message"]) for e in body["errors"]] == [
        ("placement.local_hosts", True)]
    _host("four", gpus=4)
    assert _check(client, team, text, gpus)["ok"] is True
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=text, overrides=gpus)
    assert runs_schedule(now=timezone.now()) == [run.pk]
    assert Run.objects.get(pk=run.pk).allocation == {"four": {"gpus": 3, "slots": 0}}


def test_sft_on_cuda_is_refused_without_a_gpu(client, team):
    experiment_create(actor=team.owner, project=team.project, name="warm", recipe="sft")
    body = _check(client, team, _example("cpu_demo_sft.yaml"), [MODEL, "trainer.device=cuda"], recipe="sft")
    assert [e["field"] for e in body["errors"]] == ["trainer.device"]
    assert _check(client, team, _example("cpu_demo_sft.yaml"), [MODEL], recipe="sft")["ok"] is True
