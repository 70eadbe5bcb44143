"""`manage.py agent_token create NAME --operator USER [--out FILE]` / `agent_token revoke NAME --operator USER`."""

from __future__ import annotations

import os
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from forgeboard.accounts.models import User
from forgeboard.cluster.models import AgentToken
from forgeboard.cluster.services import agent_token_create, agent_token_revoke
from forgeboard.errors import ServiceError


class Command(BaseCommand):
    help = "Create or revoke a node agent token. The token is printed (or written to --out) once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["create", "revoke"])
        parser.add_argument("name")
        parser.add_argument("--operator", required=True, help="username of the operator doing this (audited)")
        parser.add_argument("--out", type=Path, help="write the new token to this file (mode 600) instead of stdout")

    def handle(self, *args, action: str, name: str, operator: str, out: Path | None, **options) -> None:
        actor = User.objects.filter(username=operator).first()
        if actor is None:
            raise CommandError(f"--operator: no user named {operator!r}")
        try:
            if action == "create":
                token, raw = agent_token_create(actor=actor, name=name)
                if out is None:
                    self.stdout.write(raw)
                else:
                    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "w", encoding="utf-8") as handle:
                        handle.write(raw + "\n")
                    self.stdout.write(f"agent token {token.name} (fba_{token.prefix}_…) written to {out}")
                return
            token = AgentToken.objects.filter(name=name).first()
            if token is None:
                raise CommandError(f"no agent token named {name!r}")
            agent_token_revoke(actor=actor, token=token)
            self.stdout.write(f"agent token {token.name} revoked")
        except ServiceError as exc:
            raise CommandError(exc.message) from None
