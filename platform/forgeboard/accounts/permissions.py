"""Who may do what. Every write service calls one of these before it acts."""

from __future__ import annotations

from typing import TypeAlias

from django.utils import timezone

from forgeboard.accounts.models import ApiToken, Membership, Project, Role, TokenScope, User
from forgeboard.errors import PermissionDenied

Actor: TypeAlias = User | ApiToken


def project_role(*, actor: Actor, project: Project) -> Role | None:
    """The actor's role in the project. An API token acts as a member (write) or viewer (read) of its own project,
    and never beyond its creator's role there now: a creator removed or deactivated takes their tokens' access with
    them, and one made a viewer leaves a write token read-only. A revoked or expired token has no role: work it queued
    (an export, the run started after it) is refused when it runs."""
    if isinstance(actor, ApiToken):
        if actor.project_id != project.pk or actor.revoked_at is not None or actor.created_by is None:
            return None
        if actor.expires_at is not None and actor.expires_at <= timezone.now():
            return None
        creator = project_role(actor=actor.created_by, project=project)
        granted = Role.MEMBER if actor.scope == TokenScope.WRITE else Role.VIEWER
        return None if creator is None else min(granted, creator, key=lambda role: role.rank)
    if not actor.is_active:
        return None
    if actor.is_superuser:
        return Role.OWNER
    role = Membership.objects.filter(project=project, user=actor).values_list("role", flat=True).first()
    return Role(role) if role else None


def require_project_role(*, actor: Actor, project: Project, minimum: Role, action: str) -> Role:
    role = project_role(actor=actor, project=project)
    if role is None:
        # Outsiders learn nothing about the project beyond the refusal.
        raise PermissionDenied(f"you are not a member of project {project.slug!r}")
    if role.rank < minimum.rank:
        raise PermissionDenied(f"{action} needs the {minimum.label.lower()} role; you are a {role.label.lower()}")
    return role


def require_operator(*, actor: Actor, action: str) -> None:
    if isinstance(actor, ApiToken):
        raise PermissionDenied(f"{action} needs a platform operator's session: an API token acts only in its project")
    if not (actor.is_active and (actor.is_operator or actor.is_superuser)):
        raise PermissionDenied(f"{action} needs the platform operator role")


def actor_user(actor: Actor) -> User | None:
    return actor.created_by if isinstance(actor, ApiToken) else actor


def actor_label(actor: Actor) -> str:
    return f"token:{actor.prefix}" if isinstance(actor, ApiToken) else f"user:{actor.username}"

