"""Create the demo login, project and experiments (idempotent)."""

from __future__ import annotations

from django.core.management.base import BaseCommand
from django.db import transaction

from forgeboard.accounts.models import Project, User
from forgeboard.accounts.services import project_create
from forgeboard.experiments.models import Experiment
from forgeboard.experiments.services import experiment_create


class Command(BaseCommand):
    help = "Create the demo user (demo / forgeboard-demo), its project and experiments."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default="forgeboard-demo")

    @transaction.atomic
    def handle(self, *args, username: str, password: str, **options) -> None:
        user = User.objects.filter(username=username).first()
        if user is None:
            user = User.objects.create_user(username=username, password=password, is_operator=True)
            self.stdout.write(f"created user {username!r} with password {password!r}")
        project = Project.objects.filter(slug="demo").first() or project_create(
            actor=user, slug="demo", name="Demo project", description="Tiny models on the CPU: SFT then GRPO."
        )
        for name, recipe in (("arithmetic-sft", "sft"), ("arithmetic-grpo", "grpo")):
            if not Experiment.objects.filter(project=project, name=name).exists():
                experiment_create(actor=user, project=project, name=name, recipe=recipe, tags=["demo", "cpu"])
        self.stdout.write(f"demo project ready: log in as {username!r}")
