"""One set of actors for every permission test: owner, member, viewer, outsider, operator."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from forgeboard.accounts.models import Project, Role, User
from forgeboard.accounts.services import membership_set, project_create
from forgeboard.experiments.models import Experiment
from forgeboard.experiments.services import experiment_create

TINY_GRPO_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: /models/tiny-qwen3
trainer:
  steps: 5
  batch_size: 2
grpo:
  group_size: 4
"""


TINY_MONARCH_GRPO_YAML = TINY_GRPO_YAML + """\
placement:
  backend: monarch
"""


@dataclass
class Team:
    owner: User
    member: User
    viewer: User
    outsider: User
    operator: User
    project: Project
    experiment: Experiment

    def by_role(self, name: str) -> User:
        return getattr(self, name)


@pytest.fixture
def team(db) -> Team:
    owner = User.objects.create_user("olivia", password="pw-olivia-1")
    member = User.objects.create_user("mateo", password="pw-mateo-1")
    viewer = User.objects.create_user("vera", password="pw-vera-1")
    outsider = User.objects.create_user("oscar", password="pw-oscar-1")
    operator = User.objects.create_user("opal", password="pw-opal-1", is_operator=True)
    project = project_create(actor=owner, slug="alpha", name="Alpha")
    membership_set(actor=owner, project=project, user=member, role=Role.MEMBER)
    membership_set(actor=owner, project=project, user=viewer, role=Role.VIEWER)
    experiment = experiment_create(actor=owner, project=project, name="math", recipe="grpo")
    return Team(owner, member, viewer, outsider, operator, project, experiment)


@pytest.fixture
def grpo_yaml() -> str:
    return TINY_GRPO_YAML


@pytest.fixture
def running_run(team, grpo_yaml):
    """A run in the running state and its controller's raw token."""
    from forgeboard.runs.models import Run
    from forgeboard.runs.services import run_launch
    from forgeboard.runs.states import RunState
    from forgeboard.runs.tokens import run_token_issue

    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    run.refresh_from_db()
    return run, run_token_issue(run=run)


@pytest.fixture
def monarch_running_run(team):
    """A running multi-process (Monarch) run, which takes drills, placement changes and redirects, and its token."""
    from forgeboard.runs.models import Run
    from forgeboard.runs.services import run_launch
    from forgeboard.runs.states import RunState
    from forgeboard.runs.tokens import run_token_issue

    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=TINY_MONARCH_GRPO_YAML)
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    run.refresh_from_db()
    return run, run_token_issue(run=run)


@pytest.fixture
def wsgi_in_process():
    """Calls straight through WSGI (not Django's test client): keep Django from closing the test's connection
    after each request, as its test client does."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)
