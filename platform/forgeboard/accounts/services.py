"""Writes for projects, memberships and API tokens. Each checks permission and leaves an audit entry."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from forgeboard.accounts.models import ApiToken, Membership, Project, Role, TokenScope, User, slug_validator
from forgeboard.accounts.permissions import Actor, project_role, require_project_role
from forgeboard.audit.services import audit_record
from forgeboard.bearer import mint_token, token_matches, token_prefix
from forgeboard.errors import AlreadyExists, Conflict, PermissionDenied, ValidationFailed, clean_text
from forgeboard.telemetry.streams import actor_group, publish_access_withdrawn

TOKEN_LAST_USED_RESOLUTION = timedelta(minutes=1)
MAX_TOKEN_LIFETIME = timedelta(days=3650)


def project_create(*, actor: User, slug: str, name: str, description: str = "") -> Project:
    if not actor.is_active or not actor.is_authenticated:
        raise PermissionDenied("creating a project needs an active account")
    try:
        slug_validator(slug)
    except DjangoValidationError:
        raise ValidationFailed.on("slug", "use lowercase letters, digits and dashes, 1-63 characters") from None
    name = clean_text(field="name", value=name, max_length=200)
    description = clean_text(field="description", value=description, max_length=10_000, required=False)
    try:
        with transaction.atomic():
            project = Project.objects.create(slug=slug, name=name, description=description)
            Membership.objects.create(project=project, user=actor, role=Role.OWNER)
            audit_record(actor=actor, action="project.create", target=project, project=project, payload={"slug": slug})
    except IntegrityError:
        raise AlreadyExists.on("slug", f"a project with slug {slug!r} already exists") from None
    return project


def _owner_count(project: Project) -> int:
    return Membership.objects.filter(project=project, role=Role.OWNER).count()


@transaction.atomic
def membership_set(*, actor: Actor, project: Project, user: User, role: Role | str) -> Membership:
    require_project_role(actor=actor, project=project, minimum=Role.OWNER, action="changing members")
    if role not in Role.values:
        raise ValidationFailed.on("role", f"unknown role {role!r}: choose one of {', '.join(Role.values)}")
    role = Role(role)
    # Lock the project's memberships so two owners demoting each other cannot leave it ownerless.
    list(Membership.objects.select_for_update().filter(project=project))
    membership = Membership.objects.filter(project=project, user=user).first()
    if membership and membership.role == Role.OWNER and role != Role.OWNER and _owner_count(project) == 1:
        raise Conflict("a project needs at least one owner", problems=[])
    if membership is None:
        membership = Membership.objects.create(project=project, user=user, role=role)
    else:
        membership.role = role
        membership.save(update_fields=["role"])
    audit_record(
        actor=actor, action="membership.set", target=membership, project=project,
        payload={"user": user.username, "role": role.value},
    )
    return membership


@transaction.atomic
def membership_remove(*, actor: Actor, project: Project, user: User) -> None:
    require_project_role(actor=actor, project=project, minimum=Role.OWNER, action="removing members")
    list(Membership.objects.select_for_update().filter(project=project))
    membership = Membership.objects.filter(project=project, user=user).first()
    if membership is None:
        raise ValidationFailed.on("user", f"{user.username} is not a member of {project.slug}")
    if membership.role == Role.OWNER and _owner_count(project) == 1:
        raise Conflict("a project needs at least one owner")
    audit_record(actor=actor, action="membership.remove", target=membership, project=project,
                 payload={"user": user.username})
    membership.delete()
    # Their tokens already act for nobody (project_role); revoked, the tokens page says so, and being added back
    # later does not bring them back to life.
    for token in ApiToken.objects.filter(project=project, created_by=user, revoked_at__isnull=True):
        _revoke(actor=actor, token=token, reason=f"{user.username} was removed from the project")
    publish_access_withdrawn(groups=[actor_group(kind="user", pk=user.pk)])


def api_token_create(
    *, actor: User, project: Project, name: str, scope: TokenScope | str, expires_at: datetime | None = None
) -> tuple[ApiToken, str]:
    """Create a token; the plaintext is returned once and never stored."""
    _require_person(actor, "creating API tokens")
    require_project_role(actor=actor, project=project, minimum=Role.MEMBER, action="creating API tokens")
    name = clean_text(field="name", value=name, max_length=100)
    if scope not in TokenScope.values:
        raise ValidationFailed.on("scope", f"unknown scope {scope!r}: choose read or write")
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationFailed.on("expires_at", "must be in the future")
    if expires_at is not None and expires_at > timezone.now() + MAX_TOKEN_LIFETIME:
        raise ValidationFailed.on("expires_at", f"must be within {MAX_TOKEN_LIFETIME.days} days")
    minted = mint_token("fb")
    prefix, raw = minted.prefix, minted.raw
    try:
        with transaction.atomic():
            # A removal stored meanwhile revoked the creator's tokens without this one: it commits first, and refuses.
            Membership.objects.select_for_update().filter(project=project, user=actor).first()
            require_project_role(actor=actor, project=project, minimum=Role.MEMBER, action="creating API tokens")
            token = ApiToken.objects.create(
                project=project, name=name, prefix=prefix, token_hash=minted.token_hash, scope=scope,
                created_by=actor, expires_at=expires_at,
            )
            audit_record(actor=actor, action="api_token.create", target=token, project=project,
                         payload={"name": name, "scope": scope, "prefix": prefix})
    except IntegrityError:
        raise AlreadyExists.on("name", f"a token named {name!r} already exists in {project.slug}") from None
    return token, raw


def _require_person(actor: object, action: str) -> None:
    """Tokens are managed by people: a token may not mint or revoke tokens."""
    if not isinstance(actor, User) or not actor.is_active:
        raise PermissionDenied(f"{action} needs a logged-in user, not an API token")


def api_token_revoke(*, actor: User, token: ApiToken) -> ApiToken:
    _require_person(actor, "revoking API tokens")
    role = require_project_role(actor=actor, project=token.project, minimum=Role.MEMBER, action="revoking tokens")
    if role != Role.OWNER and token.created_by_id != actor.pk:
        raise PermissionDenied("only an owner or the token's creator may revoke it")
    if token.revoked_at is None:
        _revoke(actor=actor, token=token)
    return token


def _revoke(*, actor: Actor, token: ApiToken, reason: str = "") -> None:
    now = timezone.now()
    if not ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now):
        token.refresh_from_db(fields=["revoked_at"])  # another revoke (or the creator's removal) came first
        return
    token.revoked_at = now
    audit_record(actor=actor, action="api_token.revoke", target=token, project=token.project,
                 payload={"prefix": token.prefix} | ({"reason": reason} if reason else {}))
    publish_access_withdrawn(groups=[actor_group(kind="token", pk=token.pk)])  # its open live streams close


def api_token_authenticate(*, raw: str) -> ApiToken | None:
    """The live token for a bearer string, or None. Constant-time on the secret part."""
    prefix = token_prefix(raw, "fb")
    if prefix is None:
        return None
    token = ApiToken.objects.select_related("project", "created_by").filter(prefix=prefix).first()
    if token is None or not token_matches(raw, token.token_hash):
        return None
    if project_role(actor=token, project=token.project) is None:  # revoked, expired, or its creator is gone
        return None
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > TOKEN_LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token


def user_set_operator(*, actor: User, user: User, is_operator: bool) -> User:
    if not (actor.is_active and actor.is_superuser):
        raise PermissionDenied("granting the operator role needs an administrator")
    user.is_operator = is_operator
    user.save(update_fields=["is_operator"])
    audit_record(actor=actor, action="user.set_operator", target=user, payload={"is_operator": is_operator})
    return user
