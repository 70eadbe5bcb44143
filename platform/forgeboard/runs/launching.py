"""The launch form's service: every field of a launch checked at once, the config validated once (its problems
located in the YAML text and overrides), then the experiment created if new and the run launched, or started
from a checkpoint, all or nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from django.db import transaction

from forgeboard.accounts.models import Project, Role
from forgeboard.accounts.permissions import Actor, require_project_role
from forgeboard.cluster.selectors import hosts_with_devices
from forgeboard.errors import FieldProblem, ValidationFailed
from forgeboard.experiments.config_problems import ConfigProblem, config_check
from forgeboard.experiments.models import Experiment, Recipe
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.checkpoints import ExportStatus, run_launch_from_checkpoint_request
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from workers.engine.config import RECIPE_ROLES


@dataclass(frozen=True)
class NewExperiment:
    """An experiment to create with the launch."""

    name: str
    recipe: str


class LaunchRefused(ValidationFailed):
    """Every problem with a launch: `problems` at its fields (experiment, name, recipe, priority, hosts), and
    `config_problems` at the config's fields, located."""

    def __init__(self, *, problems: Sequence[FieldProblem], config_problems: Sequence[ConfigProblem]):
        super().__init__("invalid launch: " + "; ".join(
            [f"{p.field}: {p.message}" for p in problems] + [str(p) for p in config_problems]), problems=problems)
        self.config_problems = list(config_problems)


def placement_overrides(*, recipe: str, hosts: Sequence[str]) -> list[str]:
    """Overrides that pin every role the recipe starts to these hosts (nothing when no host is chosen)."""
    if not hosts:
        return []
    pinned = json.dumps(list(hosts), ensure_ascii=False)  # YAML would read "\ud83d\ude42" as two lone surrogates
    return [f"placement.{role}.hosts={pinned}" for role in RECIPE_ROLES.get(recipe, ("trainer",))]


def run_launch_submit(*, actor: Actor, project: Project, experiment: Experiment | None,
                      new_experiment: NewExperiment | None, config_yaml: str, overrides: Sequence[str],
                      hosts: Sequence[str], priority: int | None, parent: Run | None = None,
                      checkpoint: int | None = None) -> Run | ExportStatus:
    """Launch a run of `experiment` (or of `new_experiment`, created with it) in `project`, pinned to `hosts` (inventory
    hosts; none: anywhere). From a checkpoint (`parent` and `checkpoint`) the run starts from its weights, exported
    first off the request if they are not yet: then the export's status is returned and the run starts when it is
    done. LaunchRefused names every problem before anything is stored."""
    require_project_role(actor=actor, project=project, minimum=Role.MEMBER, action="launching runs")
    problems: list[FieldProblem] = []
    if new_experiment is not None:
        if new_experiment.recipe not in Recipe.values:
            problems.append(FieldProblem("recipe", f"choose one of {', '.join(Recipe.values)}"))
        if not new_experiment.name.strip():
            problems.append(FieldProblem("name", "name the new experiment"))
        recipe = new_experiment.recipe
    elif experiment is None or experiment.project_id != project.pk:
        problems.append(FieldProblem("experiment", "choose an experiment of this project, or create one"))
        recipe = ""
    else:
        recipe = experiment.recipe
    if priority is None or not -100 <= priority <= 100:
        problems.append(FieldProblem("priority", "must be a whole number from -100 to 100"))
    known = set(hosts_with_devices().values_list("hostname", flat=True))
    unknown = [h for h in hosts if h not in known]
    if unknown:
        problems.append(FieldProblem("hosts", f"not in the cluster inventory: {', '.join(unknown)}"))
    overrides = [*overrides, *placement_overrides(recipe=recipe, hosts=hosts)]
    check = config_check(yaml_text=config_yaml, overrides=overrides, recipe=recipe, project=project) \
        if recipe in Recipe.values else None
    if problems or (check is not None and check.problems):
        raise LaunchRefused(problems=problems, config_problems=check.problems if check is not None else [])
    assert check is not None and check.config is not None and priority is not None
    with transaction.atomic():
        if new_experiment is not None:
            experiment = experiment_create(actor=actor, project=project, name=new_experiment.name, recipe=recipe)
        assert experiment is not None
        if parent is not None and checkpoint is not None:
            return run_launch_from_checkpoint_request(actor=actor, run=parent, step=checkpoint, experiment=experiment,
                                                      config_yaml=config_yaml, overrides=overrides, priority=priority)
        return run_launch(actor=actor, experiment=experiment, config_yaml=config_yaml, overrides=overrides,
                          priority=priority, parent=parent, validated=(check.config, check.artifact_paths))
