"""SFT on Monarch (`recipes/sft_monarch.py`): data-parallel and FSDP SFT trainer ranks on real Monarch procs over gloo.

A 2-rank step, replicated or sharded, equals one process's step on the whole packed batch, including when a rank has
fewer rows than its peer; a whole run equals the single-process recipe's; checkpoints move between 1 and 2 ranks
(sharded) both ways; a killed rank is restored from the last checkpoint and the run then matches one resumed from
that checkpoint; drills that are not the trainer's are refused for an SFT run.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import phases_on, recorded_timelines
from workers.engine.batching import SftBatch
from workers.engine.config import ConfigError, RunConfig, load_config
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.models.hf_folder import export_hf, load_pretrained
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.operations import DrillSchedule, FaultDrillRequest
from workers.engine.recipes.grpo import train_grpo
from workers.engine.recipes.sft import train_sft
from workers.engine.sft_math import sft_batch, sft_update
from workers.engine.tasks import build_task
from workers.engine.training import build_optimizer, build_scheduler

SFT_RUN = ("data.max_operand=20", "data.eval_size=8", "data.seq_len=64", "trainer.batch_size=10",
           "trainer.micro_batch_size=2", "telemetry.console=false", "trainer.threads_per_process=1")


def _config(model: Path, folder: Path, *overrides: str) -> RunConfig:
    return load_config(f"recipe: sft\nmodel: {{path: '{model}'}}\n",
                       overrides=[*SFT_RUN, f"checkpoint.folder={folder}", *overrides])


def _batches(config: RunConfig, count: int) -> list[SftBatch]:
    """Packed batches of the config's task, each with an odd number of rows (so one of 2 ranks has fewer)."""
    task = build_task(config)
    tokenizer = ChatTokenizer(config.model.path)
    batches, start = [], 0
    while len(batches) < count:
        batch = sft_batch(task.train[start:start + 7], tokenizer=tokenizer, data=config.data)
        start += 7
        if len(batch) % 2 == 1 and len(batch) >= 3:
            batches.append(batch)
    return batches


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_two_rank_sft_steps_equal_one_process_with_a_rank_short_of_rows(tiny_trainable_qwen3: Path, tmp_path: Path,
                                                                         sharding: str) -> None:
    from monarch.spmd import setup_torch_elastic_env

    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.sft_trainer import SftTrainerActor

    config = _config(tiny_trainable_qwen3, tmp_path, "placement.backend=monarch", "trainer.ranks=2",
                     f"trainer.sharding={sharding}", "trainer.optimizer.name=sgd", "trainer.optimizer.lr=0.1",
                     "trainer.optimizer.grad_clip=0.5", "data.seq_len=24")
    batches = _batches(config, 2)
    assert batches[0].attention_mask is not None  # packed rows, several examples to a row

    model = load_pretrained(config.model.path).model.train()
    optimizer = build_optimizer(model, config.trainer.optimizer)
    scheduler = build_scheduler(optimizer, config.trainer.optimizer, config.trainer.steps)
    single = [sft_update(model, optimizer, scheduler, batch, micro_batch_size=2, grad_clip=0.5) for batch in batches]

    procs = spawn_procs(2, threads=1)
    try:
        setup_torch_elastic_env(procs)
        trainer = procs.spawn("trainer", SftTrainerActor, config)
        trainer.setup.call().get()
        steps = [list(trainer.sft_step.call(batch).get().values()) for batch in batches]
        states = list(trainer.state_dict.call().get().values())
        trainer.shutdown.call().get()
    finally:
        procs.stop().get()

    for batch, ranks, update in zip(batches, steps, single):
        assert [r["rows"] for r in ranks] == [(len(batch) + 1) // 2, len(batch) // 2]  # rank 1 has a row fewer
        assert sum(r["loss"] for r in ranks) == pytest.approx(update.loss, abs=1e-6)
        assert [r["grad_norm"] for r in ranks] == pytest.approx([update.grad_norm] * 2, rel=1e-5)
    assert single[0].grad_norm > 0.5  # the clip applied, on the norm over both ranks' gradients
    expected = model.state_dict()
    assert max((states[0][k] - expected[k]).abs().max().item() for k in expected) < 1e-6
    assert (states[1] is None) == (sharding == "fsdp")  # a sharded trainer gathers its weights to rank 0 only
    start = load_pretrained(config.model.path).model.state_dict()
    assert max((expected[k] - start[k]).abs().max().item() for k in expected) > 1e-4  # the steps moved the weights


@pytest.mark.slow
def test_monarch_sft_equals_one_process_and_checkpoints_move_between_1_and_2_sharded_ranks(
        tiny_trainable_qwen3: Path, tmp_path: Path) -> None:
    """One process: 4 steps. Two FSDP ranks: the same 4 steps. One process resumes the 2-rank checkpoint of step 2, and
    two FSDP ranks resume the 1-process checkpoint of step 2: all four agree on steps 3 and 4."""
    from workers.engine.recipes.sft_monarch import train_sft_monarch

    model = tiny_trainable_qwen3
    every = ("trainer.steps=4", "checkpoint.every_steps=2", "eval.every_steps=4")
    sharded = ("placement.backend=monarch", "trainer.ranks=2", "trainer.sharding=fsdp")
    one_sink = MemorySink()
    one = train_sft(_config(model, tmp_path / "one", *every), Recorder([one_sink]))
    sink = MemorySink()
    two = train_sft_monarch(_config(model, tmp_path / "two", *every, *sharded), Recorder([sink]))
    assert two.step == 4 and len(two.losses) == 4
    # where each step's time went: one lane in one process; the controller and each rank on Monarch
    assert [t["lanes"] for t in recorded_timelines(one_sink)] == [["process"]] * 4
    for timeline in recorded_timelines(sink):
        assert timeline["lanes"] == ["controller", "trainer 0", "trainer 1"]
        assert all({"forward_backward", "optimizer"} <= phases_on(timeline, f"trainer {rank}") for rank in (0, 1))
        assert 0.0 <= timeline["idle"]["trainer 1"] < 1.0
    assert two.losses == pytest.approx(one.losses, abs=1e-5)
    assert one.losses[-1] < one.losses[0]
    ready = sink.events("meshes_ready")[0]
    assert ready["trainer_ranks"] == 2 and len(set(ready["trainer_pids"])) == 2
    nll = sink.series("eval/nll")
    assert [step for step, _ in nll] == [0, 4] and nll[1][1] < nll[0][1]
    assert sink.series("eval/nll_dropped") == [(0, 0.0), (4, 0.0)]  # data.seq_len 64 cuts off no held-out example

    one_from_two = train_sft(_config(model, tmp_path / "one-from-two", *every,
                                     f"checkpoint.resume_from={tmp_path / 'two' / 'step_000002'}"), Recorder())
    resumed = MemorySink()
    two_from_one = train_sft_monarch(_config(model, tmp_path / "two-from-one", *every, *sharded,
                                             f"checkpoint.resume_from={tmp_path / 'one' / 'step_000002'}"),
                                     Recorder([resumed]))
    assert resumed.events("resumed")[0]["step"] == 2
    assert one_from_two.losses == pytest.approx(one.losses[2:], abs=1e-5)
    assert two_from_one.losses == pytest.approx(one.losses[2:], abs=1e-5)
    final_one = torch.load(one.checkpoint / "trainer.pt", weights_only=False)["model"]
    final_two = torch.load(two_from_one.checkpoint / "trainer.pt", weights_only=False)["model"]
    assert max((final_one[k] - final_two[k]).abs().max().item() for k in final_one) < 1e-5

    # the 2-rank run's export is a model GRPO starts from (the demo's SFT-then-GRPO chain)
    exported = export_hf(two.checkpoint, tmp_path / "two-hf")
    assert max((load_pretrained(exported).model.state_dict()[k] - final_one[k]).abs().max().item()
               for k in final_one) < 1e-5
    grpo = train_grpo(load_config(f"recipe: grpo\nmodel: {{path: '{exported}'}}\n", overrides=[
        "data.max_operand=20", "data.eval_size=8", "trainer.steps=2", "trainer.batch_size=2", "grpo.group_size=2",
        "generator.max_new_tokens=4", "eval.every_steps=0", f"checkpoint.folder={tmp_path / 'grpo'}",
        "telemetry.console=false", "trainer.threads_per_process=1"]), Recorder())
    assert grpo.step == 2 and all(math.isfinite(loss) for loss in grpo.losses)


@pytest.mark.slow
def test_a_killed_sft_rank_is_restored_and_the_run_matches_one_resumed_from_that_checkpoint(
        tiny_trainable_qwen3: Path, tmp_path: Path) -> None:
    """2 replicated ranks, a checkpoint every 2 steps: a raise drill at step 2 is retried on both ranks; rank 0 hangs
    (SIGSTOP) in step 3, which rank 1 waits for in the all-reduce: the step times out, both are killed and the mesh
    goes back to step 2; rank 1 is killed before step 6 and the mesh goes back to step 4. Steps 5-8 after that
    restore equal a run resumed from the step-4 checkpoint."""
    from workers.engine.recipes.sft_monarch import train_sft_monarch

    model = tiny_trainable_qwen3
    common = ("placement.backend=monarch", "trainer.ranks=2", "trainer.steps=8", "checkpoint.every_steps=2",
              "checkpoint.keep_last=8", "eval.every_steps=0")
    drills = [FaultDrillRequest(kind="raise", role="trainer", replica=0, schedule=DrillSchedule(at_step=2)),
              FaultDrillRequest(kind="hang", role="trainer", replica=0, duration_s=60.0,
                                schedule=DrillSchedule(at_step=3)),
              FaultDrillRequest(kind="kill", role="trainer", replica=1, schedule=DrillSchedule(at_step=6))]
    sink = MemorySink()
    killed = train_sft_monarch(_config(model, tmp_path / "killed", *common, "trainer.recover_failures=2",
                                       "failover.call_timeout_s=5"), Recorder([sink]), drills=drills)
    assert killed.step == 8
    assert [e["step"] for e in sink.events("fault_injected")] == [2, 3, 6]
    detected = sink.events("failure_detected")
    assert [e["hung"] for e in detected] == [False, True, False]
    recovered = [e for e in sink.events("recovered") if e.get("caused_failure")]
    assert [(e["action"], e["step"]) for e in recovered] == [("retried", 2), ("restored_checkpoint", 2),
                                                             ("restored_checkpoint", 4)]
    assert [e["steps_lost"] for e in recovered[1:]] == [0, 1]
    first_pids = sink.events("meshes_ready")[0]["trainer_pids"]
    replaced = sink.events("replica_replaced")
    assert [e["role"] for e in replaced] == ["trainer", "trainer"]
    assert set(replaced[0]["pids"]).isdisjoint(first_pids) and set(replaced[1]["pids"]).isdisjoint(replaced[0]["pids"])
    losses = sink.series("loss")
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 5, 6, 7, 8]  # step 5 ran twice: before the kill and after
    assert losses[4][1] == pytest.approx(losses[5][1], abs=1e-6)  # from the same checkpoint, the same step
    assert sink.series("faults/steps_lost")[-1] == (8, 1)

    assert sink.events("resumed") == []  # a recovery from the run's own checkpoints is no resume

    resumed_sink = MemorySink()
    resumed = train_sft_monarch(_config(model, tmp_path / "resumed", *common,
                                        f"checkpoint.resume_from={tmp_path / 'killed' / 'step_000004'}"),
                                Recorder([resumed_sink]))
    assert resumed.losses == pytest.approx(killed.losses[-4:], abs=1e-6)
    assert [e["optimizer_from_checkpoint"] for e in resumed_sink.events("resumed")] == [[]]
    # with other optimizer settings it goes on with the checkpoint's, and says so: the ranks tell the controller
    changed = MemorySink()
    train_sft_monarch(_config(model, tmp_path / "changed", *common, "trainer.steps=5", "trainer.optimizer.lr=3e-4",
                              f"checkpoint.resume_from={tmp_path / 'killed' / 'step_000004'}"), Recorder([changed]))
    assert [e["optimizer_from_checkpoint"] for e in changed.events("resumed")] == [
        [{"setting": "lr", "checkpoint": 1e-4, "config": 3e-4}]]
    assert [e["text"] for e in changed.events("message") if "optimizer" in e["text"]] == [], "said once, in resumed"


