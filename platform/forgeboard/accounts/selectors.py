from __future__ import annotations

from django.db.models import QuerySet

from forgeboard.accounts.models import ApiToken, Membership, Project, Role, User
from forgeboard.accounts.permissions import Actor, project_role, require_project_role
from forgeboard.errors import NotFound, ValidationFailed, is_db_id, is_db_text


def projects_for_user(*, user: User) -> QuerySet[Project]:
    if user.is_superuser:
        return Project.objects.all()
    return Project.objects.filter(memberships__user=user).distinct()


def project_get(*, actor: Actor, slug: str) -> Project:
    """The project if the actor may see it; outsiders get the same answer as for a missing project."""
    project = Project.objects.filter(slug=slug).first() if is_db_text(slug) else None
    if project is None or project_role(actor=actor, project=project) is None:
        raise NotFound(f"no project {slug!r}")
    return project


def member_candidate(*, actor: Actor, project: Project, username: str) -> User:
    """The active user an owner names to add, re-role or remove. Only an owner may look: anyone else is refused before
    the name is looked up, so they cannot learn which accounts exist."""
    require_project_role(actor=actor, project=project, minimum=Role.OWNER, action="changing members")
    user = User.objects.filter(username=username, is_active=True).first() if is_db_text(username) else None
    if user is None:
        raise ValidationFailed.on("username", f"no active user named {username!r}")
    return user


def memberships_of(*, project: Project) -> QuerySet[Membership]:
    return Membership.objects.filter(project=project).select_related("user").order_by("user__username")


def projects_where_user_may_create_tokens(*, user: User) -> QuerySet[Project]:
    if user.is_superuser:
        return Project.objects.all()
    return Project.objects.filter(
        memberships__user=user, memberships__role__in=[Role.MEMBER, Role.OWNER]).distinct()


def api_tokens_for_project(*, actor: Actor, project: Project) -> QuerySet[ApiToken]:
    """A project's tokens (never their secrets) for anyone who may see the project."""
    project_get(actor=actor, slug=project.slug)
    return ApiToken.objects.filter(project=project).select_related("project", "created_by").order_by("-created_at", "-pk")


def api_tokens_for_user(*, user: User) -> QuerySet[ApiToken]:
    """The tokens of every project the user belongs to, newest first."""
    return (ApiToken.objects.filter(project__in=projects_for_user(user=user))
            .select_related("project", "created_by").order_by("project__slug", "-created_at", "-pk"))


def api_token_get(*, actor: Actor, token_id: int) -> ApiToken:
    """The token if the actor may see its project; else the same answer as for a missing token."""
    token = ApiToken.objects.select_related("project", "created_by").filter(pk=token_id).first() \
        if is_db_id(token_id) else None
    if token is None or project_role(actor=actor, project=token.project) is None:
        raise NotFound(f"no API token {token_id}")
    return token
