"""/api/v1/projects/{slug}/artifacts: list a project's artifacts (members), register and remove them (operators)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from django.http import HttpRequest
from ninja import Router, Schema, Status
from pydantic import Field

from forgeboard.accounts.selectors import project_get
from forgeboard.api.auth import USER_AUTH, actor_of, require_write_scope
from forgeboard.api.schemas import BODY_ERRORS, ERRORS, text
from forgeboard.artifacts.models import Artifact
from forgeboard.artifacts.selectors import artifact_named, artifacts_for_project
from forgeboard.artifacts.services import MAX_DESCRIPTION_LENGTH, MAX_PATH_LENGTH, artifact_delete, artifact_register
from forgeboard.errors import NotFound
from workers.engine.config import ARTIFACT_NAME_PATTERN

router = Router(auth=USER_AUTH, tags=["artifacts"])


class ArtifactIn(Schema):
    name: text(min_length=1, max_length=100, pattern=rf"^{ARTIFACT_NAME_PATTERN}$")
    kind: Literal["model", "dataset"]
    path: text(min_length=1, max_length=MAX_PATH_LENGTH, pattern=r"^/") = Field(
        description="absolute, inside FORGEBOARD_ARTIFACT_ROOTS: a Hugging Face folder (model) or a JSONL file (dataset)")
    description: text(max_length=MAX_DESCRIPTION_LENGTH) = ""


class ArtifactOut(Schema):
    name: str
    kind: str
    path: str = Field(description="resolved: no symlinks, no ..")
    description: str
    reference: str = Field(description="how a config of another run names it: <project>/<name>")
    created_by: str | None
    created_at: datetime

    @staticmethod
    def resolve_reference(obj: Artifact) -> str:
        return f"{obj.project.slug}/{obj.name}"

    @staticmethod
    def resolve_created_by(obj: Artifact) -> str | None:
        return obj.created_by.username if obj.created_by else None


@router.get("/projects/{slug}/artifacts", response={200: list[ArtifactOut], **ERRORS})
def list_artifacts(request: HttpRequest, slug: str):  # noqa: ANN201
    """The project's registered models and datasets, by name."""
    return list(artifacts_for_project(project=project_get(actor=actor_of(request), slug=slug)).select_related("project"))


@router.post("/projects/{slug}/artifacts", response={201: ArtifactOut, **BODY_ERRORS})
def register_artifact(request: HttpRequest, slug: str, body: ArtifactIn):  # noqa: ANN201
    """Register a model folder or JSONL dataset inside the artifact roots under a name (platform operators)."""
    require_write_scope(request)
    project = project_get(actor=actor_of(request), slug=slug)
    artifact = artifact_register(actor=actor_of(request), project=project, name=body.name, kind=body.kind,
                                 path=body.path, description=body.description)
    return Status(201, artifact)


@router.delete("/projects/{slug}/artifacts/{name}", response={204: None, **ERRORS})
def delete_artifact(request: HttpRequest, slug: str, name: str):  # noqa: ANN201
    """Remove an artifact's name (its files stay; runs already launched keep their paths)."""
    require_write_scope(request)
    project = project_get(actor=actor_of(request), slug=slug)
    artifact = artifact_named(project=project, name=name)
    if artifact is None:
        raise NotFound(f"no artifact {name[:100]!r} in project {project.slug}")
    artifact_delete(actor=actor_of(request), artifact=artifact)
    return Status(204, None)
