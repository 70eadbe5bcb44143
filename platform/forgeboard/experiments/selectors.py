from __future__ import annotations

from django.db.models import Count, QuerySet

from forgeboard.accounts.models import Project
from forgeboard.accounts.permissions import Actor, project_role
from forgeboard.errors import NotFound, is_db_id
from forgeboard.experiments.models import Experiment


def experiments_for_project(*, project: Project) -> QuerySet[Experiment]:
    return Experiment.objects.filter(project=project).annotate(run_count=Count("runs"))


def experiment_get(*, actor: Actor, experiment_id: int) -> Experiment:
    experiment = (Experiment.objects.select_related("project").filter(pk=experiment_id).first()
                  if is_db_id(experiment_id) else None)
    if experiment is None or project_role(actor=actor, project=experiment.project) is None:
        raise NotFound(f"no experiment {experiment_id}")
    return experiment
