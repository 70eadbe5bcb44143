"""FSDP2 trainer (`trainer.sharding: fsdp`) on real Monarch procs over gloo.

A sharded step must equal one process's step on the whole batch, including when a rank has
fewer rows than its peers; checkpoints move between a sharded and an unsharded trainer with
their optimizer state; a GRPO run with a sharded trainer syncs weights, evaluates and saves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.conftest import ARITHMETIC
from workers.engine.actors.weight_outbox import WeightPublication, read_publication
from workers.engine.batching import collate_rollouts
from workers.engine.checkpoint import load_checkpoint, save_checkpoint
from workers.engine.config import RunConfig, load_config
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.grpo_math import policy_update
from workers.engine.replay_buffer import RolloutBatchRecord
from workers.engine.sampler import SamplingParams, TorchSampler
from workers.engine.training import build_optimizer, build_scheduler

pytestmark = pytest.mark.slow


def _record(folder: Path, *, rows: int, seed: int) -> RolloutBatchRecord:
    loaded = load_pretrained(folder)
    sampler = TorchSampler(loaded.model, eos_token_ids=loaded.tokenizer.eos_token_ids, pad_id=loaded.tokenizer.pad_id)
    prompts = [loaded.tokenizer.encode_prompt([{"role": "user", "content": f"{a}+{seed}="}]) for a in range(rows)]
    completions = sampler.generate(prompts, SamplingParams(max_new_tokens=6), seed=seed)
    return RolloutBatchRecord(
        prompts=prompts, responses=[c.token_ids for c in completions], logprobs=[c.logprobs for c in completions],
        rewards=[0.0] * rows, advantages=[(-1.0) ** i * (1 + i / 10) for i in range(rows)], policy_version=0,
        prompt_texts=[""] * rows, response_texts=[""] * rows, reward_parts={},
    )


def _single_process_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: object,
                         config: RunConfig, record: RolloutBatchRecord, pad_id: int):
    batch = collate_rollouts(record.prompts, record.responses, record.logprobs, record.advantages, pad_id=pad_id)
    return policy_update(model, optimizer, scheduler, batch, grpo=config.grpo, temperature=1.0,
                         micro_batch_size=config.trainer.micro_batch_size, grad_clip=config.trainer.optimizer.grad_clip)


def _single_process(folder: Path, config: RunConfig, record: RolloutBatchRecord):
    """A fresh model, optimizer and schedule in this process after one step on the whole record; and that step."""
    loaded = load_pretrained(folder)
    model = loaded.model.train()
    optimizer = build_optimizer(model, config.trainer.optimizer)
    scheduler = build_scheduler(optimizer, config.trainer.optimizer, config.trainer.steps)
    update = _single_process_step(model, optimizer, scheduler, config, record, loaded.tokenizer.pad_id)
    return model, optimizer, scheduler, update


def _sharded_trainer(config: RunConfig, ranks: int):
    from monarch.spmd import setup_torch_elastic_env

    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.trainer import TrainerActor

    procs = spawn_procs(ranks, threads=1)
    setup_torch_elastic_env(procs)
    trainer = procs.spawn("trainer", TrainerActor, config)
    trainer.setup.call().get()
    return procs, trainer


def test_fsdp_step_equals_single_process_step_when_a_rank_is_short_of_rows(sft_warm_start: tuple[Path, float]) -> None:
    """10 rows over 3 ranks in micro-batches of 3: ranks hold 4, 4 and 2 rows, so rank 2 runs one zero-weighted pass."""
    folder, _ = sft_warm_start
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        "placement.backend=monarch", "trainer.ranks=3", "trainer.sharding=fsdp", "trainer.micro_batch_size=3",
        "trainer.optimizer.lr=0.1", "trainer.optimizer.name=sgd", "trainer.optimizer.grad_clip=0.5", "grpo.group_size=2",
    ])
    record = _record(folder, rows=10, seed=1)
    procs, trainer = _sharded_trainer(config, 3)
    try:
        results = list(trainer.train_step.call(record, None, 0).get().values())
        states = list(trainer.state_dict.call().get().values())
        staged = list(trainer.stage_weights.call(True).get().values())
        published = WeightPublication(number=1, version=1, parts=tuple(staged), read_timeout_s=60)
        read, _ = read_publication(published)  # as a generator's inbox reads it: every rank's shards, over RDMA
        trainer.shutdown.call().get()
    finally:
        procs.stop().get()

    model, _, _, update = _single_process(folder, config, record)
    assert [part.layout.rank for part in staged] == [0, 1, 2], "every rank serves its own shards"
    assert list(read) == list(states[0]) and all(torch.equal(read[k], states[0][k]) for k in read), "exactly"
    rows = {piece.name: [] for piece in staged[0].layout.pieces}
    for part in staged:
        for piece in part.layout.pieces:
            rows[piece.name].append(piece.shape[0] if piece.rows_of else None)
    assert rows["tok_embeddings.weight"] == [107, 107, 106], "320 embedding rows over 3 ranks: uneven"

    assert [r["train_tokens"] > 0 for r in results] == [True, True, True]
    assert sum(r["loss"] for r in results) == pytest.approx(update.loss, abs=1e-6)
    assert update.grad_norm > 0.5  # the clip applied, on the norm over every shard
    assert [r["grad_norm"] for r in results] == pytest.approx([update.grad_norm] * 3, rel=1e-5)
    assert states[1] is None and states[2] is None  # gathered to rank 0 only
    single = model.state_dict()
    assert set(states[0]) == set(single)
    assert max((states[0][k] - single[k]).abs().max().item() for k in single) < 1e-6
    assert max((single[k] - load_pretrained(folder).model.state_dict()[k]).abs().max().item() for k in single) > 1e-4


def test_a_tied_models_shards_travel_once_and_the_generator_gets_both_names(tmp_path: Path) -> None:
    """A Qwen3 whose LM head is its embedding, sharded over 2 ranks: each rank serves its embedding rows once (the
    head's name has no bytes), and the state dict a generator reads holds both names as one exact tensor."""
    from workers.engine.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "tied", family="qwen3", tie_word_embeddings=True)
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        "placement.backend=monarch", "trainer.ranks=2", "trainer.sharding=fsdp", "grpo.group_size=2"])
    procs, trainer = _sharded_trainer(config, 2)
    try:
        full = list(trainer.state_dict.call().get().values())[0]
        staged = list(trainer.stage_weights.call(True).get().values())
        read, _ = read_publication(WeightPublication(number=1, version=1, parts=tuple(staged), read_timeout_s=60))
        trainer.shutdown.call().get()
    finally:
        procs.stop().get()
    assert list(read) == list(full) and all(torch.equal(read[k], full[k]) for k in read)
    assert read["lm_head.weight"] is read["tok_embeddings.weight"]
    for part in staged:
        head = next(p for p in part.layout.pieces if p.name == "lm_head.weight")
        assert head.same_as == "tok_embeddings.weight" and head.nbytes == 0
    served = sum(piece.nbytes for part in staged for piece in part.layout.pieces)
    assert served == sum(t.numel() * 4 for name, t in full.items() if name != "lm_head.weight")


