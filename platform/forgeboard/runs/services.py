"""Where a run is launched, moved between states, cancelled, and sent commands."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from django.db import transaction
from django.db.models import F, Max, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from forgeboard.accounts.models import Role
from forgeboard.accounts.permissions import Actor, actor_user, require_project_role
from forgeboard.alerts.services import alerts_for_run_state
from forgeboard.audit.services import audit_record
from forgeboard.dispatch import RUNS_LAUNCH, RUNS_START, enqueue, pool_launch_queue
from forgeboard.errors import Conflict, FieldProblem, NotFound, ValidationFailed, is_db_id
from forgeboard.experiments.models import Experiment, Recipe
from forgeboard.experiments.services import config_snapshot_create, validate_and_resolve
from forgeboard.runs.models import (
    EXTERNAL_BACKENDS,
    OPEN_COMMAND_STATES,
    Command,
    CommandKind,
    CommandState,
    LaunchBackend,
    Run,
)
from forgeboard.runs.states import COMMAND_STATES, LATE_OUTCOMES, TERMINAL_STATES, TRANSITIONS, RunState
from forgeboard.telemetry.models import EventKind
from forgeboard.telemetry.services import event_append, storable
from workers.engine.config import IN_TRAINER, RunConfig
from workers.engine.operations import OperationError, parse_operation
from workers.engine.telemetry_wire import payload_problem_at
from workers.engine.wire_limits import unstorable_in

logger = logging.getLogger(__name__)

MAX_COMMAND_PAYLOAD_BYTES = 64 * 1024
# Commands that act on the actors of a multi-process (Monarch) run; their payloads are the engine's typed operations.
OPERATION_KINDS = frozenset({CommandKind.FAULT_DRILL, CommandKind.PLACEMENT_CHANGE, CommandKind.LOAD_REDIRECT})


class IllegalTransition(Conflict):
    code = "illegal_transition"


def launch_queue_for(*, allocation: Mapping[str, Mapping[str, int]], host_pools: Mapping[str, str]) -> str | None:
    """Where a claimed run is started: the queue of the pool of its main allocated inventory host.

    The main host is the one holding the most GPUs, then the most slots, then the first by name; hosts
    missing from the inventory (the local demo's "(local)") are ignored. None: no inventory host, so the
    worker that claimed the run starts it itself, as it always did.
    """
    placed = [(name, held) for name, held in allocation.items() if name in host_pools]
    if not placed:
        return None
    name, _held = min(placed, key=lambda item: (-int(item[1].get("gpus", 0) or 0),
                                                 -int(item[1].get("slots", 0) or 0), item[0]))
    return pool_launch_queue(host_pools[name])


def run_launch_queue(*, run_id: int) -> str | None:
    """`launch_queue_for` the run's stored allocation and the current inventory."""
    from forgeboard.cluster.models import Host

    allocation, backend = Run.objects.filter(pk=run_id).values_list("allocation", "backend").first() or ({}, "")
    if backend in EXTERNAL_BACKENDS:
        return pool_launch_queue(backend)  # the workers set up to submit to that scheduler
    if not isinstance(allocation, dict) or not allocation:
        return None
    host_pools = dict(Host.objects.filter(hostname__in=list(allocation)).values_list("hostname", "pool"))
    return launch_queue_for(allocation=allocation, host_pools=host_pools)


def run_enqueue_launch(run_id: int) -> None:
    """Ask a worker to schedule the run (call it on commit).

    Any worker may schedule (the scheduler is global), so this goes to the default queue; the run's
    allocation is only known once a scheduler claims it, and then `run_enqueue_start` routes the start.
    """
    enqueue(RUNS_LAUNCH, args=[run_id])


def run_enqueue_start(*, run_id: int, queue: str) -> None:
    """Hand a claimed (launching) run to a worker of its host's pool, through that pool's queue."""
    enqueue(RUNS_START, args=[run_id], queue=queue)


def launch_backend(config: RunConfig) -> str:
    """Where a run is started: by a cluster scheduler its config names, else as a local engine (Monarch runs too)."""
    backend = config.placement.backend
    return backend if backend in EXTERNAL_BACKENDS else LaunchBackend.LOCAL


def run_launch(
    *,
    actor: Actor,
    experiment: Experiment,
    config_yaml: str,
    overrides: Sequence[str] = (),
    priority: int = 0,
    parent: Run | None = None,
    validated: tuple[RunConfig, dict[str, str]] | None = None,
) -> Run:
    """Validate (unless `validated` is what `validate_and_resolve` made of this text and these overrides for the
    experiment) and snapshot the config, create the run as queued, and enqueue its launch once committed."""
    require_project_role(actor=actor, project=experiment.project, minimum=Role.MEMBER, action="launching runs")
    if not isinstance(priority, int) or isinstance(priority, bool) or not -100 <= priority <= 100:
        raise ValidationFailed.on("priority", "must be an integer from -100 to 100")
    config, artifact_paths = validated or validate_and_resolve(
        yaml_text=config_yaml, overrides=overrides, recipe=experiment.recipe, project=experiment.project)
    with transaction.atomic():
        snapshot = config_snapshot_create(yaml_text=config_yaml, overrides=overrides, recipe=experiment.recipe,
                                          config=config)
        # Lock the experiment row so concurrent launches get distinct run numbers.
        Experiment.objects.select_for_update().filter(pk=experiment.pk).first()
        number = (Run.objects.filter(experiment=experiment).aggregate(n=Max("number"))["n"] or 0) + 1
        run = Run.objects.create(
            experiment=experiment, number=number, config=snapshot, state=RunState.QUEUED, priority=priority,
            launched_by=actor_user(actor), parent=parent, max_restarts=snapshot.run_config.max_restarts,
            placement_plan=snapshot.parsed["placement"], backend=launch_backend(snapshot.run_config),
            artifact_paths=artifact_paths,
        )
        event_append(run=run, kind=EventKind.STATE_CHANGED, payload={"from": None, "to": RunState.QUEUED})
        audit_record(actor=actor, action="run.launch", target=run, project=experiment.project,
                     payload={"config": snapshot.content_hash, "overrides": list(overrides),
                              "paths": artifact_paths})
        transaction.on_commit(lambda: run_enqueue_launch(run.pk))
    logger.info("run %s queued", run.pk, extra={"run_id": run.pk})
    return run


def run_reported_in(*, run: Run) -> None:
    """A report from a cluster run's engine while its run is launching: the scheduler started the job and the engine
    is up, so the run is running. (A local run's supervisor says so itself when it starts the engine.)"""
    if run.backend not in EXTERNAL_BACKENDS or run.state != RunState.LAUNCHING:
        return
    try:
        run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    except IllegalTransition:
        pass  # cancelled or failed meanwhile, or another report won


def run_transition(
    *, run_id: int, from_state: RunState, to_state: RunState, reason: str = "", late_outcome: bool = False,
    **fields: Any,
) -> Run:
    """Move a run from one state to another, claimed atomically: exactly one caller wins a race. `late_outcome`
    allows the one move out of an end state (states.py `LATE_OUTCOMES`), and only that."""
    allowed = LATE_OUTCOMES.get(RunState(from_state), frozenset()) if late_outcome else TRANSITIONS[RunState(from_state)]
    if to_state not in allowed:
        raise IllegalTransition(f"a run cannot go from {from_state} to {to_state}")
    now = timezone.now()
    values: dict[str, Any] = {"state": to_state, "state_changed_at": now, **fields}
    if to_state == RunState.RUNNING and from_state == RunState.LAUNCHING:
        values.setdefault("started_at", Coalesce(F("started_at"), Value(now)))  # a requeued job's run started before
    if to_state in TERMINAL_STATES:
        values.setdefault("finished_at", now)
    if reason:
        values["exit_reason"] = reason
    with transaction.atomic():
        claimed = Run.objects.filter(pk=run_id, state=from_state).update(**values)
        if claimed != 1:
            current = Run.objects.filter(pk=run_id).values_list("state", flat=True).first()
            if current is None:
                raise NotFound(f"no run {run_id}")
            raise IllegalTransition(f"run {run_id} is {current}, not {from_state}: it cannot go to {to_state}")
        run = Run.objects.get(pk=run_id)
        payload = {"from": from_state, "to": to_state} | ({"reason": reason} if reason else {})
        event_append(run=run, kind=EventKind.STATE_CHANGED, payload=payload)
        if to_state in TERMINAL_STATES or to_state == RunState.LOST:
            _commands_expire(run=run, run_state=to_state)
        if to_state in (RunState.FAILED, RunState.LOST):
            alerts_for_run_state(run=run, state=to_state)  # deliveries are sent once this commits
    return run


# A run's open commands expire once no controller will finish them: when it ends, and when it is lost, since a
# restart starts a new controller from the last checkpoint and does not hand it what the lost one was sent. A fault
# drill, a placement change or a redirect names the processes, replicas and hosts of the controller that was lost, and
# a drill fired at the new one minutes later is a fault nobody asked for then; a checkpoint, pause or resume asked of
# the lost controller means nothing to a run that resumes from its last checkpoint. The operator sends again what is
# still wanted. A cancel is never among them: a run being cancelled is not lost but ends cancelled (runs/reconcile.py).
_HOW_IT_ENDED = {
    RunState.SUCCEEDED: "the run succeeded", RunState.FAILED: "the run failed",
    RunState.CANCELLED: "the run was cancelled", RunState.LOST: "the run was lost",
}


def _commands_expire(*, run: Run, run_state: RunState) -> None:
    """Expire the run's open commands (the caller changed its state in this transaction), each with an event that
    the run page follows and a reason in words."""
    commands = Command.objects.select_for_update().filter(run=run, state__in=OPEN_COMMAND_STATES).order_by("pk")
    for command in commands:
        taken = command.state == CommandState.DELIVERED
        reason = _HOW_IT_ENDED[run_state] + (
            " after its controller took this command but before it reported a result (it may have run)" if taken
            else " before its controller took this command")
        if run_state == RunState.LOST:
            reason += "; a restarted run does not get it again"
        command.state, command.result = CommandState.EXPIRED, {"reason": reason}
        command.save(update_fields=["state", "result"])
        event_append(run=run, kind=EventKind.COMMAND_FINISHED,
                     payload={"command": command.pk, "kind": command.kind, "ok": False,
                              "state": CommandState.EXPIRED, "result": command.result})


def run_cancel(*, actor: Actor, run: Run) -> Run:
    require_project_role(actor=actor, project=run.experiment.project, minimum=Role.MEMBER, action="cancelling runs")
    with transaction.atomic():
        _lock_run(run)  # a claim or another cancel in flight commits first: this one acts on the state it left
        if run.state in TERMINAL_STATES:
            raise Conflict(f"run {run.pk} already ended ({run.state})")
        if run.state == RunState.QUEUED:
            run = run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.CANCELLED,
                                 reason="cancelled before launch")
        elif run.state != RunState.CANCELLING:
            run = run_transition(run_id=run.pk, from_state=RunState(run.state), to_state=RunState.CANCELLING)
            _command_insert(actor=actor, run=run, kind=CommandKind.CANCEL, payload={})
        audit_record(actor=actor, action="run.cancel", target=run, project=run.experiment.project)
    return run


