"""Create the demo login, project and experiments (idempotent); with --launch, the CPU demo's SFT run too; with
--follow, see the demo chain through (SFT, then GRPO from its export: forgeboard/runs/demo.py) and print its figures."""

from __future__ import annotations

import os
import time

from django.core.management.base import BaseCommand

from forgeboard.accounts.models import User
from forgeboard.runs.demo import demo_chain_advance, demo_chain_summary, demo_seed, demo_sft_launch

FOLLOW_POLL_S = 2.0


class Command(BaseCommand):
    help = "Create the demo user (demo / forgeboard-demo), its project and experiments."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default="forgeboard-demo")
        parser.add_argument("--launch", action="store_true",
                            help="build the tiny demo model if needed and queue the CPU demo SFT run")
        parser.add_argument("--follow", action="store_true",
                            help="start the GRPO run from the SFT run's export when it succeeds, wait for both and "
                                 "print their held-out figures")

    def handle(self, *args, username: str, password: str, launch: bool, follow: bool, **options) -> None:
        user, created = demo_seed(username=username, password=password)
        if created:
            self.stdout.write(f"created user {username!r} with password {password!r}")
        self.stdout.write(f"demo project ready: log in as {username!r}")
        if launch:
            run = demo_sft_launch(actor=user)
            self.stdout.write(f"queued the CPU demo run: {run.experiment.name} #{run.number}" if run
                              else "the demo run is already under way or done")
        if follow:
            self._follow(user=user)

    def _follow(self, *, user: User) -> None:
        base_url = os.environ.get("FORGEBOARD_PUBLIC_URL", "")
        shown = ""
        while True:
            chain = demo_chain_advance(actor=user)
            line = demo_chain_summary(chain, base_url=base_url)
            if line != shown:
                self.stdout.write(line)
                self.stdout.flush()
                shown = line
            if chain.finished:
                return
            time.sleep(FOLLOW_POLL_S)
