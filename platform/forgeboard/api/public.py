"""/api/v1 for people and CI: projects, experiments, runs, commands, metrics, events, inventory.

Thin: every read goes through a selector, every write through a service (which checks permission
and audits). A read-only token may read; writes need a read-write token or a session (a host's intent: a platform
operator's session).
"""


from django.http import HttpRequest
from ninja import Path, Query, Router, Status
from ninja.pagination import paginate

from forgeboard.accounts.models import ApiToken, Project
from forgeboard.accounts.permissions import require_operator
from forgeboard.accounts.selectors import project_get, projects_for_user
from forgeboard.api.auth import USER_AUTH, actor_of, require_write_scope
from forgeboard.api.idempotent import idempotent
from forgeboard.api.pagination import Pages
from forgeboard.api.query import OptionalQueryInt, QueryInt
from forgeboard.api.schemas import (
    BODY_ERRORS,
    ERRORS,
    IDEMPOTENT_ERRORS,
    CheckpointExportOut,
    CheckpointRunIn,
    CommandIn,
    CommandOut,
    EventOut,
    ExperimentIn,
    ExperimentOut,
    HostIntentIn,
    HostOut,
    PointsOut,
    ProjectOut,
    RunDetailOut,
    RunIn,
    RunOut,
    SeriesOut,
    TimelinesOut,
)
from forgeboard.cluster.selectors import host_get, hosts_with_devices
from forgeboard.cluster.services import host_set_intent
from forgeboard.experiments.selectors import experiment_get, experiments_for_project
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.checkpoints import (
    ExportState,
    ExportStatus,
    checkpoint_export_request,
    checkpoint_export_status,
    run_launch_from_checkpoint_request,
)
from forgeboard.runs.models import Command
from forgeboard.runs.selectors import run_get, runs_for_project
from forgeboard.runs.services import command_create, run_cancel, run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.ingest import wire_number
from forgeboard.telemetry.selectors import events_after, metric_downsampled, metric_keys, metric_range, step_timelines
from workers.engine.config import config_json_schema

router = Router(auth=USER_AUTH)
MAX_POINTS = 10_000
MAX_STEP = 2**63 - 1


@router.get("/projects", response={200: list[ProjectOut], **ERRORS}, tags=["projects"])
@paginate(Pages)
def list_projects(request: HttpRequest):  # noqa: ANN201
    actor = actor_of(request)
    if isinstance(actor, ApiToken):
        return Project.objects.filter(pk=actor.project_id)
    return projects_for_user(user=actor)


@router.get("/projects/{slug}", response={200: ProjectOut, **ERRORS}, tags=["projects"])
def get_project(request: HttpRequest, slug: str):  # noqa: ANN201
    return project_get(actor=actor_of(request), slug=slug)


@router.get("/projects/{slug}/experiments", response={200: list[ExperimentOut], **ERRORS}, tags=["experiments"])
@paginate(Pages)
def list_experiments(request: HttpRequest, slug: str):  # noqa: ANN201
    return experiments_for_project(project=project_get(actor=actor_of(request), slug=slug))


@router.post("/projects/{slug}/experiments", response={201: ExperimentOut, **BODY_ERRORS, **IDEMPOTENT_ERRORS},
             tags=["experiments"])
@idempotent
def create_experiment(request: HttpRequest, slug: str, body: ExperimentIn):  # noqa: ANN201
    require_write_scope(request)
    project = project_get(actor=actor_of(request), slug=slug)
    experiment = experiment_create(actor=actor_of(request), project=project, name=body.name, recipe=body.recipe,
                                   description=body.description, tags=body.tags)
    return Status(201, experiment)


@router.get("/experiments/{experiment_id}", response={200: ExperimentOut, **ERRORS}, tags=["experiments"])
def get_experiment(request: HttpRequest, experiment_id: int):  # noqa: ANN201
    return experiment_get(actor=actor_of(request), experiment_id=experiment_id)


@router.post("/experiments/{experiment_id}/runs", response={201: RunDetailOut, **BODY_ERRORS, **IDEMPOTENT_ERRORS},
             tags=["runs"])
@idempotent
def launch_run(request: HttpRequest, experiment_id: int, body: RunIn):  # noqa: ANN201
    """Validate the config against the engine's schema, snapshot it, and queue the run.

    `config_yaml` is checked beyond what this document's JSON Schema can say (it is YAML validated against
    the run config schema, `GET /config-schema`, with the overrides applied): a body that matches this
    document can still be refused with 400 and each problem at its field (`config.trainer.steps`, ...)."""
    require_write_scope(request)
    experiment = experiment_get(actor=actor_of(request), experiment_id=experiment_id)
    run = run_launch(actor=actor_of(request), experiment=experiment, config_yaml=body.config_yaml,
                     overrides=body.overrides, priority=body.priority)
    return Status(201, run)