def _lock_run(run: Run) -> None:
    """Read the run's current state and hold its row to the end of the transaction (run_transition waits for it)."""
    run.refresh_from_db(from_queryset=Run.objects.select_for_update(of=("self",)))


def _command_insert(*, actor: Actor, run: Run, kind: CommandKind, payload: dict[str, Any]) -> Command:
    command = Command.objects.create(run=run, kind=kind, payload=payload, created_by=actor_user(actor))
    # Who sent what: the run page adds the command's row to its table from this event.
    by = command.created_by.username if command.created_by else None
    event_append(run=run, kind=EventKind.COMMAND_ISSUED,
                 payload={"command": command.pk, "kind": kind, "by": by, "payload": payload})
    return command


def command_create(*, actor: Actor, run: Run, kind: str, payload: dict[str, Any] | None = None) -> Command:
    """Queue an operator command for a live run; the controller pulls, acknowledges and executes it once."""
    require_project_role(actor=actor, project=run.experiment.project, minimum=Role.MEMBER, action="sending commands")
    if kind not in CommandKind.values:
        raise ValidationFailed.on("kind", f"unknown command {kind!r}: choose one of {', '.join(CommandKind.values)}")
    if kind == CommandKind.CANCEL:
        raise ValidationFailed.on("kind", "cancel a run with the cancel action, which also handles queued runs")
    payload = payload or {}
    if not isinstance(payload, dict):
        raise ValidationFailed.on("payload", "must be an object")
    if unstorable := unstorable_in(payload):
        raise ValidationFailed.on("payload", unstorable)
    if problem := payload_problem_at(payload):  # an integer no float holds: the engine and the pages read floats
        raise ValidationFailed.on(*problem)
    if len(json.dumps(payload)) > MAX_COMMAND_PAYLOAD_BYTES:
        raise ValidationFailed.on("payload", f"over {MAX_COMMAND_PAYLOAD_BYTES} bytes")
    if kind in OPERATION_KINDS:
        _check_operation(run=run, kind=kind, payload=payload)
    with transaction.atomic():
        _lock_run(run)
        if run.state not in COMMAND_STATES:
            raise Conflict(f"run {run.pk} is {run.state}: commands go to launching, running or paused runs")
        command = _command_insert(actor=actor, run=run, kind=CommandKind(kind), payload=payload)
        audit_record(actor=actor, action=f"command.{kind}", target=command, project=run.experiment.project,
                     payload=payload)
    return command


