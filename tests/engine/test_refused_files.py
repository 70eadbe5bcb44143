"""A file a field named that the trainer's ranks refuse (a checkpoint's trainer.pt, the model folder's config.json or
*.safetensors) ends a Monarch run with that field's ConfigError, as a single-process run does, over fake hosts: at the
run's start and in a recovery, where it is no trainer failure to retry; and so does a model folder a generator,
reward or reference replica refuses at the run's start, or its replacement or a warm spare mid-run (the folder changed
since the start: every other would read it too). The refusal comes back through Monarch as an ActorError holding the
rank's exception (test_monarch_sft and test_monarch_model_refusals: the real ones)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from monarch.actor import ActorError

from tests.engine.fake_fleet import (Done, FakeHosts, StartingGroup, controller_parts, fails_to_start, fake_group,
                                     grpo_config)
from tests.engine.test_controller_recovery import _recovery, _relaunches
from workers.engine.actors.calls import CallFailed
from workers.engine.controller.requests import Router
from workers.engine.fields import ConfigError, FieldError

CHECKPOINT = "ckpt/step_000004"
REFUSED_CHECKPOINT = FieldError("checkpoint.folder", f"{CHECKPOINT}/trainer.pt holds the weights of another model than "
                                                     "model.path's (tok_embeddings.weight is [320, 32], not [320, 64])")
REFUSED_MODEL = FieldError("model.path", "/m: the weights do not fit the model config.json describes: norm.weight is "
                                         "[3], not [64]")


def _from_a_rank(error: FieldError, endpoint: str) -> Done:
    """A call whose rank raised ConfigError([error]), as Monarch brings it back: an ActorError, pickled on the way."""
    raised = ActorError(ConfigError([error]), f"Actor call trainer.{endpoint} failed.")
    return Done(error=pickle.loads(pickle.dumps(raised)))


def test_a_config_error_comes_back_from_a_rank_as_itself() -> None:
    # ConfigError pickled by its text: unpickled, its errors were the text's characters ("m; o; d; e; l; ...")
    refused = pickle.loads(pickle.dumps(ActorError(ConfigError([REFUSED_MODEL]), "Actor call trainer.setup failed.")))
    assert isinstance(refused.exception, ConfigError)
    assert refused.exception.errors == [REFUSED_MODEL] and str(refused.exception) == str(REFUSED_MODEL)


def test_a_checkpoint_the_ranks_refuse_as_a_run_resumes_ends_the_run_with_its_fields_error() -> None:
    # it was TrainerLost("the trainer did not load checkpoint ...: ActorError: ..."), outside the step loop's handler
    # and not a ConfigError the command line reports: a traceback
    fleet, _ = _recovery(failover="{call_timeout_s: 0.5, poll_seconds: 0.05}")
    fleet.trainer.actors.load.call = lambda path: _from_a_rank(REFUSED_CHECKPOINT, "load")
    with pytest.raises(ConfigError) as refused:
        fleet.trainer.load(CHECKPOINT)
    assert refused.value.errors == [REFUSED_CHECKPOINT]
    assert [e["text"] for e in fleet.events("message")] == [
        f"the trainer did not load checkpoint {CHECKPOINT}: {REFUSED_CHECKPOINT}; not recovered: the run ends"]


@pytest.mark.parametrize("polled", [False, True])
def test_a_model_folder_the_ranks_refuse_as_the_run_starts_ends_the_run_with_model_paths_error(polled: bool) -> None:
    # it was TrainerLost("the trainer did not start: ActorError: ..."): SFT's blocking wait and GRPO's polled one
    fleet, _ = _recovery(failover="{call_timeout_s: 0.5, poll_seconds: 0.05}")
    meshes = _relaunches(fleet, True)
    spawn = fleet.hosts.spawn_across

    def refusing(**spawned: Any) -> Any:
        procs = spawn(**spawned)
        procs.ranks.setup.call = lambda master: _from_a_rank(REFUSED_MODEL, "setup")
        return procs

    fleet.hosts.spawn_across = refusing
    trainer = fleet.trainer
    trainer.launch()
    with pytest.raises(ConfigError) as refused:
        while not trainer.await_started(wait_s=0.02 if polled else None):
            pass
    assert refused.value.errors == [REFUSED_MODEL] and len(meshes) == 1
    assert [e["text"] for e in fleet.events("message")] == [
        f"the trainer did not start: {REFUSED_MODEL}; not recovered: the run ends"]


@pytest.mark.parametrize(("endpoint", "error"), [("load", REFUSED_CHECKPOINT), ("setup", REFUSED_MODEL)])
def test_a_file_the_new_meshs_ranks_refuse_in_a_recovery_ends_the_run_with_its_fields_error(
        endpoint: str, error: FieldError, monkeypatch: pytest.MonkeyPatch) -> None:
    # each new mesh read the same file and refused it: trainer.recover_failures more meshes, then a ProcFailure
    # ("trainer failed at step 7 ... the trainer did not load checkpoint ...: ActorError ...")
    from workers.engine.controller import supervision

    monkeypatch.setattr(supervision, "HOST_SETTLE_S", 0.0)
    fleet, recovery = _recovery(replicas_host="b", failover="{call_timeout_s: 0.5, poll_seconds: 0.05}",
                                trainer="{recover_failures: 3}")
    fleet.state.step, fleet.state.last_checkpoint = 6, CHECKPOINT
    meshes = _relaunches(fleet, True, True, True)
    spawn = fleet.hosts.spawn_across

    def refusing(**spawned: Any) -> Any:
        procs = spawn(**spawned)
        getattr(procs.ranks, endpoint).call = lambda *args: _from_a_rank(error, endpoint)
        return procs

    fleet.hosts.spawn_across = refusing
    with pytest.raises(ConfigError) as refused:
        recovery.recover_trainer(CallFailed("trainer process 7 exited", hung=False))
    assert refused.value.errors == [error]
    assert len(meshes) == 1 and fleet.state.totals.trainer_recoveries == 1, "no second mesh reads the same file"
    assert [e["reason"] for e in fleet.events("failure_detected")] == ["trainer process 7 exited"]
    assert fleet.events("recovered") == []
    what = f"the trainer did not load checkpoint {CHECKPOINT}" if endpoint == "load" else "the trainer did not start"
    assert [e["text"] for e in fleet.events("message")] == [f"{what}: {error}; not recovered: the run ends"]


def test_a_model_folder_a_replica_refuses_as_the_run_starts_ends_the_run_with_model_paths_error() -> None:
    # it was ProcFailure("generator replica 1 did not start: ActorError: ... ConfigError: model.path: ..."), a
    # traceback that named no field
    group = StartingGroup("generator", 1, setup_timeout_s=5, fates=["loads", "dies"])
    group.launch(["a", "b"])
    group.loads[-1].error = _from_a_rank(REFUSED_MODEL, "pid").error
    with pytest.raises(ConfigError) as refused:
        while not group.await_started(wait_s=0.02):
            pass
    assert refused.value.errors == [REFUSED_MODEL]


def _refused_mid_run(monkeypatch: pytest.MonkeyPatch, *, spares: int = 0) -> tuple[Any, Any]:
    """A run's reward replicas on hosts b and c whose model folder changed since they started: each new one refuses it."""
    from workers.engine.controller import supervision

    monkeypatch.setattr(supervision, "HOST_SETTLE_S", 0.0)
    hosts = FakeHosts(["a", "b", "c"])
    rewards = fake_group("reward", hosts, ["b", "c"], spares=spares, score=1.0)
    fleet = controller_parts(grpo_config(), hosts, {"reward": rewards}, trainer_hosts=["a"], control_host="a")
    return fleet, fails_to_start(rewards, _from_a_rank(REFUSED_MODEL, "pid").error)


