"""Where a Monarch GRPO run's generation requests go (`generation.py` sends them, chunk by chunk):

  ReplicaGenerators  generator replicas in procs of their own, routed by their group's Service and retried elsewhere
                     when one fails (`requests.py`); the trainer publishes each new policy to their inboxes first,
                     and a request's deadline (failover.straggler_factor) counts from its replica's read's end
  TrainerGenerators  generator.in_trainer: the trainer's ranks, each generating from a copy of its own weights that
                     it refreshes in memory before the first request of a new publication; a failure is the trainer's
"""

from __future__ import annotations

import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from workers.engine.actors.replica_group import Replica, ReplicaGroup
from workers.engine.actors.weight_inbox import Fetched
from workers.engine.controller.requests import Request, Router
from workers.engine.controller.state import RunState
from workers.engine.controller.supervision import Supervisor
from workers.engine.controller.trainer import TrainerHandle, TrainerLost
from workers.engine.sampler import SamplingParams
from workers.engine.timeline import phase_seconds
from workers.engine.training import PhaseTimer


@dataclass(frozen=True)
class Generated:
    """One request's answer: its completions, and the seconds its proc spent generating them."""

    completions: list[Any]
    generate_seconds: float


def answered(lane: str, answer: tuple[list[Any], list[Any]], *, sent_at: float, timer: PhaseTimer) -> Generated:
    """A generate request's (completions, spans) answer, its spans put on the step's timeline on `lane` (`sent_at`:
    time.monotonic() when it was sent)."""
    completions, spans = answer
    now = time.time()
    timer.add_proc(lane, spans, sent=now - (time.monotonic() - sent_at), answered=now)
    return Generated(completions, phase_seconds(spans, "generate"))


@dataclass(frozen=True)
class ReplicaRequest:
    """A generation request routed to a generator replica, and the weight publication it names."""

    routed: Request
    publication: int
    reads: tuple[tuple[Replica, Any], ...] = ()  # (replica, its inbox's read of `publication`) not settled when sent

    @property
    def index(self) -> int:
        """The replica that answered it (a retry's, when its first replica failed); before an answer, the one it was
        routed to."""
        return (self.routed.answered_by or self.routed).index


