from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db.models import Q, QuerySet

from forgeboard.accounts.models import Project
from forgeboard.accounts.permissions import Actor, project_role
from forgeboard.errors import NotFound, ValidationFailed, is_db_id
from forgeboard.runs.models import OPEN_COMMAND_STATES, Command, Run


def runs_for_project(*, project: Project, state: str | None = None) -> QuerySet[Run]:
    runs = Run.objects.filter(experiment__project=project).select_related("experiment", "launched_by")
    return runs.filter(state=state) if state else runs


@dataclass(frozen=True)
class RunFilters:
    """What the runs list is narrowed to; empty fields do not filter."""

    text: str = ""
    state: str = ""
    experiment_id: int | None = None
    tag: str = ""
    launched_by: str = ""


def runs_search(*, project: Project, filters: RunFilters) -> QuerySet[Run]:
    """The project's runs, newest first, narrowed by state, experiment, tag, who launched them and free text.

    Free text matches the experiment's name, a tag, the launcher's username, or `#N` (run number).
    """
    runs = runs_for_project(project=project, state=filters.state or None)
    if filters.experiment_id is not None:
        runs = runs.filter(experiment_id=filters.experiment_id)
    if filters.tag:
        runs = runs.filter(experiment__tags__icontains=f'"{filters.tag}"')
    if filters.launched_by:
        runs = runs.filter(launched_by__username=filters.launched_by)
    text = filters.text.strip()
    if text:
        match = (Q(experiment__name__icontains=text) | Q(experiment__tags__icontains=text)
                 | Q(launched_by__username__icontains=text))
        number = text.removeprefix("#")
        if number.isdigit() and len(number) < 10:
            match |= Q(number=int(number))
        runs = runs.filter(match)
    return runs


def run_get(*, actor: Actor, run_id: int) -> Run:
    run = Run.objects.select_related("experiment__project", "config").filter(pk=run_id).first() if is_db_id(run_id) else None
    if run is None or project_role(actor=actor, project=run.experiment.project) is None:
        raise NotFound(f"no run {run_id}")
    return run


def commands_pending(*, run: Run, after_id: int = 0) -> QuerySet[Command]:
    """Commands the controller has not finished: pending, or delivered without a result (at-least-once).

    An expired command (its run ended or was lost, `run_transition`) is never handed out again.
    """
    return Command.objects.filter(run=run, state__in=OPEN_COMMAND_STATES, pk__gt=after_id).order_by("pk")


COMPARE_MIN_RUNS = 2
COMPARE_MAX_RUNS = 10


def runs_for_compare(*, actor: Actor, project: Project, run_ids: Sequence[str]) -> list[Run]:
    """The runs a compare URL names (`?runs=3&runs=5` or `?runs=3,5`), in the order given, repeats dropped.

    ValidationFailed on the field `runs` for text that is not a run id, fewer than 2 or more than 10 runs,
    or a run of another project the actor can see; NotFound for a run that does not exist or that the actor
    may not see (the same answer, so ids of other teams' runs reveal nothing).
    """
    pieces = [piece.strip() for value in run_ids for piece in value.split(",") if piece.strip()]
    ids: list[int] = []
    for piece in pieces:
        if not (piece.isascii() and piece.isdigit() and len(piece) < 20) or not is_db_id(int(piece)):
            raise ValidationFailed.on("runs", f"{piece[:20]!r} is not a run id; give run ids like ?runs=3,5")
        if int(piece) not in ids:
            ids.append(int(piece))
        if len(ids) > COMPARE_MAX_RUNS:
            break
    if len(ids) < COMPARE_MIN_RUNS:
        raise ValidationFailed.on("runs", f"choose at least {COMPARE_MIN_RUNS} runs to compare, got {len(ids)}")
    if len(ids) > COMPARE_MAX_RUNS:
        raise ValidationFailed.on("runs", f"compare at most {COMPARE_MAX_RUNS} runs at once")
    found = Run.objects.select_related("experiment__project", "config", "launched_by").in_bulk(ids)
    runs = []
    for run_id in ids:
        run = found.get(run_id)
        if run is None or project_role(actor=actor, project=run.experiment.project) is None:
            raise NotFound(f"no run {run_id} in project {project.slug!r}")
        if run.experiment.project_id != project.pk:
            raise ValidationFailed.on(
                "runs", f"run {run_id} belongs to project {run.experiment.project.slug!r}, not {project.slug!r}"
            )
        runs.append(run)
    return runs


def config_flatten(*, config: Mapping[str, Any]) -> dict[str, Any]:
    """A nested config as dotted keys in document order: `trainer.optimizer.lr`, `reward.functions[0]`.

    Empty mappings and lists stay as values, so a key that is present but empty is not lost.
    """
    flat: dict[str, Any] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, Mapping) and value:
            for name, item in value.items():
                walk(item, f"{key}.{name}" if key else str(name))
        elif isinstance(value, list) and value:
            for index, item in enumerate(value):
                walk(item, f"{key}[{index}]")
        else:
            flat[key] = value

    walk(config, "")
    return flat


@dataclass(frozen=True)
class ConfigDiffRow:
    key: str
    values: list[str | None]  # one per run, as shown; None where the run's config lacks the key
    differs: bool


def config_value_text(value: Any) -> str:
    """How a config value reads in a table: text as it is, everything else as JSON (true, null, 0.0001, [])."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def config_diff(*, runs: Sequence[Run]) -> list[ConfigDiffRow]:
    """The runs' validated configs side by side, one row per dotted key (the union, sorted: sections group, and
    the order does not depend on how the database stored the JSON).

    A row differs when any two runs hold different values, or the key is missing from some of them
    (values are compared as JSON, so the text "1" and the number 1 differ).
    """
    flats = [config_flatten(config=run.config.parsed) for run in runs]
    keys = sorted({key for flat in flats for key in flat})
    rows = []
    for key in keys:
        canonical = {json.dumps(flat[key], sort_keys=True) if key in flat else "\0missing" for flat in flats}
        values = [config_value_text(flat[key]) if key in flat else None for flat in flats]
        rows.append(ConfigDiffRow(key=key, values=values, differs=len(canonical) > 1))
    return rows