def test_a_replacement_that_refuses_the_model_folder_mid_run_ends_the_run_with_model_paths_error(monkeypatch) -> None:
    # it was one more failure of the replica, and another replacement read and refused the same folder, until
    # failover.max_replacements ended the run with a ProcFailure naming no field
    fleet, spawned = _refused_mid_run(monkeypatch)
    rewards = fleet.groups["reward"]
    dead = rewards.replicas[0]
    dead.actor.score.call_one = dead.actor.pid.call_one = lambda: Done(error=RuntimeError("the proc died"))
    router = Router(failover=fleet.failover, waits=fleet.waits, supervisor=fleet.supervisor)
    request = router.send(rewards, lambda actor: actor.score.call_one())
    with pytest.raises(ConfigError) as refused:  # its retry on replica 1 is out, the repair runs meanwhile
        router.receive(request)
    assert refused.value.errors == [REFUSED_MODEL]
    assert len(spawned) == 1 and spawned[0].stopped, "no second replacement reads the same folder"
    assert fleet.hosts.released[-1] == fleet.hosts.spawned[-1][1]
    assert [e["reason"] for e in fleet.events("failure_detected")] == ["RuntimeError: the proc died"]
    assert fleet.events("replica_replaced") == [] and fleet.events("recovered") == []
    host = fleet.hosts.spawned[-1][0]
    assert [e["text"] for e in fleet.events("message")] == [
        f"the replacement of reward replica 0 did not start on {host}: {REFUSED_MODEL}; not recovered: the run ends"]


