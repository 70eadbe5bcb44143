"""The one place where a run config's paths and references become absolute paths, for one project.

`model.path` / `model.artifact`, `data.path` / `data.artifact` and `checkpoint.resume_from` each resolve to
one absolute path (symlinks and `..` resolved) or a field-level problem:
- a raw path must lie inside a root of FORGEBOARD_ARTIFACT_ROOTS and never in the run data folder
  (settings.DATA_DIR/runs, where every run's folder is); the rest of DATA_DIR only through a root inside it;
- `<name>` or `<own-slug>/<name>`: an artifact registered in the run's project, of the field's kind;
  another project's slug is refused before any lookup;
- `run:<id>@step:<n>`: a run of the same project; its export (model.artifact) or its checkpoint (resume_from).
The engine's preflight checks the resolved paths again on the host that runs it (FORGEBOARD_ALLOWED_PATHS).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from django.conf import settings

from forgeboard.accounts.models import Project
from forgeboard.artifacts.models import Artifact, ArtifactKind
from forgeboard.errors import FieldProblem, ValidationFailed
from workers.engine.checkpoint_folders import A_RUN
from workers.engine.config import ARTIFACT_REFERENCE, RUN_REFERENCE, RunConfig

# the engine's field -> (the reference field beside it, the artifact kind it takes)
RESOLVED_FIELDS = {"model.path": ("model.artifact", ArtifactKind.MODEL), "data.path": ("data.artifact", ArtifactKind.DATASET),
                   "checkpoint.resume_from": ("checkpoint.resume_from", None)}
RUN_FOLDER_FIELDS = ("checkpoint.folder", "telemetry.jsonl_path")
KNOWN_SHOWN = 10  # the artifact names a "no artifact" problem lists


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(path))


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def artifact_roots() -> list[Path]:
    return [_real(root) for root in settings.ARTIFACT_ROOTS]


def runs_folder() -> Path:
    """Where every run's folder is (workers/launch/local.py run_dir): no raw path reaches it."""
    return _real(Path(settings.DATA_DIR) / "runs")


def _roots_text() -> str:
    return ", ".join(str(root) for root in artifact_roots()) or "none configured"


def path_problem(path: str) -> tuple[Path | None, str | None]:
    """(the resolved path, None) for a raw path the platform may hand an engine, else (None, the reason)."""
    if "\x00" in path:
        return None, "must not contain NUL"
    if not PurePosixPath(path).is_absolute():
        return None, "must be an absolute path (or use an artifact reference)"
    real = _real(path)
    shown = str(real) if str(real) == os.path.normpath(path) else f"{path} (resolved: {real})"
    if _inside(real, runs_folder()):
        return None, (f"{shown} is in the platform's run folders: reach a run's checkpoints and exports with "
                      "run:<run id>@step:<step>")
    roots = [root for root in artifact_roots() if _inside(real, root)]
    data_dir = _real(settings.DATA_DIR)
    if _inside(real, data_dir):
        roots = [root for root in roots if _inside(root, data_dir)]  # only a root inside the data folder reaches it
        if not roots:
            return None, f"{shown} is in the platform's data folder, outside the artifact roots ({_roots_text()})"
    if not roots:
        return None, f"{shown} is outside the artifact roots ({_roots_text()})"
    return real, None


def _registered(*, reference: str, kind: str, project: Project | None) -> tuple[Path | None, str | None]:
    match = ARTIFACT_REFERENCE.match(reference)
    if match is None:
        return None, f"{reference[:60]!r} is not an artifact reference"
    if project is None:
        return None, "an artifact reference needs the project it is resolved in"
    slug, name = match.group("project"), match.group("name")
    if slug is not None and slug != project.slug:
        return None, (f"refers to project {slug!r}: a run in {project.slug!r} uses only its own project's artifacts "
                      f"(register it in {project.slug!r})")
    artifact = Artifact.objects.filter(project=project, name=name).first()
    if artifact is None:
        return None, f"no artifact {name!r} in project {project.slug}{_known_artifacts(project=project, name=name, kind=kind)}"
    if artifact.kind != kind:
        return None, f"artifact {name!r} is a {artifact.kind}, not a {kind}"
    real, problem = path_problem(artifact.path)  # the roots (or a symlink) may have changed since it was registered
    if problem:
        return None, f"artifact {name!r}: {problem}"
    return real, None


