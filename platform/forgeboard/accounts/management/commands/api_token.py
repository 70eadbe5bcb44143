"""`manage.py api_token create|list|revoke --user USER`: a person's API tokens, from the server host.

`create --project SLUG --name NAME [--scope read|write] [--expires-days N] [--out FILE]` prints the token once
(or writes it to FILE, mode 600); `list [--project SLUG]` shows prefixes, never secrets;
`revoke --project SLUG --name NAME` (or `revoke --id N`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from forgeboard.accounts.models import ApiToken, TokenScope, User
from forgeboard.accounts.selectors import api_token_get, api_tokens_for_user, project_get
from forgeboard.accounts.services import MAX_TOKEN_LIFETIME, api_token_create, api_token_revoke
from forgeboard.errors import ServiceError


class Command(BaseCommand):
    help = "Create, list or revoke API tokens as USER. A new token is printed (or written to --out) once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["create", "list", "revoke"])
        parser.add_argument("--user", required=True, help="username acting (needs a role in the project; audited)")
        parser.add_argument("--project", help="project slug")
        parser.add_argument("--name", help="the token's name (create, revoke)")
        parser.add_argument("--id", type=int, dest="token_id", help="the token's id (revoke)")
        parser.add_argument("--scope", choices=TokenScope.values, default=TokenScope.WRITE)
        parser.add_argument("--expires-days", type=int, help=f"1-{MAX_TOKEN_LIFETIME.days}; default: never")
        parser.add_argument("--out", type=Path, help="write the new token to this file (mode 600), not stdout")

    def handle(self, *args, action: str, user: str, **options) -> None:
        actor = User.objects.filter(username=user, is_active=True).first()
        if actor is None:
            raise CommandError(f"--user: no active user named {user!r}")
        try:
            getattr(self, f"_{action}")(actor, **options)
        except ServiceError as exc:
            raise CommandError(exc.message) from None

    def _create(self, actor: User, *, project: str | None, name: str | None, scope: str, expires_days: int | None,
                out: Path | None, **_: object) -> None:
        if not project or not name:
            raise CommandError("create needs --project and --name")
        if expires_days is not None and not 1 <= expires_days <= MAX_TOKEN_LIFETIME.days:
            raise CommandError(f"--expires-days: must be 1-{MAX_TOKEN_LIFETIME.days}")
        expires_at = timezone.now() + timedelta(days=expires_days) if expires_days else None
        token, raw = api_token_create(actor=actor, project=project_get(actor=actor, slug=project), name=name,
                                      scope=scope, expires_at=expires_at)
        if out is None:
            self.stdout.write(raw)
            return
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(raw + "\n")
        self.stdout.write(f"API token {token.name} (fb_{token.prefix}_…) for {token.project.slug} written to {out}")

    def _list(self, actor: User, *, project: str | None, **_: object) -> None:
        tokens = api_tokens_for_user(user=actor)
        if project:
            tokens = tokens.filter(project=project_get(actor=actor, slug=project))
        now = timezone.now()
        self.stdout.write(f"{'ID':>6}  {'PROJECT':20} {'NAME':24} {'TOKEN':20} {'SCOPE':6} {'STATE':8} EXPIRES")
        for token in tokens:
            state = "revoked" if token.revoked_at else (
                "expired" if token.expires_at and token.expires_at <= now else "active")
            expires = token.expires_at.strftime("%Y-%m-%d %H:%M") if token.expires_at else "never"
            self.stdout.write(f"{token.pk:>6}  {token.project.slug:20} {token.name:24} fb_{token.prefix}_…  "
                              f"{token.scope:6} {state:8} {expires}")

    def _revoke(self, actor: User, *, project: str | None, name: str | None, token_id: int | None,
                **_: object) -> None:
        if token_id is not None:
            token = api_token_get(actor=actor, token_id=token_id)
        elif project and name:
            token = ApiToken.objects.filter(project=project_get(actor=actor, slug=project), name=name).first()
            if token is None:
                raise CommandError(f"no API token named {name!r} in {project}")
        else:
            raise CommandError("revoke needs --id, or --project and --name")
        api_token_revoke(actor=actor, token=token)
        self.stdout.write(f"API token {token.name} (fb_{token.prefix}_…) of {token.project.slug} revoked")
