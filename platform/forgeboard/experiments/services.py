"""Experiments and config snapshots. Configs are validated by the engine's own schema."""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence

from django.db import IntegrityError, transaction

from forgeboard.accounts.models import Project, Role
from forgeboard.accounts.permissions import Actor, actor_user, require_project_role
from forgeboard.audit.services import audit_record
from forgeboard.errors import AlreadyExists, FieldProblem, ValidationFailed, clean_text
from forgeboard.experiments.models import ConfigSnapshot, Experiment, Recipe
from workers.engine.config import (
    ConfigError,
    FieldError,
    RunConfig,
    config_mapping,
    parse_config_mapping,
)
from workers.engine.wire_limits import unstorable_at, unstorable_reason

MAX_TAGS = 20
MAX_TAG_LENGTH = 50
MAX_OVERRIDES = 100


def _clean_recipe(recipe: str) -> Recipe:
    if recipe not in Recipe.values:
        raise ValidationFailed.on("recipe", f"unknown recipe {recipe!r}: choose one of {', '.join(Recipe.values)}")
    return Recipe(recipe)


def _clean_tags(tags: Sequence[str]) -> list[str]:
    if isinstance(tags, str) or not all(isinstance(tag, str) for tag in tags):
        raise ValidationFailed.on("tags", "must be a list of text tags")
    unstorable = next((reason for tag in tags if (reason := unstorable_reason(tag))), None)
    if unstorable:
        raise ValidationFailed.on("tags", f"a tag {unstorable}")
    cleaned = sorted({tag.strip() for tag in tags if tag.strip()})
    if len(cleaned) > MAX_TAGS:
        raise ValidationFailed.on("tags", f"at most {MAX_TAGS} tags, got {len(cleaned)}")
    too_long = [tag for tag in cleaned if len(tag) > MAX_TAG_LENGTH]
    if too_long:
        raise ValidationFailed.on("tags", f"tag {too_long[0][:20]!r}… is over {MAX_TAG_LENGTH} characters")
    return cleaned


def _refuse_unstorable(*, yaml_text: str, overrides: Sequence[str]) -> None:
    """A config the database could not store (NUL, lone surrogates), refused at its field."""
    if reason := unstorable_reason(yaml_text):
        raise ValidationFailed.on("config", reason)
    for index, override in enumerate(overrides):
        if not isinstance(override, str):
            raise ValidationFailed.on(f"overrides.{index}", "must be text")
        if reason := unstorable_reason(override):
            raise ValidationFailed.on(f"overrides.{index}", reason)


def _refuse_unstorable_values(data: dict[str, object]) -> None:
    """What the YAML and overrides parse to, refused at its config path where it cannot be stored (an escape
    such as "\\0" or "\\uD800"); before the schema, whose messages may quote it."""
    if found := unstorable_at(data):
        path, reason = found
        raise ValidationFailed.on(f"config.{path}" if path else "config", reason)


def experiment_create(
    *, actor: Actor, project: Project, name: str, recipe: str, description: str = "", tags: Sequence[str] = ()
) -> Experiment:
    require_project_role(actor=actor, project=project, minimum=Role.MEMBER, action="creating experiments")
    name, recipe, tags = clean_text(field="name", value=name, max_length=200), _clean_recipe(recipe), _clean_tags(tags)
    description = clean_text(field="description", value=description, max_length=10_000, required=False)
    try:
        with transaction.atomic():
            experiment = Experiment.objects.create(
                project=project, name=name, recipe=recipe, description=description, tags=tags,
                created_by=actor_user(actor),
            )
            audit_record(actor=actor, action="experiment.create", target=experiment, project=project,
                         payload={"name": name, "recipe": recipe})
    except IntegrityError:
        raise AlreadyExists.on("name", f"an experiment named {name!r} already exists in {project.slug}") from None
    return experiment


def experiment_update(
    *, actor: Actor, experiment: Experiment, description: str | None = None, tags: Sequence[str] | None = None
) -> Experiment:
    require_project_role(actor=actor, project=experiment.project, minimum=Role.MEMBER, action="editing experiments")
    changes: dict[str, object] = {}
    if description is not None:
        changes["description"] = clean_text(field="description", value=description, max_length=10_000,
                                            required=False)
    if tags is not None:
        changes["tags"] = _clean_tags(tags)
    for field, value in changes.items():
        setattr(experiment, field, value)
    with transaction.atomic():
        experiment.save(update_fields=list(changes))
        audit_record(actor=actor, action="experiment.update", target=experiment, project=experiment.project,
                     payload=changes)
    return experiment


def validate_run_config(*, yaml_text: str, overrides: Sequence[str] = (), recipe: str,
                        project: Project | None = None) -> RunConfig:
    """The engine's validation, the experiment's recipe, the config's paths and artifact references resolved
    in `project` (artifacts/resolver.py), and whether the cluster's inventory could ever run it (its GPUs, the hosts
    it names: runs/demand.py); field-level ValidationFailed on any problem."""
    return validate_and_resolve(yaml_text=yaml_text, overrides=overrides, recipe=recipe, project=project)[0]


