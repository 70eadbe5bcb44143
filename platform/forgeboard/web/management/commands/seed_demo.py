"""Create the demo login, project and experiments (idempotent); with --launch, the CPU demo run too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import transaction

from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import ACTIVE_STATES, RunState

from forgeboard.accounts.models import Project, User
from forgeboard.accounts.services import project_create
from forgeboard.experiments.models import Experiment
from forgeboard.experiments.services import experiment_create

from forgeboard.artifacts.models import Artifact, ArtifactKind
from forgeboard.artifacts.services import artifact_register

DEMO_MODEL = "tiny-qwen3"  # the demo project's model artifact (DATA_DIR/models is a default artifact root)


class Command(BaseCommand):
    help = "Create the demo user (demo / forgeboard-demo), its project and experiments."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default="forgeboard-demo")
        parser.add_argument("--launch", action="store_true",
                            help="build the tiny demo model if needed and queue the CPU demo SFT run")

    def handle(self, *args, username: str, password: str, launch: bool, **options) -> None:
        user = self._seed(username=username, password=password)
        if launch:
            self._launch_demo(user=user)

    @transaction.atomic
    def _seed(self, *, username: str, password: str) -> User:
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
        return user

    def _launch_demo(self, *, user: User) -> None:
        """Queue the CPU demo SFT run unless one is already queued or running."""
        experiment = Experiment.objects.get(project__slug="demo", name="arithmetic-sft")
        if Run.objects.filter(experiment=experiment, state__in=[RunState.QUEUED, *ACTIVE_STATES]).exists():
            self.stdout.write("the demo run is already queued or running")
            return
        model = Path(settings.DATA_DIR) / "models" / "tiny-qwen3"
        if not (model / "config.json").exists():
            self.stdout.write(f"building the tiny demo model in {model}")
            subprocess.run([sys.executable, "-m", "workers.engine", "make-tiny-model", "--family", "qwen3",
                            "--out", str(model)], check=True, cwd=settings.REPO_DIR)
        if not Artifact.objects.filter(project=experiment.project, name=DEMO_MODEL).exists():
            artifact_register(actor=user, project=experiment.project, name=DEMO_MODEL, kind=ArtifactKind.MODEL,
                              path=str(model), description="the CPU demo's tiny random Qwen3 (make-tiny-model)")
        config = (settings.REPO_DIR / "examples" / "configs" / "cpu_demo_sft.yaml").read_text(encoding="utf-8")
        run = run_launch(actor=user, experiment=experiment, config_yaml=config,
                         overrides=["model.path=", f"model.artifact={DEMO_MODEL}"])
        self.stdout.write(f"queued the CPU demo run: {experiment.name} #{run.number}")