def _check_operation(*, run: Run, kind: str, payload: dict[str, Any]) -> None:
    """Refuse, before storing, an operation the engine would refuse: a bad payload or a run that cannot do it."""
    try:
        parse_operation(kind, payload)
    except OperationError as error:
        problems = [FieldProblem(f"payload.{e.field}" if e.field else "payload", e.message) for e in error.errors]
        raise ValidationFailed("invalid " + kind.replace("_", " ") + ": " + "; ".join(
            f"{p.field}: {p.message}" for p in problems), problems=problems) from None
    config = run.config.run_config
    backend = config.placement.backend
    if backend == LaunchBackend.LOCAL:
        raise Conflict(f"run {run.pk} runs in a single process (placement.backend {backend!r}): "
                       f"{kind.replace('_', ' ')} needs placement.backend monarch")
    if config.recipe == Recipe.SFT:
        _check_sft_operation(run=run, kind=kind, payload=payload)
    elif config.generator.in_trainer and kind != CommandKind.LOAD_REDIRECT and payload.get("role") == "generator":
        raise ValidationFailed.on("payload.role", f"{IN_TRAINER}: it has no replicas of its own; "
                                                  + ("drill the trainer" if kind == CommandKind.FAULT_DRILL else
                                                     "place the reward or the reference"))