def validate_and_resolve(*, yaml_text: str, overrides: Sequence[str] = (), recipe: str,
                         project: Project | None) -> tuple[RunConfig, dict[str, str]]:
    """`validate_run_config`, and the resolved paths: {engine field ("model.path"): absolute path}."""
    from forgeboard.artifacts.resolver import resolve_run_paths
    from forgeboard.runs.demand import config_schedule_problems

    config = _engine_validated(yaml_text=yaml_text, overrides=overrides, recipe=recipe)
    problems: list[FieldProblem] = []
    try:
        paths = resolve_run_paths(config=config, project=project)
    except ValidationFailed as exc:
        problems.extend(exc.problems)
    else:
        problems.extend(_data_problems(config=config, paths=paths))
    problems.extend(config_schedule_problems(config=config, project=project))
    if problems:
        raise ValidationFailed("invalid config: " + "; ".join(f"{p.field}: {p.message}" for p in problems),
                               problems=problems)
    return config, paths


# A JSONL dataset up to this size is read at validation (the launch form checks as one types); a larger one is
# checked by the engine's preflight, still before its model loads.
DATA_CHECK_MAX_BYTES = 16 * 2**20
DATA_CHECKS_KEPT = 32  # the verdicts on the last datasets read, by file version and data settings


class _DataChecks:
    """The verdicts on recently read datasets: the form validates on every pause in typing, and a file is read
    again only when it or the run's data settings change."""

    def __init__(self, *, kept: int) -> None:
        self.kept = kept
        self.verdicts: OrderedDict[tuple, list[FieldProblem]] = OrderedDict()

    def problems(self, *, config: RunConfig, path: str) -> list[FieldProblem]:
        from workers.engine.tasks import data_errors

        try:
            stat = os.stat(path)
        except OSError:
            return []  # the resolver has said what is wrong with the path, or the engine's host holds the file
        if stat.st_size > DATA_CHECK_MAX_BYTES:
            return []
        config = config.model_copy(update={"data": config.data.model_copy(update={"path": path})})
        key = (path, stat.st_mtime_ns, stat.st_size, config.data.model_dump_json(), config.recipe,
               config.reward.needs_answer, config.trainer.seed)
        if key not in self.verdicts:
            self.verdicts[key] = _config_problems(data_errors(config))
            while len(self.verdicts) > self.kept:
                self.verdicts.popitem(last=False)
        self.verdicts.move_to_end(key)
        return self.verdicts[key]


DATA_CHECKS = _DataChecks(kept=DATA_CHECKS_KEPT)


def _config_problems(errors: Sequence[FieldError]) -> list[FieldProblem]:
    return [FieldProblem(f"config.{e.field}" if e.field else "config", e.message) for e in errors]


def _data_problems(*, config: RunConfig, paths: dict[str, str]) -> list[FieldProblem]:
    """The first row of the run's dataset that it cannot use (line and reason), as the engine's preflight finds it."""
    from workers.engine.tasks import data_errors

    if config.data.source != "jsonl":
        return _config_problems(data_errors(config))
    path = paths.get("data.path") or config.data.path
    return DATA_CHECKS.problems(config=config, path=path) if path else []


def _engine_validated(*, yaml_text: str, overrides: Sequence[str], recipe: str) -> RunConfig:
    """The engine's schema and the experiment's recipe: what a config is wherever it runs."""
    if not isinstance(yaml_text, str):
        raise ValidationFailed.on("config", "must be YAML text")
    if len(overrides) > MAX_OVERRIDES:
        raise ValidationFailed.on("overrides", f"at most {MAX_OVERRIDES} overrides, got {len(overrides)}")
    _refuse_unstorable(yaml_text=yaml_text, overrides=overrides)
    try:
        data = config_mapping(yaml_text, overrides=list(overrides))
        _refuse_unstorable_values(data)
        config = parse_config_mapping(data)
    except ConfigError as exc:
        problems = _config_problems(exc.errors)
        raise ValidationFailed("invalid config: " + "; ".join(str(e) for e in exc.errors), problems=problems) from None
    recipe = Recipe(recipe).value
    if config.recipe != recipe:
        raise ValidationFailed.on(
            "config.recipe", f"is {config.recipe!r} but the experiment's recipe is {recipe!r}"
        )
    return config


def config_snapshot_create(*, yaml_text: str, overrides: Sequence[str] = (), recipe: str,
                           config: RunConfig | None = None) -> ConfigSnapshot:
    """Validate (unless `config` is this text already validated) and store a config; the same text and overrides
    give back the same snapshot, in every project and cluster: the paths a run resolved are the run's
    (Run.artifact_paths), and whether it fits the inventory is the launch's question."""
    if config is None:
        config = _engine_validated(yaml_text=yaml_text, overrides=overrides, recipe=recipe)
    digest = hashlib.sha256(json.dumps([yaml_text, list(overrides)]).encode("utf-8")).hexdigest()
    existing = ConfigSnapshot.objects.filter(content_hash=digest).first()
    if existing is not None:
        return existing
    try:
        with transaction.atomic():
            return ConfigSnapshot.objects.create(
                content_hash=digest, yaml_text=yaml_text, overrides=list(overrides),
                parsed=json.loads(config.model_dump_json()), recipe=recipe,
            )
    except IntegrityError:
        return ConfigSnapshot.objects.get(content_hash=digest)
