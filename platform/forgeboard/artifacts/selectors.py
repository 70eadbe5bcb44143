from __future__ import annotations

import re

from django.db.models import QuerySet

from forgeboard.accounts.models import Project
from forgeboard.artifacts.models import Artifact
from workers.engine.config import ARTIFACT_NAME_PATTERN

NAME = re.compile(rf"^{ARTIFACT_NAME_PATTERN}$")


def artifacts_for_project(*, project: Project) -> QuerySet[Artifact]:
    """The project's artifacts by name; the caller has checked the actor may see the project."""
    return Artifact.objects.filter(project=project).select_related("created_by").order_by("name")


def artifact_named(*, project: Project, name: str) -> Artifact | None:
    """The project's artifact of that name; None also for a name no artifact can have (NUL, too long)."""
    if not isinstance(name, str) or not NAME.match(name):
        return None
    return Artifact.objects.filter(project=project, name=name).first()
