"""Supervised fine-tuning on chat data, loss on the assistant's reply only. Single controller.

Read `train_sft` top to bottom: setup, then each step takes a batch of examples, packs
them into rows, accumulates gradients over micro-batches, clips, steps, records, and
now and then evaluates and checkpoints.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from workers.engine.checkpoint import load_checkpoint, save_checkpoint
from workers.engine.checkpoint_folders import resume_field, with_resume_point
from workers.engine.config import RunConfig
from workers.engine.metrics import Recorder
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.models.titan import count_parameters
from workers.engine.precision import apply_mixed_precision
from workers.engine.recipes.results import SftResult
from workers.engine.rewards import CombinedReward
from workers.engine.sampler import TorchSampler
from workers.engine.sft_math import held_out_dropped, sft_batch, sft_step_metrics, sft_update
from workers.engine.startup import StartupPhases, record_resumed
from workers.engine.step_end import StepEnd
from workers.engine.tasks import build_task
from workers.engine.tasks.stream import ProblemStream
from workers.engine.timeline import WorkSpans
from workers.engine.training import (
    EvalResult, PhaseTimer, build_optimizer, build_scheduler, evaluate, held_out_nll, record_eval,
    setup_process, single_process_device,
)


if TYPE_CHECKING:
    from workers.engine.run_control import RunControl


def train_sft(config: RunConfig, recorder: Recorder, *, control: RunControl | None = None) -> SftResult:
    cfg, trainer_cfg = with_resume_point(config), config.trainer
    startup = StartupPhases(recorder)
    startup.enter("loading_model", "loading the model and data")
    setup_process(threads=trainer_cfg.threads_per_process, seed=trainer_cfg.seed)

    task = build_task(cfg)  # a row it cannot use stops the run before the model loads
    recorder.event("dataset", step=0, **task.summary())
    device = single_process_device(cfg)
    loaded = load_pretrained(cfg.model.path, family=cfg.model.family, dtype=cfg.model.dtype, device=device)
    model, tokenizer = loaded.model, loaded.tokenizer
    apply_mixed_precision(model.train(), mixed_precision=trainer_cfg.mixed_precision)
    n_params = count_parameters(model)
    stream = ProblemStream(task.train, seed=trainer_cfg.seed)
    optimizer = build_optimizer(model, trainer_cfg.optimizer)
    scheduler = build_scheduler(optimizer, trainer_cfg.optimizer, trainer_cfg.steps)
    reward = CombinedReward(cfg.reward.functions, cfg.reward.weights)
    eval_sampler = TorchSampler(model, eos_token_ids=tokenizer.eos_token_ids, pad_id=tokenizer.pad_id)
    dropped = held_out_dropped(task.held_out, tokenizer=tokenizer, seq_len=cfg.data.seq_len)

    start_step = 0
    if cfg.checkpoint.resume_from:
        progress = load_checkpoint(cfg.checkpoint.resume_from, model=model, optimizer=optimizer, scheduler=scheduler,
                                   recipe=cfg.recipe, field=resume_field(cfg))
        start_step = progress["step"]
        stream.load_state_dict(progress["data"])
        record_resumed(recorder, step=start_step, path=cfg.checkpoint.resume_from, progress=progress)

    def run_eval(step: int) -> EvalResult | None:
        """Held-out NLL of the reference replies (and how many it leaves out, cut off whole by data.seq_len); greedy
        accuracy and reward when problems carry answers."""
        model.eval()
        nll = held_out_nll(model, tokenizer, task.held_out, seq_len=cfg.data.seq_len)
        recorder.log_many({"eval/nll": nll, "eval/nll_dropped": dropped}, step)
        result = None
        if task.verifiable:
            result = evaluate(eval_sampler, tokenizer, task.held_out, reward, max_new_tokens=cfg.generator.max_new_tokens,
                              keep_samples=cfg.eval.rollout_samples)
            record_eval(recorder, result, step)
        model.train()
        return result

    def checkpoint(step: int) -> Path:
        path = save_checkpoint(
            cfg.checkpoint.folder, step=step, recipe=cfg.recipe, model_state=model.state_dict(),
            optimizer_state=optimizer.state_dict(), scheduler_state=scheduler.state_dict(),
            progress={"step": step, "data": stream.state_dict(), "policy_version": step},
            model_folder=cfg.model.path, keep_last=cfg.checkpoint.keep_last,
        )
        recorder.event("checkpoint_saved", step=step, path=str(path))
        return path

    startup.ready()
    step_end = StepEnd(config=cfg, recorder=recorder, evaluate=run_eval, checkpoint=checkpoint, control=control)
    step_end.before_first(start_step)
    loop_start = time.perf_counter()
    losses: list[float] = []
    step = start_step
    for step in range(start_step + 1, trainer_cfg.steps + 1):
        timer = PhaseTimer(lane="process")
        step_start = time.perf_counter()

        with timer.phase("data"):
            batch = sft_batch(stream.take(trainer_cfg.batch_size), tokenizer=tokenizer, data=cfg.data).to(device)

        train_spans = WorkSpans()
        with timer.phase("train"):
            update = sft_update(model, optimizer, scheduler, batch, micro_batch_size=trainer_cfg.micro_batch_size,
                                grad_clip=trainer_cfg.optimizer.grad_clip, spans=train_spans)

        losses.append(update.loss)
        metrics = sft_step_metrics(
            update_loss=update.loss, grad_norm=update.grad_norm, update_skipped=update.skipped, lr=update.lr,
            batch=batch, step_seconds=time.perf_counter() - step_start, timer=timer, n_params=n_params,
            peak_flops_per_second=trainer_cfg.peak_flops_per_second, epoch=stream.epoch)
        timer.split("train", train_spans.items)  # where the step's time went: the train phase in its parts
        metrics.update(timer.record_timeline(recorder, step=step))
        recorder.log_many(metrics, step)

        if not step_end.after(step, metrics=metrics):  # skipped updates, eval, checkpoint, operator commands
            break

    return SftResult(step=step, losses=losses, eval=step_end.last_eval, checkpoint=step_end.saved,
                     first_eval=step_end.first_eval, seconds=time.perf_counter() - loop_start)
