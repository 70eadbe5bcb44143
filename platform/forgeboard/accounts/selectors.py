from __future__ import annotations

from django.db.models import QuerySet

from forgeboard.accounts.models import Membership, Project, User
from forgeboard.accounts.permissions import Actor, project_role
from forgeboard.errors import NotFound


def projects_for_user(*, user: User) -> QuerySet[Project]:
    if user.is_superuser:
        return Project.objects.all()
    return Project.objects.filter(memberships__user=user).distinct()


def project_get(*, actor: Actor, slug: str) -> Project:
    """The project if the actor may see it; outsiders get the same answer as for a missing project."""
    project = Project.objects.filter(slug=slug).first()
    if project is None or project_role(actor=actor, project=project) is None:
        raise NotFound(f"no project {slug!r}")
    return project


def memberships_of(*, project: Project) -> QuerySet[Membership]:
    return Membership.objects.filter(project=project).select_related("user").order_by("user__username")