def test_checkpoints_move_between_unsharded_and_fsdp_trainers(sft_warm_start: tuple[Path, float], tmp_path: Path) -> None:
    """One process steps and saves; an FSDP trainer loads that (weights and AdamW state), steps and saves; one
    process loads the FSDP checkpoint: it equals the single process that took both steps itself."""
    folder, _ = sft_warm_start
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        "placement.backend=monarch", "trainer.ranks=2", "trainer.sharding=fsdp", "trainer.micro_batch_size=4",
        "trainer.optimizer.lr=1e-3", "grpo.group_size=2", f"checkpoint.folder={tmp_path / 'fsdp'}",
    ])
    first, second = _record(folder, rows=8, seed=2), _record(folder, rows=8, seed=3)
    model, optimizer, scheduler, _ = _single_process(folder, config, first)
    plain = save_checkpoint(tmp_path / "plain", step=1, recipe="grpo", model_state=model.state_dict(),
                            optimizer_state=optimizer.state_dict(), scheduler_state=scheduler.state_dict(),
                            progress={"step": 1}, model_folder=folder, keep_last=1)
    _single_process_step(model, optimizer, scheduler, config, second, load_pretrained(folder).tokenizer.pad_id)

    procs, trainer = _sharded_trainer(config, 2)
    try:
        assert list(trainer.load.call(str(plain)).get().values()) == [{"step": 1}] * 2
        trainer.train_step.call(second, None, 1).get()
        paths = list(trainer.save.call(2, {"step": 2}).get().values())
        trainer.shutdown.call().get()
    finally:
        procs.stop().get()

    assert paths[1] is None and paths[0] is not None
    saved = torch.load(Path(paths[0]) / "trainer.pt", weights_only=False)
    assert all(isinstance(key, str) for key in saved["optimizer"]["state"])  # written by name, sharded
    resumed = load_pretrained(folder).model.train()
    resumed_optimizer = build_optimizer(resumed, config.trainer.optimizer)
    assert load_checkpoint(paths[0], model=resumed, optimizer=resumed_optimizer, restore_rng=False) == {"step": 2}

    expected, got = model.state_dict(), resumed.state_dict()
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) < 1e-5
    expected_state, got_state = optimizer.state_dict()["state"], resumed_optimizer.state_dict()["state"]
    assert set(expected_state) == set(got_state) and len(expected_state) > 0
    for index, moments in expected_state.items():
        assert float(got_state[index]["step"]) == float(moments["step"]) == 2.0
        torch.testing.assert_close(got_state[index]["exp_avg"], moments["exp_avg"], rtol=1e-3, atol=1e-7)
        torch.testing.assert_close(got_state[index]["exp_avg_sq"], moments["exp_avg_sq"], rtol=1e-3, atol=1e-10)


