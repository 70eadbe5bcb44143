"""The runs list and the run page: live charts, timeline, logs, config, placement, rollouts, checkpoints, controls."""

from __future__ import annotations

import json
import re
from typing import Any, get_args

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from forgeboard.accounts.models import Role
from forgeboard.accounts.permissions import project_role
from forgeboard.cluster.models import Host
from forgeboard.errors import ServiceError, ValidationFailed
from forgeboard.experiments.models import Recipe
from forgeboard.experiments.selectors import experiments_for_project
from forgeboard.runs.checkpoints import run_checkpoints, run_launch_from_checkpoint_request
from forgeboard.runs.models import CommandKind, CommandState, LaunchBackend, Run
from forgeboard.runs.selectors import RunFilters, runs_search
from forgeboard.runs.services import command_create, run_cancel
from forgeboard.runs.states import CANCELLABLE_STATES, COMMAND_STATES, TERMINAL_STATES, RunState
from forgeboard.telemetry.models import EventKind, MetricSeries, RunEvent
from forgeboard.telemetry.selectors import KEY_METRICS, rollout_samples
from forgeboard.idempotency.services import idempotent_refused
from forgeboard.web.errors import project_or_404, refusal_or_flash, run_or_404
from forgeboard.web.idempotent import idempotent_form
from workers.engine.operations import UPDATE_KINDS, DrillKind, DrillRole, PlacedRole

RUNS_PER_PAGE = 50
COMMANDS_SHOWN = 20
COMMAND_TEXT_CHARS = 500  # of a command's payload or result, as JSON
ROLLOUTS_SHOWN = 40
PLACEMENT_ROWS_SHOWN = 256
PLACEMENT_JSON_CHARS = 20_000
PLACEMENT_EVENTS = (EventKind.PLACEMENT_APPLIED, EventKind.PLACEMENT_CHANGED)
# The operator controls' words for the engine's drill kinds (DrillKind), short enough to be read whole in the form's
# select (tests/e2e/test_drills.py measures them).
DRILL_KIND_LABELS = {"kill": "kill a process (SIGKILL)", "hang": "hang (SIGSTOP, SIGCONT)",
                     "raise": "raise in an endpoint", "latency": "add message latency", "bandwidth": "cap bandwidth",
                     "slow_host": "slow host (stop/continue)", "nan_gradients": "NaN gradients (trainer only)"}
# Why the operator controls are put away in a state of a run that has not ended (they are shown in COMMAND_STATES).
CONTROLS_NOTES = {
    RunState.QUEUED: "Queued: the controls work once the run is launching.",
    RunState.CANCELLING: "Cancelling: the run takes no more commands.",
    RunState.LOST: "Lost: the run stopped reporting without an end of its own. It restarts from its last checkpoint "
                   "once its previous attempt is confirmed stopped, if it has restarts left, else it fails (or it "
                   "ends succeeded if that attempt turns out to have finished); the controls work again once it is "
                   "launching.",
}
# What a run's stored reason is in each state: why it ended, why it was lost, or, while it goes on after a restart,
# why it was restarted ("restart 1 of 2: …").
REASON_LABELS = {state: "Exit reason" if state in TERMINAL_STATES else "Lost" if state == RunState.LOST
                 else "Last restart" for state in RunState}
# htmx stops polling a part that answers with this status (and still shows the answer).
STOP_POLLING = 286


def _filters(request: HttpRequest) -> RunFilters:
    experiment = request.GET.get("experiment", "")
    state = request.GET.get("state", "")
    return RunFilters(
        text=request.GET.get("q", "")[:200],
        state=state if state in RunState.values else "",
        experiment_id=int(experiment) if experiment.isdigit() and len(experiment) < 18 else None,
        tag=request.GET.get("tag", "")[:100],
        launched_by=request.GET.get("user", "")[:150],
    )


def duration_of(run: Run) -> float | None:
    if run.started_at is None:
        return None
    return ((run.finished_at or timezone.now()) - run.started_at).total_seconds()


