"""`manage.py artifact register PROJECT NAME --kind model|dataset --path PATH --operator USER [--description TEXT]`,
`artifact list PROJECT`, `artifact delete PROJECT NAME --operator USER`."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from forgeboard.accounts.models import Project, User
from forgeboard.artifacts.models import ArtifactKind
from forgeboard.artifacts.selectors import artifact_named, artifacts_for_project
from forgeboard.artifacts.services import artifact_delete, artifact_register
from forgeboard.errors import ServiceError


class Command(BaseCommand):
    help = "Register, list or delete a project's artifacts (models and datasets inside FORGEBOARD_ARTIFACT_ROOTS)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["register", "list", "delete"])
        parser.add_argument("project", help="the project's slug")
        parser.add_argument("name", nargs="?")
        parser.add_argument("--kind", choices=ArtifactKind.values)
        parser.add_argument("--path", help="a Hugging Face folder (model) or a JSONL file (dataset) inside the roots")
        parser.add_argument("--description", default="")
        parser.add_argument("--operator", help="username of the operator doing this (audited)")

    def handle(self, *args, action: str, project: str, name: str | None, kind: str | None, path: str | None,
               description: str, operator: str | None, **options) -> None:
        found = Project.objects.filter(slug=project).first()
        if found is None:
            raise CommandError(f"no project {project!r}")
        if action == "list":
            for artifact in artifacts_for_project(project=found):
                self.stdout.write(f"{artifact.name}\t{artifact.kind}\t{artifact.path}")
            return
        if not name:
            raise CommandError(f"{action} needs the artifact's NAME")
        actor = User.objects.filter(username=operator).first() if operator else None
        if actor is None:
            raise CommandError(f"--operator: no user named {operator!r}" if operator else "--operator is required")
        try:
            if action == "register":
                if not kind or not path:
                    raise CommandError("register needs --kind and --path")
                artifact = artifact_register(actor=actor, project=found, name=name, kind=kind, path=path,
                                             description=description)
                self.stdout.write(f"registered {found.slug}/{artifact.name} ({artifact.kind}): {artifact.path}")
                return
            artifact = artifact_named(project=found, name=name)
            if artifact is None:
                raise CommandError(f"no artifact {name!r} in project {found.slug}")
            artifact_delete(actor=actor, artifact=artifact)
            self.stdout.write(f"deleted {found.slug}/{name}")
        except ServiceError as exc:
            raise CommandError(exc.message) from None