def test_grpo_run_with_an_fsdp_trainer_in_bf16(sft_warm_start: tuple[Path, float], tmp_path: Path) -> None:
    """Weight sync, evaluation and checkpoints gather from every rank; the checkpoint resumes in one process."""
    from workers.engine.models.hf_folder import export_hf
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    folder, _ = sft_warm_start
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "trainer.ranks=2", "trainer.sharding=fsdp",
        "trainer.mixed_precision=bf16", "trainer.steps=3", "trainer.batch_size=4", "trainer.micro_batch_size=8",
        "grpo.group_size=4", "trainer.optimizer.lr=3e-3", "eval.every_steps=3", "eval.rollout_samples=2",
        f"checkpoint.folder={tmp_path / 'checkpoints'}", "checkpoint.every_steps=2", "telemetry.console=false",
        "trainer.threads_per_process=1",
    ])
    sink = MemorySink()
    result = train_grpo_monarch(config, Recorder([sink]))
    assert result.step == 3 and len(result.losses) == 3 and all(loss == loss for loss in result.losses)
    assert result.eval is not None and 0.0 <= result.eval.accuracy <= 1.0
    syncs = sink.series("time/weight_sync_s")
    # after step 1 (the generators start with the model's weights) the gathered weights reach them each step
    assert len(syncs) == 3 and all(seconds > 0.0 for _, seconds in syncs[1:])
    saved = [r for r in sink.records if r["kind"] == "event" and r["name"] == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [2, 3]
    exported = load_pretrained(export_hf(result.checkpoint, tmp_path / "exported"))
    ids = torch.randint(0, 259, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (exported.model(ids) - load_pretrained(folder).model(ids)).abs().max() > 1e-4


def test_fsdp_async_correction_computes_pi_old_with_the_batchs_sharded_weights(sft_warm_start: tuple[Path, float]) -> None:
    """Two steps on FSDP ranks, the second on a batch one version old with a rollout correction and two mini-batches:
    each rank swaps its shards of the kept version in for pi_old. The result equals one process doing the same."""
    from workers.engine.behaviour_weights import BehaviourWeights
    from workers.engine.grpo_math import prepare_old_logprobs

    folder, _ = sft_warm_start
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        "placement.backend=monarch", "trainer.ranks=2", "trainer.sharding=fsdp", "trainer.micro_batch_size=3",
        "trainer.optimizer.lr=0.1", "trainer.optimizer.name=sgd", "grpo.group_size=2", "grpo.mode=async",
        "grpo.max_policy_age=1", "grpo.mini_batches=2", "grpo.rollout_correction.mode=mask",
        "grpo.rollout_correction.threshold=1.05",
    ])
    first, second = _record(folder, rows=8, seed=4), _record(folder, rows=8, seed=5)  # both made by version 0
    procs, trainer = _sharded_trainer(config, 2)
    try:
        trainer.train_step.call(first, None, 0).get()
        results = list(trainer.train_step.call(second, None, 1).get().values())
        states = list(trainer.state_dict.call().get().values())
        trainer.shutdown.call().get()
    finally:
        procs.stop().get()

    loaded = load_pretrained(folder)
    model = loaded.model.train()
    optimizer = build_optimizer(model, config.trainer.optimizer)
    scheduler = build_scheduler(optimizer, config.trainer.optimizer, config.trainer.steps * 2)
    kept = BehaviourWeights(max_policy_age=1)
    kept.record(model, version=0)
    for version, record in enumerate((first, second)):
        batch = collate_rollouts(record.prompts, record.responses, record.logprobs, record.advantages,
                                 pad_id=loaded.tokenizer.pad_id)
        found = prepare_old_logprobs(model, batch, grpo=config.grpo, temperature=1.0, micro_batch_size=3,
                                     policy_age=version, batch_version=0, behaviour=kept)
        update = policy_update(model, optimizer, scheduler, batch, grpo=config.grpo, temperature=1.0,
                               micro_batch_size=3, grad_clip=config.trainer.optimizer.grad_clip, seed=version)
        kept.record(model, version=version + 1)
    assert found == {"mismatch/behaviour_weights": 1.0}
    assert [r["shaping"]["mismatch/behaviour_weights"] for r in results] == [1.0, 1.0]
    assert sum(r["loss"] for r in results) == pytest.approx(update.loss, abs=1e-6)
    single = model.state_dict()
    assert max((states[0][k] - single[k]).abs().max().item() for k in single) < 1e-6
