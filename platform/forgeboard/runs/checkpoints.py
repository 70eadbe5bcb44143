"""A run's checkpoints: listed from its run folder and from the `checkpoint_saved` events it reported,
exported as Hugging Face folders by the engine, and used to start new runs.

A checkpoint is `<run folder>/checkpoints/step_NNNNNN/trainer.pt` (+ config and tokenizer files).
The export runs the engine's exporter in a subprocess: the control plane never imports torch.

Off the request: `checkpoint_export_request` queues the `checkpoints.export` Celery task and
`checkpoint_export_status` tells how it goes. A `CheckpointExport` row holds the state (queued, running
with the worker's name, or failed with the reason) and when it was written; a complete export folder
means done. Each change of that state is told on the run's timeline (a `checkpoint_export` message with the
state in words), which the run page's checkpoints table follows. `run_launch_from_checkpoint_request` adds
a `PendingChildRun` that the export's task starts when it is done: one export for every run asked for meanwhile.
The run reconciler queues a lost export again, or fails it and the runs waiting for it
(`checkpoint_exports_reconcile`).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from forgeboard.accounts.models import ApiToken, Role, User
from forgeboard.accounts.permissions import Actor, actor_label, require_project_role
from forgeboard.audit.services import audit_record
from forgeboard.dispatch import CHECKPOINTS_EXPORT, enqueue
from forgeboard.errors import NotFound, ServiceError, ValidationFailed
from forgeboard.experiments.models import Experiment
from forgeboard.experiments.services import validate_run_config
from forgeboard.runs.folders import run_dir
from forgeboard.runs.models import CheckpointExport, PendingChildRun, Run
from forgeboard.runs.services import run_launch, run_launch_queue
from forgeboard.telemetry.models import EventKind, RunEvent
from forgeboard.telemetry.services import event_append
from workers.engine.checkpoint_folders import STATE_FILE
from workers.launch.local import REPO_DIR

logger = logging.getLogger(__name__)

STEP_FOLDER = re.compile(r"^step_([0-9]+)$")
ENGINE_COMMAND = (sys.executable, "-m", "workers.engine")
MAX_STEP = 2**63 - 1


class ExportFailed(ServiceError):
    status = 500
    code = "export_failed"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    size_bytes: int | None  # None: reported by the engine but not on this machine's disk (pruned, or elsewhere)
    created_at: datetime
    export: ExportStatus | None = None  # run_checkpoints only: how its export stands (None: never asked for)


def _folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _on_disk(folder: Path) -> Checkpoint | None:
    match = STEP_FOLDER.match(folder.name)
    if match is None:
        return None
    state = folder / STATE_FILE
    try:
        if not state.is_file():
            return None
        created = datetime.fromtimestamp(state.stat().st_mtime, tz=UTC)
        size = _folder_size(folder)
    except OSError:  # a reported path with a name too long, or a folder removed while it is measured
        return None
    return Checkpoint(step=int(match.group(1)), path=str(folder), size_bytes=size, created_at=created)


def _inside(root: Path, path: Path) -> bool:
    """Whether a path is in the run's own folder (`root`, resolved) once links are followed: what another run (or a
    link in this one) points at is never listed, measured or exported here."""
    try:
        return path.resolve().is_relative_to(root)
    except (OSError, ValueError):  # a NUL, a name too long, a loop of links: not a folder of this run's
        return False


def checkpoints_on_disk(*, run: Run) -> list[Checkpoint]:
    """The complete checkpoints in the run's folder on this machine, by step."""
    root = run_dir(run).resolve()
    folder = run_dir(run) / "checkpoints"
    if not folder.is_dir() or not _inside(root, folder):
        return []
    found = (_on_disk(child) for child in folder.iterdir() if child.is_dir() and _inside(root, child))
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def checkpoints_reported(*, run: Run) -> list[Checkpoint]:
    """The checkpoints the engine reported (`checkpoint_saved` events); a later report of a step wins. A reported
    path is the engine's word: it is measured only inside the run's folder (size None elsewhere)."""
    root = run_dir(run).resolve()
    by_step: dict[int, Checkpoint] = {}
    for event in RunEvent.objects.filter(run=run, kind=EventKind.CHECKPOINT_SAVED).order_by("seq"):
        step, path = event.payload.get("step"), event.payload.get("path")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(path, str) or not path:
            continue
        on_disk = _on_disk(Path(path)) if _inside(root, Path(path)) else None
        by_step[step] = Checkpoint(step=step, path=path, size_bytes=on_disk.size_bytes if on_disk else None,
                                   created_at=event.occurred_at)
    return [by_step[step] for step in sorted(by_step)]


