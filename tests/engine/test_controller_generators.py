"""Generation requests to generator replicas over fake hosts, with failover's straggler deadline on: a replica's read
of the weights a request names is the weight sync's time, not the generator's."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from tests.engine.fake_fleet import FakeEndpoint, FakeHosts, Fleet, controller_parts, fake_group, grpo_config
from workers.engine.actors.weight_inbox import Fetched
from workers.engine.controller.drill_targets import DrillTargets
from workers.engine.controller.generation import GenerationPipeline
from workers.engine.controller.generators import ReplicaGenerators
from workers.engine.controller.requests import Router
from workers.engine.controller.state import PendingGeneration
from workers.engine.drills import DrillPlan
from workers.engine.training import PhaseTimer

DEADLINE_S = 0.5  # failover.straggler_min_s: the deadline of a role whose requests take GENERATE_S
GENERATE_S = DEADLINE_S / 5  # straggler_factor 2 x GENERATE_S is under DEADLINE_S
COMPLETION = SimpleNamespace(token_ids=[5, 6, 7])
READ_S = 3 * DEADLINE_S  # a big model's weights over a busy network: the read succeeds, slower than the deadline


class _Clocked:
    """A call answered at a time.monotonic() `at` (None: never); `get` blocks up to its timeout, as Monarch's does."""

    at: float | None

    def answer(self) -> Any:
        raise NotImplementedError

    def get(self, timeout: float | None = None) -> Any:
        left = float("inf") if self.at is None else self.at - time.monotonic()
        if left > 0:
            time.sleep(min(left, timeout if timeout is not None else left))
            if self.at is None or time.monotonic() < self.at:
                raise TimeoutError
        return self.answer()


class _Read(_Clocked):
    """An inbox's read of a publication, taking `seconds`."""

    def __init__(self, publication: Any, seconds: float) -> None:
        self.publication, self.seconds = publication, seconds
        self.began, self.at = time.monotonic(), time.monotonic() + seconds

    def answer(self) -> Fetched:
        return Fetched(publication=self.publication.number, nbytes=self.publication.nbytes, seconds=self.seconds)


class _Generate(_Clocked):
    """A generate request: it waits on its replica for the read of the weights it names (`weight_load`), then
    generates for `seconds` (None: hangs)."""

    def __init__(self, read: _Read | None, seconds: float | None) -> None:
        self.sent_wall = time.time()
        self.loaded = read.at if read is not None else time.monotonic()
        self.at = None if seconds is None else self.loaded + seconds

    def answer(self) -> tuple[list[Any], list[Any]]:
        loaded_wall = time.time() - (time.monotonic() - self.loaded)
        return [COMPLETION], [("weight_load", self.sent_wall, loaded_wall), ("generate", loaded_wall, time.time())]


class _Replicas:
    """The two generator replicas: their inboxes read every publication in `read_s`, replica i generates in
    `generate_s[i]` once it has the weights."""

    def __init__(self, fleet: Fleet, *, read_s: float, generate_s: list[float | None]) -> None:
        self.reads: dict[int, _Read] = {}
        self.generated: list[int] = []
        self.generate_s = generate_s
        for replica in fleet.groups["generator"].replicas:
            replica.inbox.fetch.call_one = lambda publication, i=replica.index: self._read(i, publication, read_s)
            replica.actor.generate.call_one = lambda *args, i=replica.index: self._generate(i, self.generate_s[i])

    def _read(self, index: int, publication: Any, seconds: float) -> _Read:
        self.reads[index] = _Read(publication, seconds)
        return self.reads[index]

    def _generate(self, index: int, seconds: float | None) -> _Generate:
        self.generated.append(index)
        return _Generate(self.reads.get(index), seconds)


def _pipeline(**failover: float) -> tuple[Fleet, GenerationPipeline]:
    options = {"call_timeout_s": 30, "poll_seconds": 0.02, "straggler_factor": 2, "straggler_min_s": DEADLINE_S,
               "retry_backoff_s": 0, **failover}
    config = grpo_config(failover="{" + ", ".join(f"{k}: {v}" for k, v in options.items()) + "}")
    hosts = FakeHosts(["a", "b", "c"])
    groups = {"generator": fake_group("generator", hosts, ["a", "b"], generate=([COMPLETION], []), take_weights=1),
              "reward": fake_group("reward", hosts, ["c"], score="record")}
    fleet = controller_parts(config, hosts, groups, trainer_hosts=["c"], control_host="c")
    fleet.failover.config = config.failover
    fleet.waits.ticks = [fleet.supervisor.tick]
    fleet.control.buffer.put = FakeEndpoint(None)
    fleet.router = Router(failover=fleet.failover, waits=fleet.waits, supervisor=fleet.supervisor)
    drills = DrillTargets(plan=DrillPlan([]), injector=fleet.injector, recorder=fleet.recorder, hosts=hosts,
                          groups=groups, placer=fleet.placer, trainer=fleet.trainer, state=fleet.state)
    generators = ReplicaGenerators(group=groups["generator"], router=fleet.router, trainer=fleet.trainer,
                                   supervisor=fleet.supervisor, state=fleet.state)
    return fleet, GenerationPipeline(config=config, tokenizer=None, groups=groups, generators=generators,
                                     trainer=fleet.trainer, control=fleet.control, router=fleet.router, drills=drills,
                                     state=fleet.state)


