"""Drills, placement changes and redirects are checked against the engine's typed operations before they are stored."""

from __future__ import annotations

import json

import pytest

from forgeboard.errors import Conflict, ValidationFailed
from forgeboard.runs.models import Command
from forgeboard.runs.services import command_create
from tests.platform.conftest import TINY_GRPO_YAML


def test_a_valid_drill_is_stored_for_a_monarch_run(team, monarch_running_run):
    run, _ = monarch_running_run
    payload = {"kind": "hang", "role": "generator", "replica": 1, "duration_s": 2.5, "schedule": {"at_step": 3}}
    command = command_create(actor=team.member, run=run, kind="fault_drill", payload=payload)
    assert Command.objects.get(pk=command.pk).payload == payload


@pytest.mark.parametrize(("kind", "payload", "field"), [
    ("fault_drill", {"kind": "kill", "role": "scheduler"}, "payload.role"),
    ("fault_drill", {"kind": "latency", "role": "generator"}, "payload.latency_ms"),
    ("fault_drill", {"kind": "nan_gradients", "role": "generator"}, "payload.role"),
    ("fault_drill", {"kind": "kill", "role": "generator", "replica": -1}, "payload.replica"),
    ("fault_drill", {"kind": "kill", "role": "generator", "surprise": 1}, "payload.surprise"),
    ("placement_change", {"action": "move", "role": "generator", "replica": 0}, "payload.host"),
    ("load_redirect", {"action": "drain", "host": "no spaces allowed"}, "payload.host"),
])
def test_bad_operations_name_the_field_and_store_nothing(team, monarch_running_run, kind, payload, field):
    run, _ = monarch_running_run
    with pytest.raises(ValidationFailed) as caught:
        command_create(actor=team.member, run=run, kind=kind, payload=payload)
    assert field in [p.field for p in caught.value.problems]
    assert not Command.objects.filter(run=run).exists()


def test_a_single_process_run_refuses_operations_with_the_reason(team, running_run):
    run, _ = running_run
    with pytest.raises(Conflict, match="needs placement.backend monarch"):
        command_create(actor=team.member, run=run, kind="fault_drill", payload={"kind": "kill", "role": "generator"})
    assert not Command.objects.filter(run=run).exists()


def test_the_api_answers_a_bad_drill_with_field_errors(client, team, monarch_running_run):
    run, _ = monarch_running_run
    client.force_login(team.member)
    response = client.post(f"/api/v1/runs/{run.pk}/commands", content_type="application/json",
                           data=json.dumps({"kind": "fault_drill", "payload": {"kind": "melt", "role": "generator"}}))
    assert response.status_code == 400
    assert [e["field"] for e in response.json()["errors"]] == ["payload.kind"]


SFT_MONARCH_YAML = """\
recipe: sft
model: {family: qwen3, path: /models/tiny-qwen3}
trainer: {steps: 5, ranks: 2}
placement: {backend: monarch}
"""


@pytest.fixture
def sft_monarch_run(team):
    """A running 2-rank SFT run on Monarch: drills on its trainer and drains apply, placement changes do not."""
    from forgeboard.experiments.services import experiment_create
    from forgeboard.runs.models import Run
    from forgeboard.runs.services import run_launch
    from forgeboard.runs.states import RunState

    experiment = experiment_create(actor=team.owner, project=team.project, name="warm-start", recipe="sft")
    run = run_launch(actor=team.member, experiment=experiment, config_yaml=SFT_MONARCH_YAML)
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    run.refresh_from_db()
    return run


def test_an_sft_run_takes_trainer_drills_and_drains_and_refuses_placement_changes(team, sft_monarch_run):
    run = sft_monarch_run
    drill = command_create(actor=team.member, run=run, kind="fault_drill",
                           payload={"kind": "kill", "role": "trainer", "replica": 1})
    drain = command_create(actor=team.member, run=run, kind="load_redirect",
                           payload={"action": "drain", "host": "node0"})
    assert [c.kind for c in Command.objects.filter(run=run).order_by("pk")] == ["fault_drill", "load_redirect"]
    assert {drill.pk, drain.pk} == set(Command.objects.filter(run=run).values_list("pk", flat=True))
    with pytest.raises(ValidationFailed) as caught:
        command_create(actor=team.member, run=run, kind="fault_drill", payload={"kind": "kill", "role": "generator"})
    assert [(p.field, p.message) for p in caught.value.problems] == [
        ("payload.role", "an SFT run has no generator: its drills target trainer ranks")]
    with pytest.raises(Conflict, match="an SFT run: it has only trainer ranks, no replicas to place"):
        command_create(actor=team.member, run=run, kind="placement_change",
                       payload={"action": "add", "role": "generator", "host": "node1"})
    assert Command.objects.filter(run=run).count() == 2


