"""Weight sync through a generator's inbox: publications are read from the trainer ranks beside the request queue
and taken in order."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from tests.engine.fake_fleet import Done, FakeActor
from tests.support.staging_rank import StagingRank, seeded_state
from workers.engine.actors.replica_group import Replica
from workers.engine.actors.weight_inbox import PolicySlot, PublicationLost


def test_the_slot_gives_the_named_publication_and_drops_the_older_ones() -> None:
    slot = PolicySlot()
    slot.put(1, 1, {"w": 1})
    slot.put(2, 2, {"w": 2})
    slot.put(3, 1, {"w": "restored"})  # a restore publishes an older policy version again
    assert slot.held() == [1, 2, 3]
    assert slot.take(2) == (2, {"w": 2})
    assert slot.held() == [3] and slot.taken == 2
    slot.put(1, 1, {"w": 1})
    assert slot.held() == [3], "a publication older than the one taken is never kept"
    assert slot.take(3) == (1, {"w": "restored"})


def test_a_publication_that_will_not_arrive_fails_its_requests_with_the_reason_and_only_an_inbox_is_waited_for() -> None:
    slot = PolicySlot()
    slot.put(2, 2, {"w": 2})
    slot.abandon(2, why="not this one: it arrived")
    slot.abandon(1, why="could not be read from the trainer ranks within 5 s")
    with pytest.raises(PublicationLost, match="publication 1 will not reach this generator: could not be read from"):
        slot.take(1)
    assert slot.take(2) == (2, {"w": 2}), "one that arrived is kept"
    with pytest.raises(RuntimeError, match="publication 3 is named, but no weight inbox runs on this proc"):
        slot.take(3)  # no inbox set the slot's wait: nothing would ever arrive
    slot.wait_s = 0.05
    with pytest.raises(TimeoutError, match="publication 3 did not reach this generator in 0 s"):
        slot.take(3)


def test_a_failure_report_of_a_generators_inbox_is_the_generators() -> None:
    replica = Replica("generator", 0, "a", 1, "generator_0_1", procs=None, actor=FakeActor(1, name="generator_0_1"),
                      inbox=FakeActor(2, name="generator_0_1_inbox"))
    assert replica.owns("generator_0_1_inbox-0") and replica.owns("generator_0_1-0")
    assert not replica.owns("generator_0_11_inbox-0") and not replica.owns("generator_0_11-0")


def test_a_report_from_an_earlier_spawn_of_the_same_name_is_not_the_replicas() -> None:
    """A run's procs stopped by SIGTERM report their deaths after the run; the next run in the same process names its
    replicas alike (`generator_0_1`), but Monarch gives every spawn its own suffix."""
    replica = Replica("generator", 0, "a", 1, "generator_0_1", procs=None, actor=FakeActor(1, name="generator_0_1"))
    assert replica.owns("generator_0_1-0") and not replica.owns("generator_0_1-Zq81xw")
    unnamed = Replica("generator", 0, "a", 1, "generator_0_1", procs=None, actor=FakeActor(1))
    assert unnamed.owns("generator_0_1-x8Yz") and not unnamed.owns("generator_0_11-x8Yz"), "no spawned name: by name"
    died = FakeActor(1)
    died._name = Done(error=RuntimeError("the proc died while spawning"))
    unreadable = Replica("generator", 0, "a", 1, "generator_0_1", procs=None, actor=died)
    assert unreadable.owns("generator_0_1-x8Yz") and not unreadable.owns("generator_0_11-x8Yz"), "unreadable: by name"


def test_a_request_waits_for_a_publication_still_on_its_way_and_gives_up_with_the_reason() -> None:
    slot = PolicySlot()
    threading.Timer(0.2, lambda: slot.put(1, 4, {"w": 4})).start()
    start = time.perf_counter()
    assert slot.take(1, timeout_s=10) == (4, {"w": 4})
    assert 0.1 < time.perf_counter() - start < 5
    with pytest.raises(TimeoutError, match=r"publication 2 did not reach this generator .*held here: \[\]"):
        slot.take(2, timeout_s=0.05)


def test_a_rank_stages_into_the_same_memory_only_when_every_read_ended_and_the_layout_holds() -> None:
    from workers.engine.actors.weight_outbox import WeightOutbox

    outbox = WeightOutbox()
    try:
        outbox.stage(seeded_state(1), rank=0, world=1, sharded=False, reuse=True)
        first = outbox.staged[1].data_ptr()
        outbox.stage(seeded_state(2), rank=0, world=1, sharded=False, reuse=True)
        assert outbox.staged[1].data_ptr() == first, "the last publication's memory, its registrations kept"
        still_read = outbox.staged[1]  # a reader that did not end holds this memory
        before = still_read.clone()
        outbox.stage(seeded_state(3), rank=0, world=1, sharded=False, reuse=False)
        assert outbox.staged[1].data_ptr() != still_read.data_ptr(), "a read that did not end may still be reading it"
        assert torch.equal(still_read, before), "the unfinished read still sees publication 2"
        del still_read, before
        second = outbox.staged[1].data_ptr()
        outbox.stage({"embed": torch.zeros(8)}, rank=0, world=1, sharded=False, reuse=True)
        assert outbox.staged[1].data_ptr() != second and outbox.staged[0].nbytes == 64, "another layout"
        assert outbox.stage({"embed": torch.zeros(8)}, rank=1, world=2, sharded=False, reuse=True) is None
        assert outbox.staged is None, "a rank that serves nothing keeps nothing"
    finally:
        outbox.drop()


def test_an_inbox_reads_a_part_of_several_chunks_from_another_proc_exactly() -> None:
    """10 MiB of weights in three RDMA chunks; a second publication is staged into the first one's memory once it was
    read."""
    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.weight_outbox import WeightPublication, read_publication

    procs = spawn_procs(1, threads=1)
    try:
        rank = procs.spawn("staging", StagingRank)
        reads = []
        for publication, seed in ((1, 3), (2, 4)):
            part = rank.stage.call_one(seed).get(timeout=60)  # the second into the first one's memory
            reads.append((seed, len(part.buffers), read_publication(
                WeightPublication(number=publication, version=seed, parts=(part,), read_timeout_s=60))[0]))
    finally:
        procs.stop().get()
    for seed, chunks, read in reads:
        expected = seeded_state(seed)
        assert chunks == 3 and list(read) == list(expected)
        assert all(read[k].dtype == expected[k].dtype and torch.equal(read[k], expected[k]) for k in expected)


def test_new_weights_reach_a_busy_generator_without_waiting_behind_its_queued_requests(tiny_qwen3: Path) -> None:
    """Two long requests queued on one replica; the publication staged while the first runs is read by the inbox
    (over Monarch's RDMA, from this process's memory) before the first ends, and the second request (naming it) is
    generated by exactly those weights."""
    from workers.engine.actors.generator import GeneratorActor
    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.weight_inbox import WeightInboxActor
    from workers.engine.actors.weight_outbox import WeightOutbox, WeightPublication
    from workers.engine.fused_head import model_logprobs
    from workers.engine.models.hf_folder import load_pretrained
    from workers.engine.sampler import SamplingParams

    loaded = load_pretrained(tiny_qwen3)
    weights = {name: tensor * 0.5 for name, tensor in loaded.model.state_dict().items()}
    outbox = WeightOutbox()
    prompts = [loaded.tokenizer.encode_prompt([{"role": "user", "content": "1+2="}])] * 32
    params = SamplingParams(max_new_tokens=64, temperature=1.0)
    procs = spawn_procs(1, threads=1)
    try:
        generator = procs.spawn("generator", GeneratorActor, str(tiny_qwen3), "float32", "cpu")
        inbox = procs.spawn("inbox", WeightInboxActor, 60.0)
        generator.generate.call_one(prompts[:1], SamplingParams(max_new_tokens=1), 0).get(timeout=120)  # warm
        assert inbox.held.call_one().get(timeout=60) == []
        started = time.perf_counter()
        first_call = generator.generate.call_one(prompts, params, 0, 0)
        second_call = generator.generate.call_one(prompts, params, 1, 1)
        part = outbox.stage(weights, rank=0, world=1, sharded=False, reuse=True)
        fetched = inbox.fetch.call_one(WeightPublication(number=1, version=7, parts=(part,), read_timeout_s=60)
                                       ).get(timeout=60)
        landed = time.perf_counter() - started
        first, spans_first = first_call.get(timeout=120)
        first_done = time.perf_counter() - started
        second, _ = second_call.get(timeout=120)
    finally:
        outbox.drop()
        procs.stop().get()
    assert landed < first_done, f"the weights landed {landed:.2f} s in, the first request ended at {first_done:.2f} s"
    assert fetched.publication == 1 and fetched.nbytes >= sum(t.numel() * t.element_size() for t in weights.values())
    halved = load_pretrained(tiny_qwen3).model.eval()
    halved.load_state_dict(weights)
    completion = second[0]
    ids = torch.tensor([completion.prompt_ids + completion.token_ids])
    with torch.no_grad():
        expected, _ = model_logprobs(halved, ids[:, :-1], ids[:, 1:])
    got = torch.tensor(completion.logprobs)
    assert torch.allclose(got, expected[0, -len(completion.token_ids):], atol=1e-4), "generated by exactly the weights read"
    assert {c.policy_version for c in first} == {0} and {c.policy_version for c in second} == {7}
    assert [phase for phase, _, _ in spans_first] == ["weight_load", "generate"]
    assert all(end > start for _, start, end in spans_first)


def test_a_publication_whose_ranks_die_mid_read_is_abandoned_and_the_next_one_is_read_at_once(tiny_qwen3: Path) -> None:
    """The trainer's ranks die while a generator's inbox reads their publication: the read waits for its timeout
    (60 s), and so would a request naming it. The controller abandons the publication: the request fails at once, and
    the respawned ranks' next publication is read at once, not after the dead read (whose timeout, the run's
    failover.weight_read_s, is 60 s here)."""
    import os
    import signal

    from workers.engine.actors.generator import GeneratorActor
    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.weight_inbox import WeightInboxActor
    from workers.engine.actors.weight_outbox import WeightPublication
    from workers.engine.controller.attach import collect_fault_reports
    from workers.engine.sampler import SamplingParams

    reports = collect_fault_reports()  # the dead ranks' proc must not end this process
    lost_procs, ranks_procs, procs = (spawn_procs(1, threads=1) for _ in range(3))
    try:
        lost, ranks = lost_procs.spawn("staging", StagingRank), ranks_procs.spawn("staging", StagingRank)
        generator = procs.spawn("generator", GeneratorActor, str(tiny_qwen3), "float32", "cpu")
        inbox = procs.spawn("inbox", WeightInboxActor, 60.0)
        one_token = SamplingParams(max_new_tokens=1)
        generator.generate.call_one([[1, 2]], one_token, 0).get(timeout=120)  # loaded
        first = WeightPublication(number=1, version=3, parts=(lost.stage.call_one(3).get(timeout=60),), read_timeout_s=60)
        assert inbox.fetch.call_one(first).get(timeout=60).publication == 1  # the inbox has read from these ranks
        part = lost.stage.call_one(4).get(timeout=60)
        os.kill(lost.pid.call_one().get(timeout=60), signal.SIGKILL)
        inbox.fetch.call_one(WeightPublication(number=2, version=4, parts=(part,), read_timeout_s=60))  # waits for it
        waiting = generator.generate.call_one([[1, 2]], one_token, 0, 2)
        started = time.perf_counter()
        next_part = ranks.stage.call_one(5).get(timeout=60)
        fetched = inbox.fetch.call_one(WeightPublication(number=3, version=5, parts=(next_part,), read_timeout_s=60)
                                       ).get(timeout=30)
        read_next = time.perf_counter() - started
        inbox.abandon.call_one(2).get(timeout=30)
        with pytest.raises(Exception, match="weight publication 2 will not reach this generator"):
            waiting.get(timeout=30)
        failed_waiting = time.perf_counter() - started
        with pytest.raises(Exception, match="weight publication 2 will not reach this generator"):
            generator.generate.call_one([[1, 2]], one_token, 0, 2).get(timeout=30)
        held = inbox.held.call_one().get(timeout=30)
    finally:
        for mesh in (procs, ranks_procs):
            mesh.stop().get()
    assert fetched.publication == 3 and read_next < 10, f"the next publication was read {read_next:.1f} s in"
    assert failed_waiting < 10, f"the request naming the lost publication failed {failed_waiting:.1f} s in"
    assert held == [1, 3]
    assert not any("inbox" in str(report) for report in reports), "the inbox survived the dead ranks"



def test_a_read_of_stopped_ranks_gives_up_at_its_timeout_and_fails_the_requests_naming_it_at_once(tiny_qwen3: Path) -> None:
    """The trainer's ranks are stopped (SIGSTOP, not killed: no report, nothing exits) while a generator's inbox reads
    their publication. The read gives up at the publication's read_timeout_s (the run's failover.weight_read_s, within
    its call timeout) and the inbox answers Unread, which the controller blames on the trainer; a request
    naming the publication fails at once with that reason instead of waiting out the replica's wait (the generator's
    failure then). The inbox and the generator go on: the next publication, from other ranks, is read."""
    import os
    import signal

    from workers.engine.actors.generator import GeneratorActor
    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.weight_inbox import UNREAD, Unread, WeightInboxActor
    from workers.engine.actors.weight_outbox import WeightPublication
    from workers.engine.controller.attach import collect_fault_reports
    from workers.engine.sampler import SamplingParams

    reports = collect_fault_reports()  # the stopped ranks' proc, killed at the end, must not end this process
    stopped_procs, ranks_procs, procs = (spawn_procs(1, threads=1) for _ in range(3))
    stopped_pid = None
    try:
        stopped, ranks = stopped_procs.spawn("staging", StagingRank), ranks_procs.spawn("staging", StagingRank)
        generator = procs.spawn("generator", GeneratorActor, str(tiny_qwen3), "float32", "cpu")
        inbox = procs.spawn("inbox", WeightInboxActor, 600.0)  # a request's wait, far past the read's timeout
        one_token = SamplingParams(max_new_tokens=1)
        generator.generate.call_one([[1, 2]], one_token, 0).get(timeout=120)  # loaded
        part = stopped.stage.call_one(3).get(timeout=60)
        stopped_pid = stopped.pid.call_one().get(timeout=60)
        os.kill(stopped_pid, signal.SIGSTOP)
        reading = inbox.fetch.call_one(WeightPublication(number=1, version=3, parts=(part,), read_timeout_s=2))
        waiting = generator.generate.call_one([[1, 2]], one_token, 0, 1)
        unread = reading.get(timeout=60)
        assert isinstance(unread, Unread) and unread.publication == 1, "an answer, not the inbox's failure"
        assert unread.why.startswith(f"{UNREAD} within 2 s")
        with pytest.raises(Exception, match=f"weight publication 1 will not reach this generator: {UNREAD}"):
            waiting.get(timeout=60)
        next_part = ranks.stage.call_one(5).get(timeout=60)
        fetched = inbox.fetch.call_one(WeightPublication(number=2, version=5, parts=(next_part,), read_timeout_s=30)
                                       ).get(timeout=60)
        completions, _ = generator.generate.call_one([[1, 2]], one_token, 0).get(timeout=60)
        held = inbox.held.call_one().get(timeout=30)
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGKILL)
        for mesh in (procs, ranks_procs):
            mesh.stop().get()
    assert fetched.publication == 2 and held == [2] and len(completions) == 1
    assert not any("inbox" in str(report) or "generator" in str(report) for report in reports)