@router.get("/projects/{slug}/runs", response={200: list[RunOut], **ERRORS}, tags=["runs"])
@paginate(Pages)
def list_runs(request: HttpRequest, slug: str, state: RunState | None = None):  # noqa: ANN201
    return runs_for_project(project=project_get(actor=actor_of(request), slug=slug), state=state)


@router.get("/runs/{run_id}", response={200: RunDetailOut, **ERRORS}, tags=["runs"])
def get_run(request: HttpRequest, run_id: int):  # noqa: ANN201
    return run_get(actor=actor_of(request), run_id=run_id)


@router.post("/runs/{run_id}/cancel", response={200: RunOut, **ERRORS}, tags=["runs"])
def cancel_run(request: HttpRequest, run_id: int):  # noqa: ANN201
    require_write_scope(request)
    return run_cancel(actor=actor_of(request), run=run_get(actor=actor_of(request), run_id=run_id))


@router.get("/runs/{run_id}/commands", response={200: list[CommandOut], **ERRORS}, tags=["commands"])
@paginate(Pages)
def list_commands(request: HttpRequest, run_id: int):  # noqa: ANN201
    return Command.objects.filter(run=run_get(actor=actor_of(request), run_id=run_id)).order_by("-pk")


@router.post("/runs/{run_id}/commands", response={201: CommandOut, **BODY_ERRORS, **IDEMPOTENT_ERRORS},
             tags=["commands"])
@idempotent
def send_command(request: HttpRequest, run_id: int, body: CommandIn):  # noqa: ANN201
    """Pause, resume, checkpoint, placement change, fault drill or load redirect for a live run.

    The payload of a fault drill, placement change or load redirect is checked against the engine's
    operation (400 with the field when it is not one); those need a run placed on Monarch (409 otherwise)."""
    require_write_scope(request)
    run = run_get(actor=actor_of(request), run_id=run_id)
    return Status(201, command_create(actor=actor_of(request), run=run, kind=body.kind, payload=body.payload))


@router.post("/runs/{run_id}/checkpoints/{step}/export", response={200: CheckpointExportOut, 202: CheckpointExportOut,
                                                                  **ERRORS}, tags=["checkpoints"])
def export_checkpoint(request: HttpRequest, run_id: int, step: int = Path(..., ge=0, le=MAX_STEP)):  # noqa: ANN201
    """Export the checkpoint at `step` as a Hugging Face folder, off the request.

    200 with `state: done` and the folder's `path` when it is already exported. Otherwise the export is
    queued for a worker (the `checkpoints.export` task) and the answer is 202 with `state: queued` (or
    `running` when it was already asked for): poll `GET` on the same URL until `done` or `failed`
    (`error` says why). A failed export is queued again by the next `POST`.
    """
    require_write_scope(request)
    run = run_get(actor=actor_of(request), run_id=run_id)
    status = checkpoint_export_request(actor=actor_of(request), run=run, step=step)
    return Status(200 if status.state == ExportState.DONE else 202, status)


@router.post("/runs/{run_id}/checkpoints/{step}/runs", response={201: RunDetailOut, 202: CheckpointExportOut,
                                                                **BODY_ERRORS, **IDEMPOTENT_ERRORS},
             tags=["checkpoints"])
@idempotent
def launch_from_checkpoint(request: HttpRequest, run_id: int, body: CheckpointRunIn,  # noqa: ANN201
                           step: int = Path(..., ge=0, le=MAX_STEP)):
    """Start a run of any recipe from the checkpoint at `step`: its weights are the child's model
    (`model.artifact: run:<run_id>@step:<step>`), its optimizer starts afresh, and the child's parent is this run.

    201 with the child when the checkpoint is already exported. Otherwise the export is queued (unless it already
    is: every run asked for meanwhile waits for that one export) and the answer is 202 with its status: the child
    starts when it is done, and this run's events say which run started (`child_run_started`) or why none could
    (`child_run_failed`). The experiment, config and overrides are checked before anything is queued (400 with each
    problem at its field)."""
    require_write_scope(request)
    actor = actor_of(request)
    run = run_get(actor=actor, run_id=run_id)
    experiment = None if body.experiment_id is None else experiment_get(actor=actor, experiment_id=body.experiment_id)
    started = run_launch_from_checkpoint_request(actor=actor, run=run, step=step, experiment=experiment,
                                                 config_yaml=body.config_yaml, overrides=body.overrides,
                                                 priority=body.priority)
    return Status(202, started) if isinstance(started, ExportStatus) else Status(201, started)


@router.get("/runs/{run_id}/checkpoints/{step}/export", response={200: CheckpointExportOut, **ERRORS},
            tags=["checkpoints"])
