"""Bad input gets a clear error that names the problem, and nothing is stored."""

from __future__ import annotations

import pytest

from forgeboard.audit.models import AuditEvent
from forgeboard.errors import ValidationFailed
from forgeboard.experiments.models import ConfigSnapshot, Experiment
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.telemetry.models import RunEvent
from workers.engine.yaml_safe import MAX_CONFIG_BYTES, MAX_DEPTH

ALIAS_BOMB = """\
recipe: grpo
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: [*d,*d,*d,*d,*d,*d,*d,*d,*d]
"""


def _stored() -> tuple[int, int, int, int, int]:
    return (Run.objects.count(), ConfigSnapshot.objects.count(), Experiment.objects.count(),
            RunEvent.objects.count(), AuditEvent.objects.count())


def _nested(depth: int) -> str:
    return "recipe: grpo\nmodel: {path: /m}\nextra: " + "[" * depth + "1" + "]" * depth + "\n"


BAD_CONFIGS = {
    "malformed": ("recipe: grpo\nmodel: [unclosed\n", "config", "malformed YAML"),
    "not a mapping": ("- just\n- a list\n", "config", "must be a mapping"),
    "empty": ("   \n", "config", "empty"),
    "too big": ("recipe: grpo\n# " + "x" * MAX_CONFIG_BYTES + "\n", "config", "over the limit"),
    "too deep": (_nested(MAX_DEPTH + 5), "config", f"deeper than {MAX_DEPTH}"),
    "alias bomb": (ALIAS_BOMB, "config", "aliases"),
    "duplicate key": ("recipe: grpo\nrecipe: sft\nmodel: {path: /m}\n", "config", "duplicate key 'recipe'"),
    "unknown recipe": ("recipe: ppo\nmodel: {path: /m}\n", "config.recipe", "'grpo' or 'sft'"),
    "unknown key": ("recipe: grpo\nmodel: {path: /m}\ntrainer: {stepz: 3}\n", "config.trainer.stepz", "unknown key"),
    "out of range": ("recipe: grpo\nmodel: {path: /m}\ngrpo: {group_size: 1}\n", "config.grpo.group_size",
                     "greater than or equal to 2"),
    "missing model": ("recipe: grpo\n", "config.model", "Field required"),
    "recipe mismatch": ("recipe: sft\nmodel: {path: /m}\n", "config.recipe", "experiment's recipe is 'grpo'"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_is_refused_with_the_field_and_nothing_is_stored(team, case):
    text, field, message = BAD_CONFIGS[case]
    before = _stored()
    with pytest.raises(ValidationFailed) as caught:
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=text)
    fields = [p.field for p in caught.value.problems]
    assert field in fields, fields
    assert message in caught.value.message
    assert _stored() == before


def test_bad_override_names_the_field(team, grpo_yaml):
    before = _stored()
    with pytest.raises(ValidationFailed) as caught:
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml,
                   overrides=["trainer.steps=-3"])
    assert [p.field for p in caught.value.problems] == ["config.trainer.steps"]
    assert _stored() == before


def test_overrides_are_applied_and_snapshotted(team, grpo_yaml):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml,
                     overrides=["trainer.steps=7"])
    assert run.config.parsed["trainer"]["steps"] == 7
    assert run.config.overrides == ["trainer.steps=7"]
    assert run.config.yaml_text == grpo_yaml


def test_same_config_reuses_one_immutable_snapshot(team, grpo_yaml):
    first = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    second = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    assert first.config_id == second.config_id
    assert (first.number, second.number) == (1, 2)
    snapshot = first.config
    snapshot.yaml_text = "recipe: sft"
    with pytest.raises(Exception, match="cannot be changed"):
        snapshot.save()


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"recipe": "ppo"}, "recipe", "unknown recipe 'ppo'"),
        ({"name": "math"}, "name", "already exists"),
        ({"name": "   "}, "name", "must not be empty"),
        ({"name": "x" * 201}, "name", "at most 200"),
        ({"tags": "not-a-list"}, "tags", "list of text tags"),
        ({"tags": [f"t{i}" for i in range(30)]}, "tags", "at most 20 tags"),
    ],
)
def test_bad_experiment_is_refused(team, kwargs, field, message):
    before = _stored()
    args = {"name": "new-one", "recipe": "grpo"} | kwargs
    with pytest.raises(ValidationFailed) as caught:
        experiment_create(actor=team.member, project=team.project, **args)
    assert caught.value.problems[0].field == field
    assert message in caught.value.message
    assert _stored() == before


@pytest.mark.parametrize("priority", [101, -101, True, "1"])
def test_bad_priority_is_refused(team, grpo_yaml, priority):
    before = _stored()
    with pytest.raises(ValidationFailed, match="priority"):
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml, priority=priority)
    assert _stored() == before


def test_duplicate_project_slug_is_refused(team):
    from forgeboard.accounts.services import project_create

    with pytest.raises(ValidationFailed, match="already exists") as caught:
        project_create(actor=team.outsider, slug="alpha", name="Again")
    assert caught.value.problems[0].field == "slug"
    with pytest.raises(ValidationFailed) as caught:
        project_create(actor=team.outsider, slug="Not A Slug", name="x")
    assert caught.value.problems[0].field == "slug"
