"""Where generation requests go when the trainer generates (generator.in_trainer), over a fake trainer: one request a
rank, a new publication only when the policy moved, and a failed rank's answer thrown away while draining."""

from __future__ import annotations

import pytest

from workers.engine.actors.calls import CallFailed
from workers.engine.controller.generators import RankRequest, TrainerGenerators
from workers.engine.controller.roles import role_group
from workers.engine.controller.state import RunState
from workers.engine.controller.trainer import TrainerLost
from workers.engine.training import PhaseTimer


class _Rank:
    def __init__(self, sent: list) -> None:
        self.generate = self
        self.sent = sent

    def call_one(self, *args):  # noqa: ANN002 - the generate endpoint's arguments
        self.sent.append(args)
        return args


class _Trainer:
    def __init__(self) -> None:
        self.sent: list = []

    def rank(self, rank: int) -> _Rank:
        self.sent.append(rank)
        return _Rank(self.sent)

    def result(self, future):  # noqa: ANN001, ANN201 - a fake future: its arguments, or a failure
        if future == "lost":
            raise TrainerLost(CallFailed("trainer process 7 exited", hung=False))
        return [], [("weight_load", 0.0, 0.25), ("generate", 0.25, 1.0)]


def test_ranks_take_requests_in_turn_and_a_publication_starts_only_when_the_policy_moved() -> None:
    trainer, state = _Trainer(), RunState()
    generators = TrainerGenerators(trainer=trainer, state=state, ranks=2)
    timer = PhaseTimer()
    generators.before_launch(timer)
    assert state.publications == 0, "the starting weights: the copies were made from them"
    state.policy_version = 3
    generators.before_launch(timer)
    generators.before_launch(timer)
    assert (state.publications, state.generator_version) == (1, 3)
    requests = [generators.send([[1]], None, seed=s, number=n, key="k") for n, s in enumerate((10, 11, 12))]
    assert [r.index for r in requests] == [0, 1, 0]
    assert trainer.sent[:2] == [0, ([[1]], None, 10, 1, 3)], "the publication and the policy version go with it"
    generated = generators.receive(requests[0], timer)
    assert generated.generate_seconds == pytest.approx(0.75) and timer.seconds["weight_sync"] == pytest.approx(0.25)
    assert "trainer 0" in {lane for lane, *_ in timer.spans}


def test_draining_a_lost_ranks_request_throws_it_away_and_its_failure_is_the_trainers() -> None:
    generators = TrainerGenerators(trainer=_Trainer(), state=RunState(), ranks=1)
    generators.discard(RankRequest(0, "lost", 0.0))  # no raise: the step loop recovers the trainer
    with pytest.raises(TrainerLost, match="exited"):
        generators.receive(RankRequest(0, "lost", 0.0), PhaseTimer())


def test_an_operator_command_for_a_generator_that_runs_in_the_trainer_says_why() -> None:
    with pytest.raises(ValueError, match=r"generator.in_trainer\): it has no replicas of its own; place, drain or drill"):
        role_group({"reward": object()}, "generator")