@pytest.mark.slow
def test_monarch_runs_refuse_the_other_recipes_checkpoint(tiny_trainable_qwen3: Path, tmp_path: Path) -> None:
    # a Monarch GRPO run resuming an SFT checkpoint stopped on KeyError: 'generations' once its trainer had loaded it;
    # a Monarch SFT run resuming a GRPO checkpoint trained on from the GRPO run's data position
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch
    from workers.engine.recipes.sft_monarch import train_sft_monarch

    model, monarch = tiny_trainable_qwen3, ("placement.backend=monarch", "trainer.steps=2", "eval.every_steps=0")
    grpo_run = ("data.max_operand=20", "data.eval_size=8", "trainer.batch_size=2", "grpo.group_size=2",
                "generator.max_new_tokens=4", "eval.every_steps=0", "telemetry.console=false",
                "trainer.threads_per_process=1")
    sft = train_sft(_config(model, tmp_path / "sft", "trainer.steps=1", "eval.every_steps=0"), Recorder()).checkpoint
    grpo = train_grpo(load_config(f"recipe: grpo\nmodel: {{path: '{model}'}}\n", overrides=[
        *grpo_run, "trainer.steps=1", f"checkpoint.folder={tmp_path / 'grpo'}"]), Recorder()).checkpoint
    assert sft is not None and grpo is not None

    resume_sft = load_config(f"recipe: grpo\nmodel: {{path: '{model}'}}\n", overrides=[
        *grpo_run, *monarch, "generator.in_trainer=true", f"checkpoint.folder={tmp_path / 'grpo-resumed'}",
        f"checkpoint.resume_from={sft}"])
    (sft / "checkpoint.json").unlink()  # written before there was one: refused before the ranks load it
    with pytest.raises(ConfigError) as refused:
        train_grpo_monarch(resume_sft, Recorder())
    [error] = refused.value.errors
    assert error.field == "checkpoint.resume_from"
    assert error.message.startswith(f"{sft} has no checkpoint.json, which says which recipe wrote a checkpoint")

    (sft / "checkpoint.json").write_text('{"recipe": "grpo", "step": 1}')  # by hand, wrong: told by its progress
    with pytest.raises(ConfigError) as refused:
        train_grpo_monarch(resume_sft, Recorder())
    [error] = refused.value.errors
    assert error.field == "checkpoint.resume_from"
    assert error.message.startswith(f"{sft / 'checkpoint.json'} says a GRPO run wrote it, but it holds an SFT run's "
                                    "progress, and a GRPO run resumes only")

    with pytest.raises(ConfigError) as refused:  # told by its checkpoint.json, before the ranks load it
        train_sft_monarch(_config(model, tmp_path / "sft-resumed", *monarch, f"checkpoint.resume_from={grpo}"),
                          Recorder())
    [error] = refused.value.errors
    assert error.field == "checkpoint.resume_from"
    assert error.message.startswith(f"{grpo} holds a GRPO run's checkpoint, and an SFT run resumes only")
    assert not (tmp_path / "grpo-resumed").exists() and not (tmp_path / "sft-resumed").exists()


