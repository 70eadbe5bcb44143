"""Run states: only the transitions in the table are allowed, and a claim is won by exactly one caller."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from forgeboard.errors import Conflict
from forgeboard.runs.models import Command, CommandKind, Run
from forgeboard.runs.services import IllegalTransition, command_create, run_cancel, run_launch, run_transition
from forgeboard.runs.states import LATE_OUTCOMES, TERMINAL_STATES, TRANSITIONS, RunState
from forgeboard.telemetry.models import RunEvent
from tests.support.races import racing_an_open_transaction

ALL_PAIRS = [(a, b) for a in RunState for b in RunState]


def _run_in_state(team, grpo_yaml, state: RunState) -> Run:
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(state=state)
    return run


@pytest.mark.parametrize(("source", "target"), ALL_PAIRS, ids=[f"{a}->{b}" for a, b in ALL_PAIRS])
def test_transition_table_is_enforced(team, grpo_yaml, source, target):
    run = _run_in_state(team, grpo_yaml, source)
    if target in TRANSITIONS[source]:
        moved = run_transition(run_id=run.pk, from_state=source, to_state=target)
        assert moved.state == target
        last = RunEvent.objects.filter(run=run).order_by("-seq").first()
        assert last.payload == {"from": source, "to": target}
        if target in TERMINAL_STATES:
            assert moved.finished_at is not None
    else:
        with pytest.raises(IllegalTransition, match=f"from {source} to {target}"):
            run_transition(run_id=run.pk, from_state=source, to_state=target)
        assert Run.objects.get(pk=run.pk).state == source


@pytest.mark.parametrize(("source", "target"), ALL_PAIRS, ids=[f"{a}->{b}" for a, b in ALL_PAIRS])
def test_a_late_outcome_is_the_one_move_out_of_an_end_state_and_nothing_else(team, grpo_yaml, source, target):
    """failed -> succeeded (a run failed for being lost whose attempt then finished) only with late_outcome; that
    flag allows no other move, not even one of the table's."""
    run = _run_in_state(team, grpo_yaml, source)
    if (source, target) == (RunState.FAILED, RunState.SUCCEEDED):
        with pytest.raises(IllegalTransition):
            run_transition(run_id=run.pk, from_state=source, to_state=target)
        assert run_transition(run_id=run.pk, from_state=source, to_state=target, late_outcome=True).state == target
        return
    assert target not in LATE_OUTCOMES.get(source, ())
    with pytest.raises(IllegalTransition, match=f"from {source} to {target}"):
        run_transition(run_id=run.pk, from_state=source, to_state=target, late_outcome=True)
    assert Run.objects.get(pk=run.pk).state == source


def test_claim_from_a_stale_state_is_refused(team, grpo_yaml):
    run = _run_in_state(team, grpo_yaml, RunState.RUNNING)
    with pytest.raises(IllegalTransition, match="is running, not queued"):
        run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING)
    assert Run.objects.get(pk=run.pk).state == RunState.RUNNING


def test_terminal_states_have_no_way_out():
    assert TERMINAL_STATES == {RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED}
    for state in RunState:
        assert state in TRANSITIONS, f"{state} missing from the transition table"


@pytest.mark.django_db(transaction=True)
def test_concurrent_claims_of_one_queued_run_have_exactly_one_winner(team, grpo_yaml):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    contenders = 8
    barrier = threading.Barrier(contenders)
    outcomes: list[str] = []
    lock = threading.Lock()

    def claim() -> None:
        try:
            barrier.wait()
            run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING)
            result = "won"
        except IllegalTransition:
            result = "lost"
        finally:
            connection.close()
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=claim) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["lost"] * (contenders - 1) + ["won"]
    assert Run.objects.get(pk=run.pk).state == RunState.LAUNCHING
    claims = RunEvent.objects.filter(run=run, kind="state_changed", payload__to=RunState.LAUNCHING)
    assert claims.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_cancel_racing_the_schedulers_claim_cancels_the_run_it_finds(team, grpo_yaml):
    """The scheduler claims a queued run while its cancel is on the way: the cancel waits for the claim and cancels
    the launching run (it was refused, 409 'is launching, not queued', though a launching run can be cancelled)."""
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    outcome = racing_an_open_transaction(
        lambda: run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING),
        lambda: run_cancel(actor=team.member, run=Run.objects.get(pk=run.pk)))
    assert isinstance(outcome, Run) and outcome.state == RunState.CANCELLING, outcome
    assert Run.objects.get(pk=run.pk).state == RunState.CANCELLING
    assert list(Command.objects.filter(run=run).values_list("kind", flat=True)) == [CommandKind.CANCEL]


@pytest.mark.django_db(transaction=True)
def test_a_command_racing_a_cancel_is_refused_once_the_run_is_cancelling(team, grpo_yaml):
    """A pause sent while the run's cancel is being stored read the run as running and was queued behind the cancel,
    a pending command on a cancelling run; now it waits for the cancel and gets its 409."""
    run = _run_in_state(team, grpo_yaml, RunState.RUNNING)
    outcome = racing_an_open_transaction(
        lambda: run_cancel(actor=team.owner, run=Run.objects.get(pk=run.pk)),
        lambda: command_create(actor=team.member, run=Run.objects.get(pk=run.pk), kind=CommandKind.PAUSE))
    assert isinstance(outcome, Conflict) and "is cancelling" in str(outcome), outcome
    assert list(Command.objects.filter(run=run).values_list("kind", flat=True)) == [CommandKind.CANCEL]
