"""Registering and removing artifacts: platform operators only, paths checked against the artifact roots, audited."""

from __future__ import annotations

import re
from pathlib import Path

from django.db import IntegrityError, transaction

from forgeboard.accounts.models import Project
from forgeboard.accounts.permissions import Actor, actor_user, require_operator
from forgeboard.artifacts.models import Artifact, ArtifactKind
from forgeboard.artifacts.resolver import path_problem
from forgeboard.audit.services import audit_record
from forgeboard.errors import AlreadyExists, ValidationFailed, clean_text
from workers.engine.config import ARTIFACT_NAME_PATTERN

MAX_PATH_LENGTH = 4096
MAX_DESCRIPTION_LENGTH = 10_000
_NAME = re.compile(rf"^{ARTIFACT_NAME_PATTERN}$")


def _clean_name(name: object) -> str:
    name = clean_text(field="name", value=name, max_length=100)
    if not _NAME.match(name):
        raise ValidationFailed.on("name", "letters, digits, '.', '_' and '-', starting with a letter or digit")
    return name


def _clean_kind(kind: object) -> ArtifactKind:
    if kind not in ArtifactKind.values:
        raise ValidationFailed.on("kind", f"must be one of {', '.join(ArtifactKind.values)}")
    return ArtifactKind(kind)


def _checked_path(*, path: object, kind: ArtifactKind) -> Path:
    path = clean_text(field="path", value=path, max_length=MAX_PATH_LENGTH)
    real, problem = path_problem(path)
    if problem:
        raise ValidationFailed.on("path", problem)
    assert real is not None
    if kind == ArtifactKind.MODEL and not (real / "config.json").is_file():
        raise ValidationFailed.on("path", f"{real} is not a Hugging Face model folder (no config.json)")
    if kind == ArtifactKind.DATASET and not real.is_file():
        raise ValidationFailed.on("path", f"{real} is not a file (a dataset is one JSONL file)")
    return real


def artifact_register(*, actor: Actor, project: Project, name: str, kind: str, path: str,
                      description: str = "") -> Artifact:
    """Register a model folder or JSONL dataset under the artifact roots as `name` in `project`."""
    require_operator(actor=actor, action="registering artifacts")
    name, kind = _clean_name(name), _clean_kind(kind)
    description = clean_text(field="description", value=description, max_length=MAX_DESCRIPTION_LENGTH, required=False)
    real = _checked_path(path=path, kind=kind)
    try:
        with transaction.atomic():
            artifact = Artifact.objects.create(project=project, name=name, kind=kind, path=str(real),
                                               description=description, created_by=actor_user(actor))
            audit_record(actor=actor, action="artifact.register", target=artifact, project=project,
                         payload={"name": name, "kind": kind, "path": str(real)})
    except IntegrityError:
        raise AlreadyExists.on("name", f"an artifact named {name!r} already exists in {project.slug}") from None
    return artifact


def artifact_delete(*, actor: Actor, artifact: Artifact) -> None:
    """Remove the name (the files stay); runs already launched keep the path they resolved."""
    require_operator(actor=actor, action="removing artifacts")
    with transaction.atomic():
        audit_record(actor=actor, action="artifact.delete", target=artifact, project=artifact.project,
                     payload={"name": artifact.name, "kind": artifact.kind, "path": artifact.path})
        artifact.delete()