def _check_sft_operation(*, run: Run, kind: str, payload: dict[str, Any]) -> None:
    """An SFT run has trainer ranks only: drills target them, a drain moves them, there are no replicas to place."""
    if kind == CommandKind.PLACEMENT_CHANGE:
        raise Conflict(f"run {run.pk} is an SFT run: it has only trainer ranks, no replicas to place "
                       "(drain a host to move the trainer at its next checkpoint)")
    if kind == CommandKind.FAULT_DRILL and payload.get("role") != "trainer":
        raise ValidationFailed.on("payload.role", f"an SFT run has no {payload.get('role')}: its drills target "
                                                  "trainer ranks")


def command_acknowledge(*, run: Run, command_id: int) -> Command:
    """Mark a command delivered to the controller. Repeating it is harmless (at-least-once delivery), and so is
    acknowledging a finished or expired one: it stays as it is, and the answer says so (`command_ack_refusal`).
    NotFound, naming the field command_id, when the run has no such command."""
    now = timezone.now()
    with transaction.atomic():
        _lock_run(run)  # the run's row before the command's: the order run_transition takes them in
        command = _command_locked(run=run, command_id=command_id)
        command.delivery_count += 1
        if command.state == CommandState.PENDING:
            command.state, command.delivered_at, command.acknowledged_at = CommandState.DELIVERED, now, now
            event_append(run=run, kind=EventKind.COMMAND_ACKNOWLEDGED, payload={"command": command.pk})
        command.save()
    return command