@pytest.mark.slow
def test_a_checkpoint_or_model_its_ranks_refuse_ends_a_monarch_sft_run_with_the_fields_error(
        tiny_trainable_qwen3: Path, tmp_path: Path) -> None:
    # the ranks' refusal reached the controller as TrainerLost("the trainer did not load checkpoint ...: ActorError ...
    # ConfigError: checkpoint.resume_from: ...") (a traceback at the run's start, and the field not the one that chose
    # the checkpoint), or "the trainer did not start: ActorError ..." for a model folder whose weights do not fit; a
    # flipped weight, which the controller's check_plain_data no longer reads, is the ranks' to refuse
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.engine.test_hostile_files import _flipped
    from workers.engine.models.tiny import make_tiny_model
    from workers.engine.recipes.sft_monarch import train_sft_monarch

    monarch = ("placement.backend=monarch", "trainer.steps=2", "eval.every_steps=0")
    half = make_tiny_model(tmp_path / "half", family="qwen3", hidden_size=32, intermediate_size=64)
    own = tmp_path / "own"
    saved = train_sft(_config(half, own, "trainer.steps=1", "eval.every_steps=0"), Recorder()).checkpoint
    assert saved is not None
    sink = MemorySink()
    with pytest.raises(ConfigError) as refused:  # checkpoint.resume_latest chose it: checkpoint.folder's error
        train_sft_monarch(_config(tiny_trainable_qwen3, own, *monarch, "checkpoint.resume_latest=true"),
                          Recorder([sink]))
    [error] = refused.value.errors
    assert error.field == "checkpoint.folder"
    assert error.message.startswith(f"{saved / 'trainer.pt'} holds the weights of another model than model.path's")
    assert [e["text"] for e in sink.events("message")][-1:] == [
        f"the trainer did not load checkpoint {saved}: {refused.value}; not recovered: the run ends"]

    flipped = tmp_path / "theirs" / saved.name  # a weight's byte: the controller reads no weight, the ranks refuse it
    shutil.copytree(saved, flipped)
    _flipped(flipped / "trainer.pt", "trainer/data/0")
    with pytest.raises(ConfigError) as refused:
        train_sft_monarch(_config(half, tmp_path / "resumed", *monarch, f"checkpoint.resume_from={flipped}"),
                          Recorder())
    [error] = refused.value.errors
    assert error.field == "checkpoint.resume_from"
    assert error.message.startswith(f"{flipped / 'trainer.pt'} is damaged (its member trainer/data/0 does not match "
                                    "its checksum")

    model = tmp_path / "model"
    shutil.copytree(tiny_trainable_qwen3, model)
    weights = load_file(str(model / "model.safetensors"))
    save_file({**weights, "model.norm.weight": torch.zeros(3)}, str(model / "model.safetensors"))
    with pytest.raises(ConfigError) as refused:
        train_sft_monarch(_config(model, tmp_path / "fresh", *monarch), Recorder())
    assert [str(e) for e in refused.value.errors] == [
        f"model.path: {model}: the weights do not fit the model config.json describes: norm.weight is [3], not [64]"]


def test_sft_on_monarch_is_accepted_and_its_refusals_name_the_trainer(tmp_path: Path) -> None:
    def errors(*overrides: str) -> dict[str, str]:
        with pytest.raises(ConfigError) as caught:
            load_config("recipe: sft\nmodel: {path: /x}\n", overrides=list(overrides))
        return {e.field: e.message for e in caught.value.errors}

    config = load_config("recipe: sft\nmodel: {path: /x}\n", overrides=[
        "placement.backend=monarch", "trainer.ranks=2", "trainer.sharding=fsdp", "failover.call_timeout_s=30",
        "drills=[{kind: kill, role: trainer, replica: 1, schedule: {at_step: 3}}]"])
    assert config.role_processes() == {"trainer": 2}
    monarch = ("placement.backend=monarch", "trainer.ranks=2")
    drill = errors(*monarch, "drills=[{kind: kill, role: generator, replica: 0}]")
    assert "an SFT run has no generator" in drill["drills.0.role"]
    assert "only trainer ranks" in errors(*monarch, "failover.warm_spares=1")["failover.warm_spares"]
    assert "placement.backend: monarch" in errors("trainer.sharding=fsdp")["trainer.sharding"]