def _known_artifacts(*, project: Project, name: str, kind: str) -> str:
    """What a mistyped name could have been: the closest of the project's artifacts of that kind and their names."""
    names = list(Artifact.objects.filter(project=project, kind=kind).order_by("name").values_list("name", flat=True))
    if not names:
        return ""
    close = difflib.get_close_matches(name, names, n=1)
    shown = ", ".join(names[:KNOWN_SHOWN]) + (f" and {len(names) - KNOWN_SHOWN} more" if len(names) > KNOWN_SHOWN else "")
    return (f": did you mean {close[0]!r}? Its {kind}s: " if close else f"; its {kind}s: ") + shown


def _of_run(*, reference: str, field: str, project: Project | None, recipe: str) -> tuple[Path | None, str | None]:
    from forgeboard.runs.models import Run
    from forgeboard.runs.folders import run_dir

    match = RUN_REFERENCE.match(reference)
    assert match is not None
    run_id, step = int(match.group("run")), int(match.group("step"))
    run = (Run.objects.filter(pk=run_id, experiment__project=project).select_related("config").first()
           if project is not None else None)
    if run is None:
        return None, f"no run {run_id} in project {project.slug}" if project else "a run reference needs its project"
    if field == "checkpoint.resume_from" and run.config.recipe != recipe:
        return None, (f"run {run_id} is {A_RUN[run.config.recipe]}, and {A_RUN[recipe]} resumes only its own "
                      f"recipe's checkpoints; to start from its weights, use model.artifact: run:{run_id}@step:{step}")
    folder = _real(run_dir(run))
    target = (folder / "exports" / f"step_{step}" if field == "model.path"
              else folder / "checkpoints" / f"step_{step:06d}")
    real = _real(target)
    if not _inside(real, folder):
        return None, f"step {step} of run {run_id} leads outside the run's folder"
    return real, None


def _get(config: RunConfig, dotted: str) -> str | None:
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def resolve_run_paths(*, config: RunConfig, project: Project | None) -> dict[str, str]:
    """{engine field: absolute path} for the config's paths and references, or ValidationFailed with every problem.

    Without a project (a config checked outside any project) references cannot resolve and say so.
    """
    resolved: dict[str, str] = {}
    problems: list[FieldProblem] = []
    for field, (reference_field, kind) in RESOLVED_FIELDS.items():
        raw = _get(config, field)
        reference = _get(config, reference_field) if reference_field != field else None
        if field == "data.path" and config.data.source != "jsonl":
            continue
        if reference is not None:
            where = reference_field
            path, problem = (_of_run(reference=reference, field=field, project=project, recipe=config.recipe)
                             if RUN_REFERENCE.match(reference)
                             else _registered(reference=reference, kind=kind, project=project))
        elif raw is None:
            continue
        elif RUN_REFERENCE.match(raw):
            where = field
            path, problem = _of_run(reference=raw, field=field, project=project, recipe=config.recipe)
        else:
            where = field
            path, problem = path_problem(raw)
        if problem:
            problems.append(FieldProblem(f"config.{where}", problem))
        else:
            resolved[field] = str(path)
    for field in RUN_FOLDER_FIELDS:
        value = _get(config, field)
        if value is not None and (PurePosixPath(value).is_absolute() or ".." in PurePosixPath(value).parts):
            problems.append(FieldProblem(f"config.{field}", (
                "is kept inside the run's own folder on the platform (its checkpoints and metrics go there, whatever "
                "this says, so that a restart resumes from them): give a relative path without '..', or leave it out")))
    if problems:
        raise ValidationFailed("invalid config: " + "; ".join(f"{p.field}: {p.message}" for p in problems),
                               problems=problems)
    return resolved


def engine_allowed_paths(*, artifact_paths: Iterable[str], run_folder: str) -> list[str]:
    """What a launched engine's preflight accepts (FORGEBOARD_ALLOWED_PATHS): this run's folder, its resolved
    paths, and the roots that do not reach the data folder (a root that does is left to the resolved paths)."""
    data_dir = _real(settings.DATA_DIR)
    roots = [str(root) for root in artifact_roots() if not _inside(data_dir, root)]
    return list(dict.fromkeys([run_folder, *artifact_paths, *roots]))