def command_ack_refusal(*, command: Command) -> str:
    """Why the controller that acknowledged `command` must not run it; empty when it is delivered to that controller
    (the only controller of its run: a restarted run's new controller never sees the lost one's commands)."""
    if command.state == CommandState.EXPIRED:
        return command.result.get("reason") or "it expired"
    if command.state in (CommandState.SUCCEEDED, CommandState.FAILED):
        return f"it has a result already ({command.state})"
    return ""


def _command_locked(*, run: Run, command_id: int) -> Command:
    """The run's command, its row held to the end of the transaction; NotFound naming command_id if it has none."""
    command = None
    if is_db_id(command_id):
        command = Command.objects.select_for_update().filter(pk=command_id, run=run).first()
    if command is None:
        raise NotFound(f"run {run.pk} has no command {command_id}",
                       problems=[FieldProblem("command_id", "no command of this run has this id")])
    return command


def command_finish(*, run: Run, command_id: int, ok: bool, result: dict[str, Any]) -> Command:
    """Record a command's outcome once; a repeated report of a finished command changes nothing.

    A report for an expired command (its run was lost while the controller ran it, and the controller reports
    afterwards) is recorded too: the controller writes down what it ran before it reports (the engine's
    CommandChannel ledger), so its outcome is the truth, and a drill that really fired must show. It changes the
    command only: a late pause or resume moves no run, whose controller is gone.
    """
    if problem := payload_problem_at(result, root="result"):
        raise ValidationFailed.on(*problem)
    if len(json.dumps(result)) > MAX_COMMAND_PAYLOAD_BYTES:
        raise ValidationFailed.on("result", f"over {MAX_COMMAND_PAYLOAD_BYTES} bytes")
    now = timezone.now()
    with transaction.atomic():
        _lock_run(run)  # the run's row before the command's: the order run_transition takes them in
        command = _command_locked(run=run, command_id=command_id)
        if command.state in (CommandState.SUCCEEDED, CommandState.FAILED):
            return command
        expired = command.result.get("reason", "") if command.state == CommandState.EXPIRED else None
        command.acknowledged_at = command.acknowledged_at or now
        command.delivered_at = command.delivered_at or now
        command.state = CommandState.SUCCEEDED if ok else CommandState.FAILED
        command.result = storable(result)
        command.save()
        payload = {"command": command.pk, "kind": command.kind, "ok": ok, "result": result}
        if expired is not None:
            payload["late"] = expired  # why it had expired
        event_append(run=run, kind=EventKind.COMMAND_FINISHED, payload=payload)
        if ok and command.kind in PAUSE_RESUME and expired is None:
            source, target = PAUSE_RESUME[command.kind]
            try:
                run_transition(run_id=run.pk, from_state=source, to_state=target)
            except IllegalTransition:
                pass  # cancelled or ended meanwhile: the newer state stands
    return command


# A pause or resume takes effect when the controller reports it done, not when it is asked for.
PAUSE_RESUME = {
    CommandKind.PAUSE: (RunState.RUNNING, RunState.PAUSED),
    CommandKind.RESUME: (RunState.PAUSED, RunState.RUNNING),
}