def get_checkpoint_export(request: HttpRequest, run_id: int, step: int = Path(..., ge=0, le=MAX_STEP)):  # noqa: ANN201
    """How the export of the checkpoint at `step` stands: queued, running, done (with `path`) or failed (`error`);
    404 when it was never asked for."""
    run = run_get(actor=actor_of(request), run_id=run_id)
    return checkpoint_export_status(actor=actor_of(request), run=run, step=step)


@router.get("/runs/{run_id}/metrics", response={200: list[SeriesOut], **ERRORS}, tags=["metrics"])
def list_metrics(request: HttpRequest, run_id: int):  # noqa: ANN201
    return metric_keys(run=run_get(actor=actor_of(request), run_id=run_id))


@router.get("/runs/{run_id}/metrics/{path:key}", response={200: PointsOut, **ERRORS}, tags=["metrics"])
def get_points(
    request: HttpRequest,
    run_id: int,
    key: str,
    start_step: OptionalQueryInt = Query(None, ge=0, le=MAX_STEP),
    end_step: OptionalQueryInt = Query(None, ge=0, le=MAX_STEP),
    buckets: OptionalQueryInt = Query(None, ge=1, le=MAX_POINTS),
):
    """Points of one metric in a step range; with `buckets`, at most that many (mean, low, high) per slice."""
    run = run_get(actor=actor_of(request), run_id=run_id)
    if buckets is not None:
        rows = metric_downsampled(run=run, key=key, buckets=buckets, start_step=start_step, end_step=end_step)
        return PointsOut(key=key, downsampled=True, steps=[b.step for b in rows],
                         values=[wire_number(b.mean) for b in rows], low=[wire_number(b.low) for b in rows],
                         high=[wire_number(b.high) for b in rows], wall_times=[b.wall_time for b in rows])
    rows = metric_range(run=run, key=key, start_step=start_step, end_step=end_step, limit=MAX_POINTS)
    return PointsOut(key=key, downsampled=False, steps=[r[0] for r in rows], values=[wire_number(r[1]) for r in rows],
                     wall_times=[r[2] for r in rows])


@router.get("/runs/{run_id}/events", response={200: list[EventOut], **ERRORS}, tags=["events"])
def list_events(
    request: HttpRequest,
    run_id: int,
    after_seq: QueryInt = Query(0, ge=0, le=MAX_STEP),
    limit: QueryInt = Query(1000, ge=1, le=5000),
):
    """Events after a sequence number, in order: fetch state, then follow from the last `seq` you saw."""
    return list(events_after(run=run_get(actor=actor_of(request), run_id=run_id), after_seq=after_seq, limit=limit))


@router.get("/runs/{run_id}/timeline", response={200: TimelinesOut, **ERRORS}, tags=["metrics"])
def get_timeline(request: HttpRequest, run_id: int, last: QueryInt = Query(50, ge=1, le=500)):  # noqa: ANN201
    """Where the time of the last `last` steps went: per step, spans of work on each proc and each phase's share
    (a StepTimeline each, in step order)."""
    run = run_get(actor=actor_of(request), run_id=run_id)
    return TimelinesOut(run=run.pk, timelines=step_timelines(run=run, last=last))


@router.get("/hosts", response={200: list[HostOut], **ERRORS}, tags=["inventory"])
def list_hosts(request: HttpRequest):  # noqa: ANN201
    """The cluster inventory: each host with its devices. A host's `state` is the one word it always had; it is made
    of `liveness` (its heartbeats say up or down) and `intent` (an operator drains or cordons it): a host cordoned
    while down stays cordoned when it comes back."""
    return list(hosts_with_devices())


@router.post("/hosts/{hostname}/intent", response={200: HostOut, **BODY_ERRORS}, tags=["inventory"])
def set_host_intent(request: HttpRequest, body: HostIntentIn,  # noqa: ANN201
                    hostname: str = Path(..., description="the host's name, as `GET /hosts` lists it")):
    """Drain or cordon a host (no new work is placed there) or make it schedulable again, as the cluster page does;
    the answer is the host as it now is. Whether it is up or down stays its heartbeats' to say: a host that is down
    keeps the intent for when it comes back.

    Platform operators only, from a logged-in session: an API token belongs to one project and cannot act on the
    cluster (403). Asking for the intent a host already has changes nothing and gets the same answer (audited again
    with its reason), so a retry is safe as it is: no `Idempotency-Key` is needed. 404 when no host has that name."""
    actor = actor_of(request)
    require_operator(actor=actor, action="changing a host's state")  # before the lookup: a 403 names no host
    host = host_set_intent(actor=actor, host=host_get(hostname=hostname), intent=body.intent, reason=body.reason)
    return hosts_with_devices().get(pk=host.pk)


@router.get("/config-schema", tags=["configs"], auth=None)
def get_config_schema(request: HttpRequest) -> dict:
    """The run config's JSON Schema (the dashboard's editor validates against it)."""
    return config_json_schema()