def test_a_warm_spare_that_refuses_the_model_folder_ends_the_run_with_model_paths_error(monkeypatch) -> None:
    # it was dropped and another spare started, which read and refused the same folder, for as long as the run went on
    fleet, spawned = _refused_mid_run(monkeypatch, spares=1)
    rewards = fleet.groups["reward"]
    fleet.supervisor.warm_spares()
    with pytest.raises(ConfigError) as refused:
        fleet.supervisor.tick()
    assert refused.value.errors == [REFUSED_MODEL]
    assert len(spawned) == 1 and spawned[0].stopped and rewards.spare_replicas() == []
    assert [e["text"] for e in fleet.events("message")] == [
        f"a reward spare did not start: {REFUSED_MODEL}; not recovered: the run ends"]


def test_a_warm_spare_that_refuses_the_model_folder_while_the_trainer_recovers_is_said_once_and_blames_no_trainer(
        monkeypatch) -> None:
    # the new trainer mesh's setup is waited for, and the wait's tick polls the spares: the spare's ConfigError came
    # out of that wait and await_started took it for the setup's own refusal, so the run page said "a reward spare did
    # not start: ..." and then "the trainer did not start: ...", both ending the run
    from workers.engine.controller import supervision

    monkeypatch.setattr(supervision, "HOST_SETTLE_S", 0.0)
    fleet, recovery = _recovery(failover="{call_timeout_s: 0.5, poll_seconds: 0.05}", trainer="{recover_failures: 1}")
    fleet.state.step, fleet.state.last_checkpoint = 6, CHECKPOINT
    rewards = fleet.groups["reward"]
    rewards.spares = 1
    spawned = fails_to_start(rewards, _from_a_rank(REFUSED_MODEL, "pid").error)
    meshes = _relaunches(fleet, "setup_hangs")
    fleet.supervisor.warm_spares()
    with pytest.raises(ConfigError) as refused:
        recovery.recover_trainer(CallFailed("trainer process 7 exited", hung=False))
    assert refused.value.errors == [REFUSED_MODEL]
    assert len(meshes) == 1 and len(spawned) == 1 and spawned[0].stopped
    assert [e["text"] for e in fleet.events("message")] == [
        f"a reward spare did not start: {REFUSED_MODEL}; not recovered: the run ends"]
    assert [e["reason"] for e in fleet.events("failure_detected")] == ["trainer process 7 exited"]