@login_required
@require_GET
def run_list(request: HttpRequest, slug: str) -> HttpResponse:
    project = project_or_404(request, slug)
    filters = _filters(request)
    page = Paginator(runs_search(project=project, filters=filters), RUNS_PER_PAGE).get_page(request.GET.get("page"))
    runs = list(page.object_list)
    summaries: dict[int, dict[str, float | None]] = {}
    for series in MetricSeries.objects.filter(run__in=runs, key__in=KEY_METRICS):
        summaries.setdefault(series.run_id, {})[series.key] = series.last_value
    rows = [{"run": run, "duration": duration_of(run),
             "metrics": [summaries.get(run.pk, {}).get(key) for key in KEY_METRICS]} for run in runs]
    role = project_role(actor=request.user, project=project)
    experiments = experiments_for_project(project=project)
    tags = sorted({tag for e in experiments for tag in e.tags})
    query = request.GET.copy()
    query.pop("page", None)
    return render(request, "web/project.html", {
        "project": project, "role": role, "can_launch": role is not None and role.rank >= Role.MEMBER.rank,
        "rows": rows, "page": page, "filters": filters, "states": RunState.choices, "experiments": experiments,
        "tags": tags, "key_metrics": KEY_METRICS, "query": query.urlencode(),
    })


def _placement(run: Run) -> dict[str, Any]:
    """Which actor runs where: the newest placement event's plan, else the launch plan and allocation; at most
    PLACEMENT_ROWS_SHOWN replicas and PLACEMENT_JSON_CHARS of the plan, whatever the run's engine reported."""
    latest = (RunEvent.objects.filter(run=run, kind__in=PLACEMENT_EVENTS).order_by("-seq").first())
    replicas = latest.payload.get("plan") if latest else None
    rows = sorted(replicas.items(), key=lambda item: str(item[0]).zfill(6)) if isinstance(replicas, dict) else []
    plan = latest.payload if latest else run.placement_plan
    plan_json = json.dumps(plan, indent=2, sort_keys=True)
    if len(plan_json) > PLACEMENT_JSON_CHARS:
        plan_json = f"{plan_json[:PLACEMENT_JSON_CHARS]}\n… ({PLACEMENT_JSON_CHARS} of {len(plan_json)} characters shown)"
    return {
        "plan_json": plan_json,
        "role": latest.payload.get("role", "") if latest else "",
        "replicas": rows[:PLACEMENT_ROWS_SHOWN],
        "replicas_not_shown": max(0, len(rows) - PLACEMENT_ROWS_SHOWN),
        "source": f"{latest.get_kind_display().lower()} at {latest.occurred_at:%H:%M:%S}" if latest else "launch plan",
        "allocation": run.allocation,
    }


@login_required
@require_GET
def run_detail(request: HttpRequest, run_id: int) -> HttpResponse:
    run = run_or_404(request, run_id)
    project = run.experiment.project
    role = project_role(actor=request.user, project=project)
    can_operate = role is not None and role.rank >= Role.MEMBER.rank
    config = run.config.run_config
    placement = _placement(run)
    context = {
        "run": run, "project": project, "role": role, "can_operate": can_operate,
        "ended": run.state in TERMINAL_STATES, "can_cancel": run.state in CANCELLABLE_STATES,
        "takes_commands": run.state in COMMAND_STATES, "controls_note": CONTROLS_NOTES.get(run.state, ""),
        "duration": duration_of(run),
        "multi_process": config.placement.backend != LaunchBackend.LOCAL,  # monarch, or a SLURM / Kubernetes job
        "checkpoints": run_checkpoints(run=run), "placement": placement,
        "placement_json": placement["plan_json"],
        "commands": run.commands.select_related("created_by").order_by("-id")[:COMMANDS_SHOWN],
        "command_text_chars": COMMAND_TEXT_CHARS, "reason_label": REASON_LABELS[run.state],
        "generator_replicas": config.role_processes().get("generator", 0),  # 0: generator.in_trainer
        "trainer_ranks": config.trainer.ranks,
        "drill_kinds": [(kind, DRILL_KIND_LABELS[kind]) for kind in get_args(DrillKind)],
        "drill_roles": ("trainer",) if config.recipe == Recipe.SFT else
        tuple(role for role in get_args(DrillRole) if role != "generator" or not config.generator.in_trainer),
        "placement_roles": [role for role in get_args(PlacedRole) if role != "generator" or not config.generator.in_trainer],
        "has_replicas": config.recipe != Recipe.SFT,  # an SFT run has trainer ranks only: nothing to place
        "hosts": list(Host.objects.order_by("hostname").values_list("hostname", flat=True)),
        "total_steps": config.trainer.steps,
        "run_data": {"id": run.pk, "number": run.number, "state": run.state, "totalSteps": config.trainer.steps,
                     "terminalStates": sorted(TERMINAL_STATES), "cancelStates": sorted(CANCELLABLE_STATES),
                     "commandStates": sorted(COMMAND_STATES), "controlsNotes": CONTROLS_NOTES,
                     "reasonLabels": REASON_LABELS,
                     # the drill kinds only a trainer rank takes: the drill form offers them for the trainer alone
                     "drillKindRoles": {kind: ["trainer"] for kind in UPDATE_KINDS},
                     "commandsShown": COMMANDS_SHOWN, "commandTextChars": COMMAND_TEXT_CHARS,
                     "commandKindLabels": dict(CommandKind.choices), "commandStateLabels": dict(CommandState.choices),
                     "startedAt": run.started_at.isoformat() if run.started_at else None,
                     "finishedAt": run.finished_at.isoformat() if run.finished_at else None,
                     "wsPath": f"/ws/runs/{run.pk}/", "apiPath": f"/api/v1/runs/{run.pk}/"},
    }
    return render(request, "web/run.html", context)