class ReplicaGenerators:
    def __init__(self, *, group: ReplicaGroup, router: Router, trainer: TrainerHandle, supervisor: Supervisor,
                 state: RunState):
        self.group, self.router, self.trainer, self.supervisor, self.state = group, router, trainer, supervisor, state

    def requests_per_batch(self) -> int:
        """One request per serving replica."""
        return len(self.group.service.routable())

    def before_launch(self, timer: PhaseTimer) -> None:
        """Replace failed replicas; publish the policy when it moved since the last publication."""
        self.supervisor.repair()
        if self.state.generator_version != self.state.policy_version:
            self.publish(timer)

    def publish(self, timer: PhaseTimer) -> None:
        """The trainer ranks stage the current policy and every serving generator's inbox reads it from them. Only
        the staging is waited for (`time/weight_sync_s`, the sync's cost on the step's path, with the wait for the
        last publication's reads); each replica swaps the version in before the first request that names it,
        whatever it is still generating."""
        state = self.state
        with timer.phase("weight_sync"):
            replicas = self.group.live()
            state.publications += 1
            with timer.span_on("trainer 0", "weight_sync"):
                self.trainer.publish_weights(replicas, state.publications)
            state.generator_version = state.policy_version
            for replica in replicas:
                replica.version = state.policy_version
            self.supervisor.repair()

    def send(self, prompts: list[list[int]], params: SamplingParams, *, seed: int, number: int,
             key: str) -> ReplicaRequest:
        """`number`: the request's place in its batch (replicas are picked by the group's routing instead)."""
        publication = self.state.publications
        reads = tuple((replica, fetch) for replica, p, fetch in self.trainer.fetches.pending if p == publication)
        routed = self.router.send(self.group, lambda actor: actor.generate.call_one(prompts, params, seed, publication),
                                  key=key)
        return ReplicaRequest(routed, publication, reads)

    def receive(self, request: ReplicaRequest, timer: PhaseTimer) -> Generated:
        """The request's answer; the replica's spans go on the step's timeline (lane `generator <index>`, from when
        it was sent). TrainerLost when the trainer failed while the replica of the request, or of a retry of it, read
        the weights the request names; the attempt then still out is `discard`'s."""
        routed = request.routed
        answer = self.router.receive(routed, started=lambda attempt: self.started(attempt, request))
        by = routed.answered_by or routed  # a retry's spans are its replica's, from when the retry was sent
        return answered(f"generator {by.index}", answer, sent_at=by.sent_at, timer=timer)

    def discard(self, request: ReplicaRequest) -> None:
        """Finish the request's attempt still out (a retry's, when its first replica had failed) and throw it away."""
        attempt = request.routed.attempt
        if self.trainer.fetches.was_abandoned(attempt.replica, request.publication):
            self.router.drop(attempt)  # it fails for want of its weights: not the replica's failure
        else:
            self.router.receive(attempt, started=lambda retry: self.started(retry, request))

    def started(self, attempt: Request, request: ReplicaRequest) -> float:
        """When `attempt` (the request, or a retry of it) could start on its replica: once the replica's inbox had
        read the publication it names. A read still running as the request was sent holds the replica's generation
        up; its time is the weight sync's, not the generator's, so it is not counted towards the deadline that
        declares the replica hung. TrainerLost when the trainer failed during the read, or did not serve it
        (`TrainerHandle.await_read`): the request's first attempt's, or a retry's."""
        read = next((fetch for replica, fetch in request.reads if replica is attempt.replica), None)
        if read is None:
            return attempt.sent_at  # read before the request was sent
        self.trainer.await_read(attempt.replica, request.publication)
        ended_by = time.monotonic()
        with suppress(Exception):  # a read that failed, or still runs (its replica failed): over, as seen now
            if isinstance(fetched := read.get(timeout=0.01), Fetched):
                # it was sent before the request: it ended by the request's sending plus its own seconds at the latest
                ended_by = min(ended_by, attempt.sent_at + fetched.seconds)
        return max(attempt.sent_at, ended_by)

    def served(self) -> list[int]:
        """Requests served per replica."""
        return list(self.group.service.served)


@dataclass
class RankRequest:
    """A generation request to one trainer rank."""

    index: int  # the rank
    future: Any
    sent_at: float  # time.monotonic()


class TrainerGenerators:
    def __init__(self, *, trainer: TrainerHandle, state: RunState, ranks: int):
        self.trainer, self.state, self.ranks = trainer, state, ranks

    def requests_per_batch(self) -> int:
        """One request per rank."""
        return self.ranks

    def before_launch(self, timer: PhaseTimer) -> None:
        """A new publication when the policy moved (or was restored): each rank copies it from its own weights before
        the first request that names it, timed there (`weight_load`)."""
        state = self.state
        if state.generator_version != state.policy_version:
            state.publications += 1
            state.generator_version = state.policy_version

    def send(self, prompts: list[list[int]], params: SamplingParams, *, seed: int, number: int, key: str) -> RankRequest:
        """`number`: the request's place in its batch, which picks the rank; `key` (sticky routing) does not apply."""
        rank, state = number % self.ranks, self.state
        future = self.trainer.rank(rank).generate.call_one(prompts, params, seed, state.publications,
                                                           state.policy_version)
        return RankRequest(rank, future, time.monotonic())

    def receive(self, request: RankRequest, timer: PhaseTimer) -> Generated:
        """The rank's answer (TrainerLost when it failed); its spans go on its lane (`trainer <rank>`), its weight
        copy into the step's `time/weight_sync_s`."""
        answer = self.trainer.result(request.future)
        weight_load = phase_seconds(answer[1], "weight_load")  # the ranks copy at once: the slowest one's is the step's
        timer.seconds["weight_sync"] = max(timer.seconds.get("weight_sync", 0.0), weight_load)
        return answered(f"trainer {request.index}", answer, sent_at=request.sent_at, timer=timer)

    def discard(self, request: RankRequest) -> None:
        try:
            self.trainer.result(request.future)
        except TrainerLost:
            pass  # thrown away anyway; the trainer's recovery is the step loop's

    def served(self) -> list[int]:
        return []