def run_checkpoints(*, run: Run) -> list[Checkpoint]:
    """Every checkpoint of the run, by step: those on disk, plus those only reported (size_bytes None); each with how
    its export stands."""
    by_step = {c.step: c for c in checkpoints_reported(run=run)}
    by_step |= {c.step: c for c in checkpoints_on_disk(run=run)}
    exports = {export.step: export for export in CheckpointExport.objects.filter(run=run)}
    return [replace(by_step[step], export=_status_of(run=run, step=step, export=exports.get(step)))
            if step <= MAX_STEP else by_step[step]  # a step no export can have (the engine's word)
            for step in sorted(by_step)]


def _clean_step(step: object) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValidationFailed.on("step", "must be a checkpoint's step number (an integer, 0 or more)")
    return step


def export_folder(*, run: Run, step: int) -> Path:
    return run_dir(run) / "exports" / f"step_{step}"


def _is_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _checkpoint_at(*, run: Run, step: int) -> Checkpoint:
    """Only the run's own folder is exported from: a reported path is the engine's word, not a licence."""
    for checkpoint in checkpoints_on_disk(run=run):
        if checkpoint.step == step:
            return checkpoint
    raise NotFound(f"run {run.pk} has no checkpoint at step {step} in its run folder")


def checkpoint_export(*, actor: Actor, run: Run, step: int) -> Path:
    """Export the checkpoint at `step` as an HF folder `<run folder>/exports/step_N/` and return its path.

    An export that already exists is returned as it is. The engine's exporter runs in a subprocess; a
    failure leaves nothing behind and raises ExportFailed with the exporter's last lines.
    """
    require_project_role(actor=actor, project=run.experiment.project, minimum=Role.MEMBER,
                         action="exporting checkpoints")
    return _export(run=run, step=step, actor=actor)