def _generation(fleet: Fleet, pipeline: GenerationPipeline) -> PendingGeneration:
    """One request to each replica, naming the current publication, as `GenerationPipeline.launch` sends them."""
    pipeline.generators.before_launch(PhaseTimer())
    calls = [pipeline.generators.send([[1]] * 4, None, seed=s, number=s, key=f"k{s}") for s in range(2)]
    return PendingGeneration([], [[1]] * 8, calls, {"position": 8}, 0, [(0, 1), (1, 2)])


def _typical_request_takes_no_time(fleet: Fleet, pipeline: GenerationPipeline) -> None:
    """A first generation from the starting weights (nothing to read): the deadline is straggler_min_s from then on."""
    pipeline.finish(_generation(fleet, pipeline), PhaseTimer())
    service = fleet.groups["generator"].service
    assert service.typical_seconds() is not None and service.typical_seconds() * 2 < DEADLINE_S


def test_a_weight_read_slower_than_the_straggler_deadline_that_succeeds_blames_no_generator():
    """The replicas read the new policy for longer than a request's straggler deadline, then each generates well
    within it. Before, the deadline counted from when the request was sent, the read included: the healthy replica
    was declared hung, killed and replaced, its request retried elsewhere."""
    fleet, pipeline = _pipeline()
    replicas = _Replicas(fleet, read_s=READ_S, generate_s=[GENERATE_S, GENERATE_S])
    _typical_request_takes_no_time(fleet, pipeline)
    fleet.state.policy_version = 1
    generation = _generation(fleet, pipeline)
    assert fleet.trainer.fetches.pending and fleet.state.publications == 1, "the replicas read publication 1"
    timer = PhaseTimer()
    tokens = pipeline.finish(generation, timer).tokens
    assert fleet.events("failure_detected") == [], "no generator is blamed for the read's time"
    assert not any(replica.failed for replica in fleet.groups["generator"].replicas)
    assert fleet.failover.replacements.get("generator", 0) == 0 and fleet.state.totals.samples_dropped == 0
    assert replicas.generated == [0, 1, 0, 1], "each request answered by its replica, none retried"
    assert tokens == 6 and fleet.control.buffer.put.calls == [("record",)] * 2
    service = fleet.groups["generator"].service
    assert service.in_flight == [0, 0] and all(s < DEADLINE_S for s in service.seconds_per_request), \
        "a request's seconds, which set the next deadlines, count from the end of the read too"
    for index in (0, 1):  # the timeline shows each request from when it was sent: waiting for its weights first
        load = next(span for span in timer.spans if span[:2] == (f"generator {index}", "weight_load"))
        assert load[3] - load[2] > READ_S / 2


def test_a_generator_slow_after_its_weight_read_ended_is_still_a_straggler():
    """The same slow read; replica 0 then never answers. Its deadline counts from the read's end: it is declared hung
    there (not at failover.call_timeout_s) and the request is served by replica 1."""
    fleet, pipeline = _pipeline()
    replicas = _Replicas(fleet, read_s=READ_S, generate_s=[GENERATE_S, GENERATE_S])
    _typical_request_takes_no_time(fleet, pipeline)
    replicas.generate_s[0] = None
    fleet.state.policy_version = 1
    generation = _generation(fleet, pipeline)
    started, timer = time.monotonic(), PhaseTimer()
    pipeline.finish(generation, timer)
    assert time.monotonic() - started < fleet.failover.config.call_timeout_s / 2, "the straggler deadline, not the call's"
    [failure] = fleet.events("failure_detected")
    assert (failure["role"], failure["replica"], failure["hung"]) == ("generator", 0, True)
    assert fleet.failover.replacements.get("generator") == 1 and fleet.state.totals.samples_dropped == 0
    assert replicas.generated == [0, 1, 0, 1, 1], "replica 0's request retried on replica 1"
    assert [call.index for call in generation.calls] == [1, 1], "each answered by replica 1"
    generated = [lane for lane, phase, _, _ in timer.spans if phase == "generate"]
    assert generated == ["generator 1", "generator 1"], "the retry's spans drawn on the lane of the replica that answered"


def test_a_request_received_after_the_next_publication_settled_its_read_still_does_not_count_the_read():
    """Async: a generation names publication 1, the next launch publishes 2 (waiting for the reads of 1 first), and
    only then is the first generation received, its replicas still generating. The reads of 1 are no longer pending;
    what each took still does not count towards the requests' deadlines."""
    fleet, pipeline = _pipeline()
    _Replicas(fleet, read_s=READ_S, generate_s=[GENERATE_S, GENERATE_S])
    _typical_request_takes_no_time(fleet, pipeline)
    fleet.state.policy_version = 1
    first = _generation(fleet, pipeline)
    fleet.state.policy_version = 2
    second = _generation(fleet, pipeline)
    assert {publication for _, publication, _ in fleet.trainer.fetches.pending} == {2}, "the reads of 1 settled"
    for generation in (first, second):
        pipeline.finish(generation, PhaseTimer())
    assert fleet.events("failure_detected") == [] and fleet.failover.replacements.get("generator", 0) == 0
