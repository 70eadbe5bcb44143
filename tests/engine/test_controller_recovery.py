"""Going back to the last checkpoint after a lost control proc, and the limits on recoveries, over fake hosts; the
run's counters and what a checkpoint saves; the end of a step every recipe shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.fake_fleet import FakeHosts, Fleet, controller_parts, fake_group, grpo_config
from workers.engine.actors.fleet import CallFailed, ProcFailure
from workers.engine.controller.control_procs import ControlLost
from workers.engine.controller.drill_targets import DrillTargets
from workers.engine.controller.generation import GenerationPipeline
from workers.engine.controller.generators import ReplicaGenerators
from workers.engine.controller.recovery import Recovery
from workers.engine.controller.requests import Router
from workers.engine.controller.state import PendingGeneration, RunState
from workers.engine.drills import DrillPlan
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.step_end import StepEnd

SAVED = {"step": 4, "policy_version": 4, "generations": 5, "staleness": {"0": 3, "1": 1},
         "data": {"position": 40}, "buffer": {"records": []}}


def _recovery(placement: str = "replay_buffer: {hosts: [c, b]}", **sections: str) -> tuple[Fleet, Recovery]:
    config = grpo_config(placement, **sections)
    hosts = FakeHosts(["a", "b", "c"])
    groups = {"generator": fake_group("generator", hosts, ["a"], generate=([], 0.1)), "reward": fake_group("reward", hosts, ["a"])}
    fleet = controller_parts(config, hosts, groups, trainer_hosts=["a"], control_host="c")
    fleet.trainer.actors.load = type(fleet.trainer.actors.pid)(lambda path: {0: dict(SAVED)})
    fleet.router = Router(failover=fleet.failover, waits=fleet.waits, supervisor=fleet.supervisor)
    drills = DrillTargets(plan=DrillPlan([]), injector=fleet.injector, recorder=fleet.recorder, hosts=hosts,
                          groups=groups, placer=fleet.placer, trainer=fleet.trainer, state=fleet.state)
    generators = ReplicaGenerators(group=groups["generator"], router=fleet.router, trainer=fleet.trainer,
                                   supervisor=fleet.supervisor, state=fleet.state)
    pipeline = GenerationPipeline(config=config, tokenizer=None, groups=groups, generators=generators,
                                  trainer=fleet.trainer, control=fleet.control, router=fleet.router, drills=drills,
                                  state=fleet.state)
    return fleet, Recovery(config=config, trainer=fleet.trainer, control=fleet.control, supervisor=fleet.supervisor,
                           pipeline=pipeline, failover=fleet.failover, log=fleet.log, recorder=fleet.recorder,
                           state=fleet.state)


def _in_flight(fleet: Fleet, prompts: int) -> None:
    request = fleet.router.send(fleet.groups["generator"], lambda actor: actor.generate.call_one())
    fleet.state.pending.append(PendingGeneration([], [[1]] * prompts, [request], {"position": 48}, 5, [(0, 1)]))


def test_a_lost_control_host_restarts_dataset_and_buffer_on_the_next_host_at_the_last_checkpoint():
    fleet, recovery = _recovery()
    state = fleet.state
    state.step, state.policy_version, state.generations, state.last_checkpoint = 6, 6, 7, "ckpt/step_000004"
    _in_flight(fleet, prompts=8)
    fleet.hosts.fail("c")
    fleet.supervisor.scan()
    recovery.recover_control(ControlLost("host c of the dataset and replay buffer was lost"))
    assert fleet.control.host == "b", "the next of placement.replay_buffer.hosts still up"
    assert fleet.control.dataset.load_state_dict.calls == [({"position": 40},)]
    assert fleet.control.buffer.load_state_dict.calls == [({"records": []},)]
    assert (state.step, state.policy_version, state.generations, state.generator_version) == (4, 4, 5, -1)
    assert dict(state.staleness) == {0: 3, 1: 1}
    assert not state.pending and state.totals.samples_dropped == 8, "generations launched from later states are dropped"
    assert (state.totals.steps_lost, state.totals.control_recoveries) == (2, 1)
    replaced, recovered = fleet.events("replica_replaced")[0], fleet.events("recovered")[0]
    assert (replaced["role"], replaced["host"]) == ("replay_buffer", "b")
    assert (recovered["role"], recovered["action"], recovered["steps_lost"], recovered["step"]) == \
        ("replay_buffer", "restored_checkpoint", 2, 4)
    assert [e["role"] for e in fleet.events("failure_detected")] == ["replay_buffer"], "noticed once"


def test_a_lost_control_proc_before_the_first_checkpoint_fails_the_run_saying_why():
    fleet, recovery = _recovery()
    with pytest.raises(ProcFailure, match=r"no checkpoint to restore them from yet \(checkpoint.every_steps\)"):
        recovery.recover_control(ControlLost("the control proc failed"))


def test_the_control_proc_is_replaced_at_most_max_replacements_times():
    fleet, recovery = _recovery(failover="{max_replacements: 1}")
    fleet.state.last_checkpoint = "ckpt/step_000004"
    for _ in range(2):
        fleet.control.detect("the control proc failed")
        if fleet.state.totals.control_recoveries == 1:
            with pytest.raises(ProcFailure, match=r"failed 2 times \(failover.max_replacements 1\)"):
                recovery.recover_control(ControlLost("the control proc failed"))
        else:
            recovery.recover_control(ControlLost("the control proc failed"))
    fleet.hosts.lost.update({"b", "c"})
    fleet.state.totals.control_recoveries = 0
    with pytest.raises(ProcFailure, match=r"no host left: c, b \(placement.replay_buffer.hosts\) are lost"):
        fleet.control.start()


def test_the_trainer_is_restored_at_most_recover_failures_times():
    fleet, recovery = _recovery(trainer="{recover_failures: 0}")
    fleet.state.step = 3
    with pytest.raises(ProcFailure, match=r"trainer failed at step 4 \(0 recoveries allowed, trainer.recover_failures\): "
                                          r"trainer process 7 exited"):
        recovery.recover_trainer(CallFailed("trainer process 7 exited", hung=False))
    assert fleet.events("failure_detected")[0]["role"] == "trainer"


def test_a_checkpoint_saves_the_position_before_the_generations_in_flight():
    fleet, recovery = _recovery()
    state = fleet.state
    state.step, state.policy_version, state.generations = 6, 6, 7
    state.staleness.update({0: 6})
    fleet.trainer.actors.save = type(fleet.trainer.actors.pid)(lambda step, progress: f"ckpt/step_{step:06d}")
    recovery.checkpoint(6)
    saved = fleet.trainer.actors.save.calls[-1][1]
    assert saved == {"step": 6, "policy_version": 6, "generations": 7, "data": {"position": 0},
                     "buffer": {"position": 0}, "staleness": {0: 6}}
    _in_flight(fleet, prompts=4)
    path = recovery.checkpoint(6)
    saved = fleet.trainer.actors.save.calls[-1][1]
    assert (saved["generations"], saved["data"]) == (5, {"position": 48}), "a restore generates them again"
    assert path == Path("ckpt/step_000006") and state.last_checkpoint == "ckpt/step_000006"
    assert fleet.events("checkpoint_saved")[-1]["policy_version"] == 6


def test_the_run_state_counts_policy_age_per_trained_batch():
    state = RunState(policy_version=5)
    assert state.trained(record_version=3) == 2
    assert state.trained(record_version=6) == 0
    assert (state.step, state.policy_version, dict(state.staleness)) == (2, 7, {2: 1, 0: 1})


class Rollouts:
    prompt_texts = ["p1", "p2", "p3"]
    response_texts = ["r1", "r2", "r3"]
    rewards = [1.0, 0.0, 0.5]
    policy_version = 2

    def __len__(self) -> int:
        return 3


class Control:
    def __init__(self, stop_at: int):
        self.stop_at, self.seen = stop_at, []

    def between_steps(self, *, step: int, checkpoint) -> bool:
        self.seen.append(step)
        return step < self.stop_at


def test_every_recipe_ends_a_step_the_same_way():
    config = grpo_config(eval="{every_steps: 2, rollout_samples: 2}", checkpoint="{every_steps: 3}", trainer="{steps: 5}")
    sink = MemorySink()
    evals, saves = [], []
    end = StepEnd(config=config, recorder=Recorder([sink]), evaluate=lambda step: evals.append(step) or step,
                  checkpoint=lambda step: saves.append(step) or Path(f"ckpt/{step}"), control=Control(stop_at=9))
    end.before_first(0)
    assert [end.after(step, rollouts=Rollouts()) for step in range(1, 6)] == [True] * 5
    assert evals == [0, 2, 4, 5] and saves == [3, 5], "eval and checkpoint at their cadence and at the last step"
    assert (end.first_eval, end.last_eval, end.saved) == (0, 5, Path("ckpt/5"))
    rollouts = [{k: v for k, v in r.items() if k not in ("seq", "time")} for r in sink.records if r["kind"] == "rollout"]
    assert len(rollouts) == 10 and rollouts[0] == {"kind": "rollout", "step": 1, "prompt": "p1", "completion": "r1",
                                                    "reward": 1.0, "policy_version": 2, "split": "train"}
    stopping = StepEnd(config=config, recorder=Recorder([]), evaluate=lambda step: None,
                       checkpoint=lambda step: Path("x"), control=Control(stop_at=2))
    stopping.before_first(3)  # a resumed run: no eval before its first step
    assert [stopping.after(1), stopping.after(2)] == [True, False], "the operator cancelled after step 2"
    assert stopping.first_eval is None