def _export(*, run: Run, step: int, actor: Actor | None, requested_by: str = "") -> Path:
    """`checkpoint_export` without the permission check. `actor` None: the system exports on behalf of the project
    (the `checkpoints.export` task: everyone waiting for it was checked when they asked), and the audit record
    names who asked first (`requested_by`)."""
    step = _clean_step(step)
    checkpoint = _checkpoint_at(run=run, step=step)
    out = export_folder(run=run, step=step)
    if _is_hf_folder(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_step_{step}_{secrets.token_hex(4)}"
    env = dict(os.environ) | {"PYTHONPATH": str(REPO_DIR)}
    try:
        result = subprocess.run(
            [*ENGINE_COMMAND, "export", "--checkpoint", checkpoint.path, "--out", str(tmp)],
            cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=settings.EXPORT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportFailed(f"exporting step {step} of run {run.pk} took over {settings.EXPORT_TIMEOUT_S} s") from None
    if result.returncode != 0 or not _is_hf_folder(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise ExportFailed(f"exporting step {step} of run {run.pk} failed (exit {result.returncode}): {tail}")
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_hf_folder(out):  # else a concurrent export of the same step finished first
            raise
    audit_record(actor=actor, action="checkpoint.export", target=run, project=run.experiment.project,
                 payload={"step": step, "checkpoint": checkpoint.path, "out": str(out)}
                 | ({"requested_by": requested_by} if requested_by else {}))
    return out


@dataclass(frozen=True)
class ChildSpec:
    """What a run started from a checkpoint is: its experiment, config text and overrides, and priority."""

    experiment: Experiment
    yaml_text: str
    overrides: list[str]
    priority: int


def _child_spec(*, run: Run, step: int, overrides: Sequence[str], experiment: Experiment | None = None,
                config_yaml: str | None = None, priority: int | None = None) -> ChildSpec:
    """The child's experiment (the parent's unless given: one of the same project), its config (the parent's, with the
    parent's overrides, unless `config_yaml` is given), the exported weights as the model (`model.artifact=run:<id>@step:<n>`,
    which the resolver turns into the export folder), then `overrides`: checked before any export."""
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise ValidationFailed.on("overrides", "must be a list of section.key=value strings")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool) or not -100 <= priority <= 100):
        raise ValidationFailed.on("priority", "must be an integer from -100 to 100")
    experiment = run.experiment if experiment is None else experiment
    if experiment.project_id != run.experiment.project_id:
        raise ValidationFailed.on("experiment", f"must be an experiment of project {run.experiment.project.slug}: a "
                                                "checkpoint starts runs in its own project")
    if config_yaml is None:
        yaml_text, base = run.config.yaml_text, list(run.config.overrides)
    else:
        yaml_text, base = config_yaml, []
    child_overrides = [*base, "model.path=", f"model.artifact={run_reference(run=run, step=step)}",
                       "checkpoint.resume_from=", *overrides]
    validate_run_config(yaml_text=yaml_text, overrides=child_overrides, recipe=experiment.recipe,
                        project=experiment.project)
    return ChildSpec(experiment=experiment, yaml_text=yaml_text, overrides=child_overrides,
                     priority=run.priority if priority is None else priority)


def run_reference(*, run: Run, step: int) -> str:
    """How a config of the run's project names its checkpoint (checkpoint.resume_from) or export (model.artifact)."""
    return f"run:{run.pk}@step:{step}"


def run_launch_from_checkpoint_request(*, actor: Actor, run: Run, step: int, overrides: Sequence[str] = (),
                                       experiment: Experiment | None = None, config_yaml: str | None = None,
                                       priority: int | None = None) -> Run | ExportStatus:
    """Start a child run from the checkpoint at `step` without exporting inside the caller's request.

    The child is a run of `experiment` (any recipe, the parent's experiment by default) with `config_yaml` (the
    parent's config by default) starting from the checkpoint's weights. The checkpoint already exported: the
    child run, now. Otherwise the child waits for the export (a `PendingChildRun`), which is queued (the
    `checkpoints.export` task) unless it already is: one export serves every run asked for meanwhile, and starts
    them when it is done; the parent's timeline then says which run started, or why none could. Permission, the
    step, the experiment and the config are checked here first.
    """
    require_project_role(actor=actor, project=run.experiment.project, minimum=Role.MEMBER, action="launching runs")
    step = _clean_step(step)
    _checkpoint_at(run=run, step=step)
    _child_spec(run=run, step=step, overrides=overrides, experiment=experiment, config_yaml=config_yaml,
                priority=priority)
    with transaction.atomic():
        _lock_exports(run=run)
        status = _read_status(run=run, step=step)
        if status is None or status.state != ExportState.DONE:
            PendingChildRun.objects.create(parent=run, step=step, actor_kind=_actor_kind(actor), actor_id=actor.pk,
                                           experiment=experiment, config_yaml=config_yaml, overrides=list(overrides),
                                           priority=priority)
            if status is None or status.state == ExportState.FAILED:
                _queue_export(run=run, step=step, actor=actor)
            audit_record(actor=actor, action="checkpoint.launch_request", target=run, project=run.experiment.project,
                         payload={"step": step, "overrides": list(overrides)}
                         | ({"experiment": experiment.pk} if experiment else {}))
            return _read_status(run=run, step=step)  # type: ignore[return-value]
    return run_launch_from_checkpoint(actor=actor, run=run, step=step, overrides=overrides, experiment=experiment,
                                      config_yaml=config_yaml, priority=priority)


def run_launch_from_checkpoint(*, actor: Actor, run: Run, step: int, overrides: Sequence[str] = (),
                               experiment: Experiment | None = None, config_yaml: str | None = None,
                               priority: int | None = None) -> Run:
    """A new run starting from the weights at `step`: in the parent's experiment with the parent's config, unless
    `experiment` (same project, any recipe) and `config_yaml` say otherwise.

    The checkpoint is exported as an HF folder and becomes the model; the optimizer starts afresh
    (`checkpoint.resume_from` is cleared). `overrides` apply last. The new run's parent is `run`.
    """
    require_project_role(actor=actor, project=run.experiment.project, minimum=Role.MEMBER, action="launching runs")
    step = _clean_step(step)
    spec = _child_spec(run=run, step=step, overrides=overrides, experiment=experiment, config_yaml=config_yaml,
                       priority=priority)
    model_path = export_folder(run=run, step=step)
    checkpoint_export(actor=actor, run=run, step=step)
    with transaction.atomic():
        child = run_launch(actor=actor, experiment=spec.experiment, config_yaml=spec.yaml_text,
                           overrides=spec.overrides, priority=spec.priority, parent=run)
        audit_record(actor=actor, action="run.launch_from_checkpoint", target=child, project=run.experiment.project,
                     payload={"parent": run.pk, "step": step, "model_path": str(model_path)})
    return child


# --- export off the request ----------------------------------------------------------------------

class ExportState:
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class ExportStatus:
    run_id: int
    step: int
    state: str
    path: str | None  # the HF folder, once done
    error: str
    updated_at: datetime | None
    requeues: int = 0  # how often it was lost and queued again since it was asked for
    max_requeues: int = 0  # FORGEBOARD_EXPORT_REQUEUES: lost once more past it, it fails

    @property
    def headline(self) -> str:
        """The state in a word or two: "queued" for a fresh request, "queued again" for one that was lost."""
        if self.state == ExportState.DONE:
            return "exported"
        if self.requeues and self.state in (ExportState.QUEUED, ExportState.RUNNING):
            return f"{self.state} again"
        return self.state

    @property
    def detail(self) -> str:
        """Why it failed, or how often it was lost and queued again (empty otherwise)."""
        if self.state == ExportState.FAILED:
            return self.error
        if self.requeues and self.state in (ExportState.QUEUED, ExportState.RUNNING):
            return f"after it was lost (requeue {self.requeues} of {self.max_requeues})"
        return ""

    @property
    def summary(self) -> str:
        """How it stands, in words (the run page's checkpoints table says the same)."""
        if not self.detail:
            return self.headline
        return f"{self.headline}{':' if self.state == ExportState.FAILED else ''} {self.detail}"


def _export_row(*, run: Run, step: int) -> CheckpointExport | None:
    return CheckpointExport.objects.filter(run=run, step=step).first()


def _status_of(*, run: Run, step: int, export: CheckpointExport | None) -> ExportStatus | None:
    """Done when the export folder is complete, else what its row says (None: never asked for)."""
    out = export_folder(run=run, step=step)
    if _is_hf_folder(out):
        return ExportStatus(run_id=run.pk, step=step, state=ExportState.DONE, path=str(out), error="",
                            updated_at=datetime.fromtimestamp(out.stat().st_mtime, tz=UTC))
    if export is None:
        return None
    return ExportStatus(run_id=run.pk, step=step, state=export.state, path=None, error=export.error,
                        updated_at=export.updated_at, requeues=export.requeues,
                        max_requeues=settings.EXPORT_REQUEUES)


def _read_status(*, run: Run, step: int) -> ExportStatus | None:
    return _status_of(run=run, step=step, export=_export_row(run=run, step=step))


def checkpoint_export_status(*, actor: Actor, run: Run, step: int) -> ExportStatus:
    """Where the export of the checkpoint at `step` stands; NotFound if it was never requested nor exported."""
    require_project_role(actor=actor, project=run.experiment.project, minimum=Role.VIEWER,
                         action="reading checkpoint exports")
    step = _clean_step(step)
    status = _read_status(run=run, step=step)
    if status is None:
        raise NotFound(f"the checkpoint at step {step} of run {run.pk} was not exported nor queued for export")
    return status


def _lock_exports(*, run: Run) -> None:
    """Take the run's row lock (SQLite: the transaction's write lock), under which the status of its exports is
    read and written and the runs waiting for them are added and taken: two requests never both queue an export,
    and a run asked for while an export finishes is either taken by it or finds it done."""
    Run.objects.select_for_update(of=("self",)).filter(pk=run.pk).first()


def _actor_kind(actor: Actor) -> str:
    return "token" if isinstance(actor, ApiToken) else "user"


def _actor(*, kind: str, actor_id: int) -> Actor | None:
    model: Any = ApiToken if kind == "token" else User
    return model.objects.filter(pk=actor_id).first()


def _record_queued(*, run: Run, step: int, requested_by: str) -> int:
    """Under `_lock_exports`: record the export as queued, as a new attempt (a task message of an earlier one does
    nothing), and return the attempt."""
    export = _export_row(run=run, step=step) or CheckpointExport(run=run, step=step, attempt=0)
    export.attempt += 1
    export.state, export.error, export.requeues, export.worker = ExportState.QUEUED, "", 0, ""
    export.requested_by, export.updated_at = requested_by, timezone.now()
    export.save()
    return export.attempt


def _tell_export_state(*, run: Run, step: int) -> None:
    """Under `_lock_exports`, once the export's state changed: a `checkpoint_export` message on the run's timeline says
    how it stands now, in the words of the run page's checkpoints table (which reloads on it)."""
    status = _read_status(run=run, step=step)
    if status is not None:
        event_append(run=run, kind=EventKind.MESSAGE,
                     payload={"name": "checkpoint_export", "step": step, "state": status.state,
                              "summary": status.summary})


def _queue_export(*, run: Run, step: int, actor: Actor) -> None:
    """Under `_lock_exports`: record the export as queued and send its task once the transaction commits."""
    attempt = _record_queued(run=run, step=step, requested_by=actor_label(actor))
    _tell_export_state(run=run, step=step)
    transaction.on_commit(partial(_enqueue_export, run_id=run.pk, step=step, attempt=attempt))


def _enqueue_export(*, run_id: int, step: int, attempt: int) -> None:
    # The checkpoint is on the disk where the run ran: a worker of that host's pool exports it.
    queue = run_launch_queue(run_id=run_id)
    enqueue(CHECKPOINTS_EXPORT, args=[run_id, step], kwargs={"attempt": attempt}, queue=queue)


def checkpoint_export_request(*, actor: Actor, run: Run, step: int) -> ExportStatus:
    """Queue the export of the checkpoint at `step` (the `checkpoints.export` task) and return its status.

    Done at once when the export exists; an export already queued or running is not queued twice (one that was
    lost is queued again by the reconciler, `checkpoint_exports_reconcile`); a failed one is queued again. The task
    exports as the system, on behalf of the project: the actor was checked here.
    """
    require_project_role(actor=actor, project=run.experiment.project, minimum=Role.MEMBER,
                         action="exporting checkpoints")
    step = _clean_step(step)
    _checkpoint_at(run=run, step=step)
    with transaction.atomic():
        _lock_exports(run=run)
        status = _read_status(run=run, step=step)
        if status is not None and status.state != ExportState.FAILED:
            return status
        _queue_export(run=run, step=step, actor=actor)
        audit_record(actor=actor, action="checkpoint.export_request", target=run, project=run.experiment.project,
                     payload={"step": step})
    return _read_status(run=run, step=step)  # type: ignore[return-value]


def _this_worker() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


def checkpoint_export_queued(*, run_id: int, step: int, attempt: int) -> ExportStatus | None:
    """The task's side: take the export (queued → running, with this worker's name) unless it is another attempt's
    or no longer queued, export, and record failed with the reason (done: the folder says so); then start the runs
    asked for from this checkpoint meanwhile (`PendingChildRun`), each as the actor who asked for it, and say so on
    the parent's timeline, with the child or the reason none started.

    The export runs as the system on behalf of the project: everyone who asked was checked then, and a first asker
    who may no longer export (a token revoked or expired, a member removed) must not fail the runs of the others.
    Each run still starts as its own asker, and fails alone if that asker lost access. The audit record of the
    export names who asked first."""
    run = Run.objects.select_related("experiment__project").get(pk=run_id)
    with transaction.atomic():
        _lock_exports(run=run)
        export = _export_row(run=run, step=step)
        if export is None or export.state != ExportState.QUEUED or export.attempt != attempt:
            return _read_status(run=run, step=step)  # a copy of a message that another worker took, or a stale one
        export.state, export.worker, export.updated_at = ExportState.RUNNING, _this_worker(), timezone.now()
        export.save(update_fields=["state", "worker", "updated_at"])
        _tell_export_state(run=run, step=step)
    error = ""
    try:
        _export(run=run, step=step, actor=None, requested_by=export.requested_by)
    except ServiceError as exc:
        error = exc.message
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    with transaction.atomic():
        _lock_exports(run=run)
        export = _export_row(run=run, step=step)
        if _is_hf_folder(export_folder(run=run, step=step)):
            CheckpointExport.objects.filter(run=run, step=step).delete()  # the export folder now says done
        elif export is None or export.attempt != attempt:
            return _read_status(run=run, step=step)  # taken for lost and queued again: that attempt ends it
        else:
            export.state, export.error, export.updated_at = ExportState.FAILED, error, timezone.now()
            export.save(update_fields=["state", "error", "updated_at"])
        _tell_export_state(run=run, step=step)
        waiting = _take_waiting(run=run, step=step)
    return _start_waiting(run=run, step=step, waiting=waiting)


# Compatibility with task messages queued before exports had attempts (run, step and who asked). Migration runs 0007
# recorded the exports that runs were waiting for then as this attempt, which those messages take.
ATTEMPT_BEFORE_UPGRADE = 0


def checkpoint_export_queued_before_upgrade(*, run_id: int, step: int, actor_kind: str, actor_id: int,
                                            launch_child: bool = False, overrides: Sequence[str] = (),
                                            experiment_id: int | None = None, config_yaml: str | None = None,
                                            priority: int | None = None) -> ExportStatus | None:
    """Compatibility: the task's side of a message queued before exports had attempts. It runs the export that
    migration runs 0007 recorded (attempt 0), or one asked for then that has no record: recorded now as a new
    attempt and run here. An export queued since or running is left to its own task.

    The oldest messages, from before runs waited for exports as PendingChildRun rows, also carry a run to start from
    the export (`launch_child`: in `experiment_id` with `config_yaml`, `overrides` and `priority`, as `actor_kind`
    `actor_id`, who was checked when they asked): it waits for the export like one asked for now (a failed export
    is run again for it), or starts at once when the export is done."""
    run = Run.objects.select_related("experiment__project").get(pk=run_id)
    actor = _actor(kind=actor_kind, actor_id=actor_id)
    requested_by = actor_label(actor) if actor is not None else f"{actor_kind} {actor_id} (deleted)"
    attempt: int | None = None
    waiting: list[PendingChildRun] = []
    with transaction.atomic():
        _lock_exports(run=run)
        child_waits = False
        if launch_child:
            child_waits = _wait_as_asked_before_upgrade(
                run=run, step=step, actor_kind=actor_kind, actor_id=actor_id, overrides=overrides,
                experiment_id=experiment_id, config_yaml=config_yaml, priority=priority)
        export = _export_row(run=run, step=step)
        if export is not None and export.state == ExportState.QUEUED and export.attempt == ATTEMPT_BEFORE_UPGRADE:
            attempt = ATTEMPT_BEFORE_UPGRADE
        elif _is_hf_folder(export_folder(run=run, step=step)):
            waiting = _take_waiting(run=run, step=step)
        elif export is None or (child_waits and export.state == ExportState.FAILED):
            attempt = _record_queued(run=run, step=step, requested_by=requested_by)
        else:
            return _read_status(run=run, step=step)
    if attempt is None:
        return _start_waiting(run=run, step=step, waiting=waiting)
    return checkpoint_export_queued(run_id=run_id, step=step, attempt=attempt)


def _wait_as_asked_before_upgrade(*, run: Run, step: int, actor_kind: str, actor_id: int, overrides: Sequence[str],
                                  experiment_id: int | None, config_yaml: str | None, priority: int | None) -> bool:
    """Under `_lock_exports`: the run a message of before the upgrade asked for waits for the export (a
    PendingChildRun); False, and the parent's timeline says why, when its experiment is gone."""
    experiment = None
    if experiment_id is not None:
        experiment = Experiment.objects.filter(pk=experiment_id).first()
        if experiment is None:
            event_append(run=run, kind=EventKind.MESSAGE,
                         payload={"name": "child_run_failed", "step": step,
                                  "reason": f"experiment {experiment_id} no longer exists"})
            return False
    PendingChildRun.objects.create(parent=run, step=step, actor_kind=actor_kind, actor_id=actor_id,
                                   experiment=experiment, config_yaml=config_yaml, overrides=list(overrides),
                                   priority=priority)
    return True


def _take_waiting(*, run: Run, step: int) -> list[PendingChildRun]:
    """Under `_lock_exports`, once the export is done or failed: the runs waiting for it, no longer waiting."""
    waiting = list(PendingChildRun.objects.filter(parent=run, step=step).select_related("experiment"))
    PendingChildRun.objects.filter(pk__in=[pending.pk for pending in waiting]).delete()
    return waiting


def _start_waiting(*, run: Run, step: int, waiting: Sequence[PendingChildRun]) -> ExportStatus | None:
    status = _read_status(run=run, step=step)
    for pending in waiting:
        _launch_child(run=run, step=step, pending=pending, status=status)
    return status


def _launch_child(*, run: Run, step: int, pending: PendingChildRun, status: ExportStatus | None) -> None:
    if status is None or status.state != ExportState.DONE:
        reason = status.error if status is not None and status.error else "the export did not finish"
        event_append(run=run, kind=EventKind.MESSAGE,
                     payload={"name": "child_run_failed", "step": step, "reason": f"exporting step {step}: {reason}"})
        return
    try:
        actor = _actor(kind=pending.actor_kind, actor_id=pending.actor_id)
        if actor is None:
            raise NotFound(f"the {pending.actor_kind} that asked for this run no longer exists")
        child = run_launch_from_checkpoint(actor=actor, run=run, step=step, overrides=pending.overrides,
                                           experiment=pending.experiment, config_yaml=pending.config_yaml,
                                           priority=pending.priority)
    except ServiceError as exc:
        event_append(run=run, kind=EventKind.MESSAGE, payload={"name": "child_run_failed", "step": step, "reason": exc.message})
        return
    event_append(run=run, kind=EventKind.MESSAGE,
                 payload={"name": "child_run_started", "step": step, "run": child.pk, "number": child.number,
                          "experiment": child.experiment.name})


# --- lost exports ---------------------------------------------------------------------------------

@dataclass
class ExportsReconcileReport:
    requeued: list[tuple[int, int]] = field(default_factory=list)  # (run id, step)
    failed: list[tuple[int, int]] = field(default_factory=list)


def _lost(*, export: CheckpointExport, lost_after_s: int) -> str:
    if export.state == ExportState.RUNNING:
        return (f"running on {export.worker or 'a worker'} and not done after {lost_after_s} s (the worker stopped, "
                "or its host was lost)")
    return (f"queued for {lost_after_s} s and no worker took it (its task was lost, or no worker of its run's pool "
            "is up)")


def checkpoint_exports_reconcile(*, now: datetime) -> ExportsReconcileReport:
    """Periodic (the run reconciler's task): an export queued or running for FORGEBOARD_EXPORT_LOST_AFTER_S is lost
    (its worker was killed or ran out of memory, its host was lost, or its task message was lost). It is queued
    again, at most FORGEBOARD_EXPORT_REQUEUES times; then it fails with the reason, and each run waiting for it gets
    `child_run_failed` on the parent's timeline. An export that was complete when its worker stopped is done: the
    runs waiting for it start.

    A running export is queued again as a new attempt: its task, should it ever get on, changes nothing. A queued one
    is sent again as the same attempt: the first copy a worker takes runs it and the other does nothing, so an export
    that only waited long in its pool's queue keeps its place. The bound is past the exporter's timeout: an export
    taken for lost has stopped, and two never run at once."""
    lost_after_s = settings.EXPORT_LOST_AFTER_S
    lost_before = now - timedelta(seconds=lost_after_s)
    report = ExportsReconcileReport()
    lost = CheckpointExport.objects.filter(state__in=[ExportState.QUEUED, ExportState.RUNNING],
                                           updated_at__lt=lost_before)
    for run_id, step in list(lost.values_list("run_id", "step")):
        run = Run.objects.select_related("experiment__project").filter(pk=run_id).first()
        if run is None:
            continue  # deleted meanwhile, and its exports with it
        waiting: list[PendingChildRun] = []
        with transaction.atomic():
            _lock_exports(run=run)
            export = _export_row(run=run, step=step)
            if export is None or export.state == ExportState.FAILED or export.updated_at >= lost_before:
                continue  # it moved on meanwhile
            how = _lost(export=export, lost_after_s=lost_after_s)
            if _is_hf_folder(export_folder(run=run, step=step)):
                export.delete()
                waiting = _take_waiting(run=run, step=step)
            elif export.requeues >= settings.EXPORT_REQUEUES:
                export.state, export.updated_at = ExportState.FAILED, now
                export.error = (f"the export was lost {export.requeues + 1} times; the last time it was {how}"
                                if export.requeues else f"the export was lost: it was {how}")
                export.save()
                waiting = _take_waiting(run=run, step=step)
                report.failed.append((run_id, step))
                logger.warning("export of step %s of run %s failed: %s", step, run_id, export.error)
            else:
                if export.state == ExportState.RUNNING:
                    export.attempt += 1
                export.state, export.worker, export.updated_at = ExportState.QUEUED, "", now
                export.requeues += 1
                export.save()
                transaction.on_commit(partial(_enqueue_export, run_id=run_id, step=step, attempt=export.attempt))
                report.requeued.append((run_id, step))
                logger.warning("export of step %s of run %s queued again (%s of %s): it was %s", step, run_id,
                               export.requeues, settings.EXPORT_REQUEUES, how)
            _tell_export_state(run=run, step=step)
        _start_waiting(run=run, step=step, waiting=waiting)
    return report