def test_the_run_page_of_an_sft_run_offers_trainer_drills_and_no_placement_form(client, team, sft_monarch_run):
    client.force_login(team.member)
    page = client.get(f"/runs/{sft_monarch_run.pk}/").content.decode()
    roles = page.split('name="payload.role">', 1)[1].split("</select>", 1)[0]
    assert roles == "<option>trainer</option>"
    assert 'data-command="placement_change"' not in page and 'data-command="load_redirect"' in page
    assert "An SFT run has only its 2 trainer ranks" in page
    assert "<dt>Trainer ranks</dt><dd>2</dd>" in page and "Generator replicas" not in page


def test_a_slurm_runs_page_offers_the_operator_controls_it_accepts(client, team):
    from forgeboard.runs.models import Run
    from forgeboard.runs.services import run_launch
    from forgeboard.runs.states import RunState

    run = run_launch(actor=team.member, experiment=team.experiment,
                     config_yaml=TINY_GRPO_YAML + "placement:\n  backend: slurm\n")
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    client.force_login(team.member)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'data-command="fault_drill"' in page and 'data-command="placement_change"' in page
    assert 'id="operations-note"' not in page


IN_TRAINER_YAML = """\
recipe: grpo
model: {family: qwen3, path: /models/tiny-qwen3}
trainer: {steps: 5, batch_size: 2, ranks: 2}
generator: {in_trainer: true}
grpo: {group_size: 4}
placement: {backend: monarch}
"""


@pytest.fixture
def in_trainer_run(team):
    """A running Monarch GRPO run whose trainer ranks generate: no generator replicas to drill or place."""
    from forgeboard.runs.models import Run
    from forgeboard.runs.services import run_launch
    from forgeboard.runs.states import RunState

    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=IN_TRAINER_YAML)
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    run.refresh_from_db()
    return run


def test_a_run_generating_in_its_trainer_refuses_generator_drills_and_placements_with_the_reason(team, in_trainer_run):
    run = in_trainer_run
    for kind, payload, advice in (
            ("fault_drill", {"kind": "kill", "role": "generator"}, "drill the trainer"),
            ("placement_change", {"action": "add", "role": "generator", "host": "node1"},
             "place the reward or the reference")):
        with pytest.raises(ValidationFailed) as caught:
            command_create(actor=team.member, run=run, kind=kind, payload=payload)
        [(field, message)] = [(p.field, p.message) for p in caught.value.problems]
        assert field == "payload.role" and "generator.in_trainer" in message and advice in message, kind
    assert not Command.objects.filter(run=run).exists()
    command_create(actor=team.member, run=run, kind="fault_drill", payload={"kind": "kill", "role": "trainer", "replica": 1})
    command_create(actor=team.member, run=run, kind="placement_change",
                   payload={"action": "add", "role": "reward", "host": "node1"})
    command_create(actor=team.member, run=run, kind="load_redirect", payload={"action": "drain", "host": "node0"})
    assert [c.kind for c in Command.objects.filter(run=run).order_by("pk")] == [
        "fault_drill", "placement_change", "load_redirect"]


def test_the_run_page_of_a_run_generating_in_its_trainer_offers_no_generator_to_drill_or_place(client, team,
                                                                                                in_trainer_run):
    client.force_login(team.member)
    page = client.get(f"/runs/{in_trainer_run.pk}/").content.decode()
    drill_roles, placement_roles = [part.split("</select>", 1)[0] for part in page.split('name="payload.role">')[1:3]]
    assert drill_roles == "<option>trainer</option><option>reference</option><option>reward</option>"
    assert placement_roles == "<option>reward</option><option>reference</option>"
    assert "<dt>Generator replicas</dt><dd>0 (the trainer generates)</dd>" in page