@login_required
@require_GET
def run_checkpoints_part(request: HttpRequest, run_id: int) -> HttpResponse:
    """The checkpoints table; the page reloads it when a checkpoint_saved event arrives."""
    run = run_or_404(request, run_id)
    role = project_role(actor=request.user, project=run.experiment.project)
    return render(request, "web/_checkpoints.html", {
        "run": run, "checkpoints": run_checkpoints(run=run),
        "can_operate": role is not None and role.rank >= Role.MEMBER.rank,
    })


@login_required
@require_GET
def run_rollouts(request: HttpRequest, run_id: int) -> HttpResponse:
    """The newest rollout samples (prompt, completion, reward, advantage, policy version); htmx refreshes it until
    the run has ended."""
    run = run_or_404(request, run_id)
    return render(request, "web/_rollouts.html", {"rollouts": rollout_samples(run=run, last=ROLLOUTS_SHOWN)},
                  status=STOP_POLLING if run.state in TERMINAL_STATES else 200)


@login_required
@require_POST
def run_cancel_view(request: HttpRequest, run_id: int) -> HttpResponse:
    run = run_or_404(request, run_id)
    try:
        run_cancel(actor=request.user, run=run)
        messages.success(request, "cancel requested")
    except ServiceError as error:
        if refused := refusal_or_flash(request, error):
            return refused
    return redirect("run_detail", run_id=run.pk)


NUMBER = re.compile(r"^-?\d{1,18}(\.\d{1,18})?$")  # longer digit runs stay text, for the service to refuse


def form_payload(fields: dict[str, str]) -> dict[str, Any]:
    """Form fields `payload.a.b=v` as a nested payload; numbers become numbers, empty fields are left out.

    The browser script builds the same shape; the service validates it (field and reason). A field that is both a
    value and a section (`payload.role` and `payload.role.x`) is refused at the second one.
    """
    payload: dict[str, Any] = {}
    for name, raw in fields.items():
        if not name.startswith("payload.") or raw == "":
            continue
        value: Any = raw
        if NUMBER.match(raw):
            value = float(raw) if "." in raw else int(raw)
        *parents, leaf = name.removeprefix("payload.").split(".")
        node = payload
        for depth, parent in enumerate(parents, start=1):
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                section = ".".join(["payload", *parents[:depth]])
                raise ValidationFailed.on(name, f"conflicts with {section}, which holds a value")
        if isinstance(node.get(leaf), dict):
            raise ValidationFailed.on(name, f"conflicts with the fields under {name}")
        node[leaf] = value
    return payload


@login_required
@require_POST
def run_command(request: HttpRequest, run_id: int) -> HttpResponse:
    """The controls' form fallback when scripts are off; the page's script posts to the API instead."""
    run = run_or_404(request, run_id)
    kind = request.POST.get("kind", "")
    try:
        command = command_create(actor=request.user, run=run, kind=kind, payload=form_payload(dict(request.POST.items())))
        messages.success(request, f"{command.get_kind_display().lower()} sent (command {command.pk})")
    except ServiceError as error:
        if refused := refusal_or_flash(request, error):
            return refused
    return redirect("run_detail", run_id=run.pk)


@login_required
@require_POST
@idempotent_form
def run_from_checkpoint(request: HttpRequest, run_id: int, step: int) -> HttpResponse:
    run = run_or_404(request, run_id)
    try:
        child = run_launch_from_checkpoint_request(actor=request.user, run=run, step=step)
    except ServiceError as error:
        idempotent_refused(request)
        return refusal_or_flash(request, error) or redirect("run_detail", run_id=run.pk)
    if isinstance(child, Run):
        messages.success(request, f"started {child.experiment.name} #{child.number} from step {step} of #{run.number}")
        return redirect("run_detail", run_id=child.pk)
    messages.info(request, f"exporting step {step}; the new run starts when the export is done (the timeline says "
                           "which run started)")
    return redirect("run_detail", run_id=run.pk)
