"""The what-if planner's pieces against hand-computed values (#18): parameters and FLOPs per token of published
shapes, a ring all-reduce's bytes, processor sharing, the overlap of each mode, and a calibration that reproduces the
run it was fitted from."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from workers.engine.cli import main as cli_main
from workers.engine.models.tiny import make_tiny_model

from workers.engine.planning import costs
from workers.engine.planning.calibration import Calibration
from workers.engine.planning.devices import DEVICES, cpu_device
from workers.engine.planning.fitting import calibrate, measured_steps, median_step
from workers.engine.planning.shapes import KNOWN_SHAPES, ModelShape
from workers.engine.planning.whatif import Placement, Workload, phase_seconds, plan, predict, splits

H100 = DEVICES["h100"]
LLAMA3_8B = KNOWN_SHAPES["llama3-8b"]
QWEN3_1_7B = KNOWN_SHAPES["qwen3-1.7b"]


# --- shapes ---------------------------------------------------------------------------------------------------------
def test_llama3_8b_has_its_published_parameter_count():
    assert LLAMA3_8B.params() == 8_030_261_248  # the safetensors' count of Meta-Llama-3-8B


def test_qwen3_counts_match_the_model_cards():
    # Qwen3-0.6B: 0.6B in all, 0.44B without embeddings; Qwen3-1.7B: 1.7B and 1.4B
    small = KNOWN_SHAPES["qwen3-0.6b"]
    assert small.params() == 596_049_920
    assert abs(small.non_embedding_params() - 0.44e9) / 0.44e9 < 0.01
    # by hand: 28 x (q, o 2*2048*2048 + k, v 2*2048*8*128 + SwiGLU 3*2048*6144 + norms 2*2048 + 2*128)
    #          + embedding 151936*2048 (tied) + final norm 2048
    assert QWEN3_1_7B.params() == 28 * (8_388_608 + 4_194_304 + 37_748_736 + 4_096 + 256) + 311_164_928 + 2_048
    assert abs(QWEN3_1_7B.non_embedding_params() - 1.4e9) / 1.4e9 < 0.01


def test_training_flops_per_token_is_palms_6n_plus_12lhqt():
    # Llama 3 8B: N (matmul weights) = 32 layers x 218,103,808 + LM head 128256*4096 = 7,504,658,432
    n = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128_256 * 4096
    assert n == 7_504_658_432 == LLAMA3_8B.matmul_params()
    seq = 8192
    assert LLAMA3_8B.training_flops_per_token(seq_len=seq) == 6 * n + 12 * 32 * 32 * 128 * seq
    assert LLAMA3_8B.training_flops_per_token(seq_len=seq) == 57_912_852_480
    # the forward at context 0 is 2 FLOPs a weight (Qwen3-1.7B's embedding is tied: its LM head is a matmul)
    assert QWEN3_1_7B.forward_flops_per_token(context=0) == 2 * (28 * 50_331_648 + 151_936 * 2048)


def test_from_hf_config_reads_a_qwen3_config_json():
    data = {"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 2048, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151936,
            "tie_word_embeddings": True}
    assert replace(ModelShape.from_hf_config(data), name="qwen3-1.7b") == QWEN3_1_7B


def test_kv_cache_and_weight_bytes():
    # Llama 3 8B bf16: 2 (K and V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB a token
    assert LLAMA3_8B.kv_bytes_per_token("bfloat16") == 131_072
    assert LLAMA3_8B.weight_bytes("bfloat16") == 2 * 8_030_261_248


# --- costs ----------------------------------------------------------------------------------------------------------
def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_tensor():
    assert costs.ring_all_reduce_bytes(1e9, ranks=4) == pytest.approx(1.5e9)
    assert costs.ring_all_reduce_bytes(1e9, ranks=1) == 0.0
    assert costs.ring_all_gather_bytes(1e9, ranks=4) == pytest.approx(0.75e9)
    # 8 ranks at 100 GB/s, 10 us a message: 2 x 7 messages and 1.75 GB
    assert costs.ring_seconds(costs.ring_all_reduce_bytes(1e9, ranks=8), ranks=8, steps_per_rank=2, bandwidth=100e9,
                              latency_s=1e-5, efficiency=1.0) == pytest.approx(14e-5 + 0.0175)


def test_gradient_sync_crosses_hosts_at_the_slower_link():
    within = costs.gradient_sync_seconds(LLAMA3_8B, ranks=8, sharding="replicate", spans_hosts=False, device=H100,
                                         calibration=Calibration())
    across = costs.gradient_sync_seconds(LLAMA3_8B, ranks=8, sharding="replicate", spans_hosts=True, device=H100,
                                         calibration=Calibration())
    grads = 8_030_261_248 * 4 * 2 * 7 / 8
    assert within == pytest.approx(2 * 7 * H100.link_latency_s + grads / (450e9 * 0.7))
    assert across / within == pytest.approx(9.0, rel=0.01)  # 450 GB/s NVLink vs 50 GB/s InfiniBand


def test_weight_sync_is_bounded_by_the_busier_end_of_the_parallel_reads():
    cal = Calibration(sync_efficiency=0.5)
    nbytes = QWEN3_1_7B.weight_bytes("bfloat16")
    one = lambda **kw: costs.weight_sync_seconds(QWEN3_1_7B, dtype="bfloat16", spans_hosts=True, device=H100,  # noqa: E731
                                                 calibration=cal, **kw)
    # 8 ranks, 4 replicas: each replica takes in the whole model; each rank sends its eighth four times (half the model)
    assert one(ranks=8, replicas=4) == pytest.approx(H100.link_latency_s + nbytes / (50e9 * 0.5))
    # 2 ranks, 16 replicas: each rank sends its half to 16 replicas, 8 models' worth
    assert one(ranks=2, replicas=16) == pytest.approx(H100.link_latency_s + 8 * nbytes / (50e9 * 0.5))
    assert one(ranks=64, replicas=64) == pytest.approx(one(ranks=1, replicas=1)), "grown together: the same cost"


def test_decode_is_memory_bound_for_a_small_batch_and_compute_bound_for_a_large_one():
    cal = Calibration(decode_step_overhead_s=0.0)
    one = costs.decode_step_seconds(LLAMA3_8B, sequences=1, context=512, dtype="bfloat16", device=H100,
                                    calibration=cal, devices=1)
    assert one == pytest.approx((LLAMA3_8B.weight_bytes("bfloat16") + 512 * 131_072) / (3350e9 * 0.7))
    many = costs.decode_step_seconds(LLAMA3_8B, sequences=4096, context=512, dtype="bfloat16", device=H100,
                                     calibration=cal, devices=1)
    assert many == pytest.approx(4096 * LLAMA3_8B.forward_flops_per_token(context=512) / (989e12 * 0.5))


def test_processor_sharing():
    # two procs of 1 s each on 2 devices: side by side; 4 procs' worth on 2: twice as long
    assert costs.shared_seconds((1.0, 1), (1.0, 1), capacity=2) == 1.0
    assert costs.shared_seconds((1.0, 2), (1.0, 2), capacity=2) == 2.0
    assert costs.shared_seconds((2.0, 1), (1.0, 1), capacity=1) == 3.0
    assert costs.shared_seconds((2.0, 1), (1.0, 1), capacity=2) == 2.0
    # two generators and a trainer on 2 cores: all run at 2/3 speed until the generators end at 0.45 s, having let
    # the trainer do 0.3 s of its 0.56; it finishes alone (not the 0.58 s the work would take spread perfectly)
    assert costs.shared_seconds((0.3, 2), (0.56, 1), capacity=2) == pytest.approx(0.45 + 0.26)
    assert costs.shared_seconds(capacity=2) == 0.0


# --- the modes ------------------------------------------------------------------------------------------------------
WORKLOAD = Workload(prompts=64, group_size=8, prompt_tokens=256, response_tokens=1024, decode_steps=1024,
                    dtype="bfloat16", max_concurrent_sequences=256)
PLACEMENT = Placement(trainer_ranks=4, generator_replicas=4)


def _parts(workload: Workload, placement: Placement = PLACEMENT) -> tuple[dict[str, float], float, float]:
    ph = phase_seconds(QWEN3_1_7B, workload, placement, device=H100, calibration=Calibration())
    train = ph["old_logprobs"] + ph["forward_backward"] + ph["all_reduce"] + ph["optimizer"]
    controller = ph["weight_sync"] + ph["reward"] + ph["reference"] + ph["overhead"]
    return ph, train, controller


def test_sync_adds_the_phases_up():
    ph, train, controller = _parts(WORKLOAD)
    step = predict(QWEN3_1_7B, WORKLOAD, PLACEMENT, device=H100, calibration=Calibration())
    assert step.step_s == pytest.approx(ph["generate"] + train + controller)
    assert step.mode == "sync" and step.bottleneck == "generation"
    assert step.utilization["generator"] == pytest.approx(ph["generate"] / step.step_s)


def test_async_overlaps_generation_with_the_trainers_path():
    workload = replace(WORKLOAD, mode="async", max_policy_age=1)
    ph, train, controller = _parts(workload)
    step = predict(QWEN3_1_7B, workload, PLACEMENT, device=H100, calibration=Calibration())
    # the next batch is scored while the trainer trains: its reward is on the generators' path
    assert step.step_s == pytest.approx(max(ph["generate"] + ph["reward"], train + controller - ph["reward"]))
    sync = predict(QWEN3_1_7B, WORKLOAD, PLACEMENT, device=H100, calibration=Calibration())
    assert step.step_s < sync.step_s
    # age 0 is on-policy: no overlap
    on_policy = predict(QWEN3_1_7B, replace(workload, max_policy_age=0), PLACEMENT, device=H100,
                        calibration=Calibration())
    assert on_policy.step_s == pytest.approx(sync.step_s)


def test_async_on_shared_devices_shares_them():
    # on 2 shared cores a trainer and a generator of 1 core each overlap fully; with 2 cores each they cannot
    cpu = cpu_device(cores=2)
    workload = replace(WORKLOAD, prompts=2, group_size=2, prompt_tokens=16, response_tokens=8, decode_steps=8,
                       mode="async", max_policy_age=1, dtype="float32")
    small = Placement(trainer_ranks=1, generator_replicas=1)
    big = Placement(trainer_ranks=1, generator_replicas=1, devices_per_rank=2, devices_per_generator=2)
    cal = Calibration(device="cpu")
    for placement, expected in ((small, "max"), (big, "sum")):
        ph = phase_seconds(QWEN3_1_7B, workload, placement, device=cpu, calibration=cal)
        train = ph["forward_backward"] + ph["all_reduce"] + ph["optimizer"]
        controller = ph["weight_sync"] + ph["reward"] + ph["overhead"]
        step = predict(QWEN3_1_7B, workload, placement, device=cpu, calibration=cal).step_s
        if expected == "max":  # the reward is on the generators' path (scored while the trainer trains)
            assert step == pytest.approx(max(ph["generate"] + ph["reward"], train + controller - ph["reward"]))
        else:  # processor sharing: 2 x (generate, reward) + 2 x (the trainer's path) device-seconds over 2 cores
            assert step == pytest.approx(ph["generate"] + train + controller)


def test_pipelined_exposes_one_chunk_of_generation_and_one_of_training():
    # 8 chunks over 4 replicas: each replica generates 2 in turn, the trainer trains on the first 4 meanwhile
    workload = replace(WORKLOAD, mode="pipelined", pipeline_chunks=8)
    ph, train, controller = _parts(workload)
    assert ph["generate"] == pytest.approx(2 * ph["generate_chunk"])
    step = predict(QWEN3_1_7B, workload, PLACEMENT, device=H100, calibration=Calibration())
    chunk_train = ph["forward_backward"] / 8
    overlapped = max(ph["generate"] - ph["generate_chunk"], 7 * chunk_train)
    assert step.step_s == pytest.approx(ph["generate_chunk"] + overlapped + chunk_train + ph["all_reduce"]
                                        + ph["optimizer"] + controller)
    assert step.step_s < predict(QWEN3_1_7B, WORKLOAD, PLACEMENT, device=H100, calibration=Calibration()).step_s
    # as many chunks as replicas: every chunk arrives at once, nothing overlaps (the sync step)
    at_once = predict(QWEN3_1_7B, replace(workload, pipeline_chunks=4), PLACEMENT, device=H100,
                      calibration=Calibration())
    assert at_once.step_s == pytest.approx(predict(QWEN3_1_7B, WORKLOAD, PLACEMENT, device=H100,
                                                   calibration=Calibration()).step_s)


def test_a_model_too_big_for_its_devices_is_flagged():
    big = KNOWN_SHAPES["qwen3-32b"]
    step = predict(big, replace(WORKLOAD, dtype="bfloat16"), Placement(trainer_ranks=1, generator_replicas=1),
                   device=H100, calibration=Calibration())
    assert not step.fits and "fsdp would shard them" in step.notes[0]
    fsdp = predict(big, replace(WORKLOAD, sharding="fsdp", prompts=8), Placement(trainer_ranks=64, generator_replicas=8),
                   device=H100, calibration=Calibration())
    assert not any("trainer rank" in note for note in fsdp.notes)


# --- plans ----------------------------------------------------------------------------------------------------------
def test_splits_use_every_device():
    placement = Placement(trainer_ranks=1, generator_replicas=2)
    options = splits(placement, devices=12)
    assert [(s.trainer_ranks, s.generator_replicas) for s in options] == [(r, 12 - r) for r in range(1, 12)]


def test_plan_finds_a_split_at_least_as_fast_as_the_one_written():
    # generation-heavy: long responses; the written placement gives the trainer two thirds of the devices
    placement = Placement(trainer_ranks=2, generator_replicas=1)
    plans = plan(QWEN3_1_7B, WORKLOAD, placement, device=H100, calibration=Calibration())
    assert [p.devices for p in plans] == [3, 12, 48, 192]
    for scale in plans:
        assert scale.best.step_s <= scale.as_written.step_s and scale.gain >= 1.0
        assert scale.best.devices <= scale.devices and scale.as_written.devices <= scale.devices
        every = [predict(QWEN3_1_7B, replace(WORKLOAD, prompts=scale.best.prompts), split, device=H100,
                         calibration=Calibration()) for split in splits(placement, devices=scale.devices)]
        assert scale.best.step_s == pytest.approx(min(p.step_s for p in every if p.fits))
    first, last = plans[0], plans[-1]
    # at 3 GPUs generation (2 x 13.9 s) outweighs the trainer's 2 ranks (2 x 9.3 s): the best split is 1 + 2
    assert (first.best.placement.trainer_ranks, first.best.placement.generator_replicas) == (1, 2)
    assert first.gain > 1.1
    assert last.as_written.prompts == 64 * 64  # weak scaling: prompts grow with the devices
    # every rank serves its part to every replica: at 192 GPUs the sync costs replicas per rank models over the
    # hosts' links (2 here), not one model per replica (128) from rank 0
    best = last.best.placement
    models = best.generator_replicas / best.trainer_ranks
    assert models == 2
    assert last.best.phases["weight_sync"] == pytest.approx(costs.message_seconds(
        models * QWEN3_1_7B.weight_bytes(WORKLOAD.dtype), bandwidth=H100.inter_host_bandwidth,
        latency_s=H100.link_latency_s, efficiency=Calibration().sync_efficiency))


def test_mixed_precision_plans_the_generator_and_the_sync_in_bfloat16():
    from workers.engine.config import load_config

    def workload(*overrides: str) -> Workload:
        return Workload.from_config(load_config("recipe: grpo\nmodel: {path: /x}\n", overrides=[
            "placement.backend=monarch", *overrides]))

    full, mixed = workload(), workload("trainer.mixed_precision=bf16")
    assert (full.dtype, mixed.dtype) == ("float32", "bfloat16")
    sync = {w.dtype: phase_seconds(QWEN3_1_7B, w, PLACEMENT, device=H100, calibration=Calibration())["weight_sync"]
            for w in (full, mixed)}
    assert sync["bfloat16"] < 0.6 * sync["float32"]  # half the bytes, plus the same latency


def test_a_groups_shared_prompt_is_planned_once_in_training_and_in_the_torch_samplers_prefill():
    from workers.engine.config import load_config

    def workload(*overrides: str) -> Workload:
        return Workload.from_config(load_config("recipe: grpo\nmodel: {path: /x}\n", overrides=[
            "placement.backend=monarch", "grpo.group_size=8", "data.max_prompt_tokens=512", *overrides]))

    shared, padded = workload(), workload("grpo.packing=false")
    assert (shared.shared_prompt_training, padded.shared_prompt_training) == (True, False)
    # per sequence: its response and an eighth of its prompt, against both whole
    assert shared.trained_tokens == pytest.approx(shared.response_tokens + 512 / 8)
    assert padded.trained_tokens == pytest.approx(padded.seq_len)
    with_reference = {w.shared_prompt_training: phase_seconds(QWEN3_1_7B, replace(w, reference=True), PLACEMENT,
                                                              device=H100, calibration=Calibration())
                      for w in (shared, padded)}
    for phase in ("forward_backward", "reference"):
        assert with_reference[True][phase] < 0.9 * with_reference[False][phase], phase
    # the torch sampler prefills each prompt once; vLLM is planned prefilling every sequence
    vllm = workload("generator.backend=vllm", "generator.top_p=1.0")
    assert shared.shared_prefill and not vllm.shared_prefill
    args = dict(sequences=64, prompt_tokens=512.0, response_tokens=64.0, dtype="bfloat16", device=H100,
                calibration=Calibration(), devices=1)
    once, every = costs.generation_seconds(QWEN3_1_7B, **args, prefilled=8), costs.generation_seconds(QWEN3_1_7B, **args)
    prefill = costs.prefill_seconds(QWEN3_1_7B, sequences=64, prompt_tokens=512.0, device=H100,
                                    calibration=Calibration(), devices=1)
    assert every - once == pytest.approx(prefill * 7 / 8)


def test_plan_refuses_a_scale_that_holds_no_split():
    with pytest.raises(ValueError, match="cannot hold"):
        plan(QWEN3_1_7B, WORKLOAD, PLACEMENT, device=H100, calibration=Calibration(), scales=(1,))


# --- calibration ----------------------------------------------------------------------------------------------------
def test_calibration_round_trips_and_refuses_what_it_does_not_know():
    cal = Calibration(device="cpu", train_efficiency=0.3, source={"run": "r1"})
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal
    with pytest.raises(ValueError, match="unknown calibration fields: bogus"):
        Calibration.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="train_efficiency: must be a number >= 0"):
        Calibration.from_dict({"train_efficiency": -1})


def _timeline(step: int, *, seconds: float, ranks: int, ph: dict[str, float]) -> dict:
    """A step_timeline payload of a sync step with these phase seconds (generation, reward, then training)."""
    lanes = ["controller"] + [f"trainer {r}" for r in range(ranks)] + ["generator 0", "reward"]
    spans, t = [], 0.0
    spans.append([1, "weight_sync", t, t + ph["weight_sync"]])
    t += ph["weight_sync"]
    spans.append([ranks + 1, "generate", t, t + ph["generate"]])
    t += ph["generate"]
    spans.append([ranks + 2, "reward", t, t + ph["reward"]])
    t += ph["reward"]
    for r in range(ranks):
        u = t
        for phase in ("forward_backward", "all_reduce", "optimizer"):
            spans.append([1 + r, phase, u, u + ph[phase]])
            u += ph[phase]
    return {"kind": "event", "name": "step_timeline", "step": step, "seconds": seconds, "lanes": lanes,
            "spans": spans}


def test_a_calibration_fitted_from_a_run_reproduces_it():
    truth = Calibration(device="h100", train_efficiency=0.31, compute_efficiency=0.31, optimizer_efficiency=0.2,
                        link_efficiency=0.4, sync_efficiency=0.25, decode_step_overhead_s=0.004,
                        reward_s_per_sequence=2e-3, step_overhead_s=0.3)
    workload = replace(WORKLOAD, prompts=16)
    placement = Placement(trainer_ranks=2, generator_replicas=1)
    ph = phase_seconds(QWEN3_1_7B, workload, placement, device=H100, calibration=truth)
    step = predict(QWEN3_1_7B, workload, placement, device=H100, calibration=truth).step_s
    timelines = [_timeline(s, seconds=step * (1.2 if s <= 2 else 1.0), ranks=2, ph=ph) for s in range(1, 9)]
    measured = median_step(measured_steps(timelines), warmup=2)
    assert measured.seconds == pytest.approx(step) and measured.step == 6
    fitted = calibrate(QWEN3_1_7B, workload, placement, device=H100, measured=measured, source={"run": "r"})
    for name in ("train_efficiency", "optimizer_efficiency", "link_efficiency", "sync_efficiency",
                 "decode_step_overhead_s", "reward_s_per_sequence", "step_overhead_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert fitted.device == "h100" and fitted.source == {"run": "r"}
    # and predicts another placement as the true coefficients would
    other = Placement(trainer_ranks=4, generator_replicas=8)
    assert predict(QWEN3_1_7B, workload, other, device=H100, calibration=fitted).step_s == pytest.approx(
        predict(QWEN3_1_7B, workload, other, device=H100, calibration=truth).step_s, rel=1e-3)


def test_calibrating_without_timelines_says_so():
    with pytest.raises(ValueError, match="no step_timeline events"):
        median_step(measured_steps([]))


# --- the command line -----------------------------------------------------------------------------------------------
RECORDED = Path(__file__).parents[1] / "support" / "recorded" / "whatif"  # real Monarch runs, bench_whatif.py


def _bench_config(tmp_path: Path, **extra: str) -> Path:
    """The what-if bench's config (tests/bench/bench_whatif.py) on its tiny model, as a file."""
    model = make_tiny_model(tmp_path / "tiny-qwen3-h192-l4", hidden_size=192, num_layers=4, num_heads=4,
                            num_kv_heads=2, intermediate_size=384)
    lines = ["recipe: grpo", f"model: {{path: '{model}'}}", "placement: {backend: monarch}",
             "trainer: {device: cpu, threads_per_process: 1, steps: 10, batch_size: 8, micro_batch_size: 32}",
             "grpo: {group_size: 4}", f"generator: {{max_new_tokens: 32, replicas: {extra.get('replicas', 1)}}}",
             "eval: {every_steps: 0, rollout_samples: 0}"]
    path = tmp_path / f"config-{extra.get('replicas', 1)}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plan_command_prints_every_scale_and_the_best_split(tmp_path, capsys):
    config = _bench_config(tmp_path)
    assert cli_main(["plan", "--config", str(config), "--gpus", "3,12,48,192", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "on h100; calibration: the defaults (no measured run)" in out
    rows = [line for line in out.splitlines() if re.match(r"^\s+(\d+)?\s+(as written|best)\s", line)]
    assert len(rows) == 8 and [r.split()[0] for r in rows[::2]] == ["3", "12", "48", "192"]
    assert all("(x" in r for r in rows[1::2])  # the best split's gain


def test_plan_command_calibrates_from_a_recorded_run(tmp_path, capsys):
    config = _bench_config(tmp_path)
    two = _bench_config(tmp_path, replicas="2")
    recorded_run = RECORDED / "calibrate.jsonl"
    assert cli_main(["plan", "--config", str(two), "--calibrate-from", str(recorded_run), "--calibration-config",
                     str(config), "--gpus", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and report["calibration_note"] == "fitted from calibrate.jsonl on cpu"
    records = [json.loads(line) for line in recorded_run.read_text().splitlines()]
    assert report["calibration"]["source"]["steps"] == len([r for r in records if r.get("name") == "step_timeline"
                                                            and r["step"] > 2])
    measured = [json.loads(line) for line in (RECORDED / "replicas2.jsonl").read_text().splitlines()]
    step = median_step(measured_steps([r for r in measured if r.get("name") == "step_timeline"])).seconds
    assert abs(report["as_configured"]["step_s"] - step) / step < 0.30  # the recorded two-replica run


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "1"], "gpus: 1 to 16 scales, each 2 to 100000 devices"),
    (["--gpus", "three"], "gpus: a comma-separated list of whole numbers"),
    (["--device", "tpu"], "device: unknown device 'tpu'"),
    (["--model", "gpt-5"], "model: unknown shape 'gpt-5'"),
    (["--calibrate-from", "/nowhere.jsonl"], "No such file"),
])
def test_plan_command_refuses_bad_arguments_with_exit_2(tmp_path, capsys, argv, message):
    config = _bench_config(tmp_path)
    assert cli_main(["plan", "--config", str(config), *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_planner_imports_neither_torch_nor_django():
    code = ("import sys, workers.engine.planning.report, workers.engine.planning.fitting; "
            "print(sorted(m for m in ('torch', 'django', 'monarch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


# --- a trainer that generates (generator.in_trainer) ------------------------------------------------------------------
def test_a_trainer_that_generates_is_planned_on_its_own_devices_with_an_in_memory_copy():
    from workers.engine.config import load_config

    config = load_config("recipe: grpo\nmodel: {path: /x}\n", overrides=[
        "placement.backend=monarch", "trainer.ranks=4", "generator.in_trainer=true", "trainer.mixed_precision=bf16"])
    placement = Placement.from_config(config)
    assert (placement.trainer_ranks, placement.generator_replicas, placement.generator_in_trainer) == (4, 0, True)
    assert placement.devices == placement.generating_devices == 4
    assert placement.describe() == "4 trainer ranks x 1, generating"
    separate = Placement(trainer_ranks=4, generator_replicas=4)
    ph = phase_seconds(QWEN3_1_7B, WORKLOAD, placement, device=H100, calibration=Calibration())
    ph_separate = phase_seconds(QWEN3_1_7B, WORKLOAD, separate, device=H100, calibration=Calibration())
    # each rank generates its quarter of the prompts, as each of 4 replicas would, on the rank's device
    assert ph["generate"] == pytest.approx(ph_separate["generate"])
    # the policy is copied in the rank's memory: its float32 weights read, the bfloat16 copy written at HBM speed
    copy_bytes = QWEN3_1_7B.params() * (4 + 2)
    assert ph["weight_sync"] == pytest.approx(copy_bytes / (H100.memory_bandwidth * Calibration().memory_efficiency))
    assert ph["weight_sync"] < 0.5 * ph_separate["weight_sync"]
    step = predict(QWEN3_1_7B, WORKLOAD, placement, device=H100, calibration=Calibration())
    train = ph["old_logprobs"] + ph["forward_backward"] + ph["all_reduce"] + ph["optimizer"]
    assert step.step_s == pytest.approx(ph["generate"] + train + ph["weight_sync"] + ph["reward"] + ph["overhead"])
    assert step.devices == 4 and step.utilization["trainer"] == pytest.approx((ph["generate"] + train) / step.step_s)
    # on half the devices of the separate placement, its step is only the copy's saving shorter: twice the sequences
    # per device
    assert step.sequences_per_s / 4 > 1.9 * predict(QWEN3_1_7B, WORKLOAD, separate, device=H100,
                                                    calibration=Calibration()).sequences_per_s / 8
    for scale in plan(QWEN3_1_7B, WORKLOAD, placement, device=H100, calibration=Calibration(), scales=(1, 8)):
        assert scale.best.placement == scale.as_written.placement == replace(placement, trainer_ranks=scale.devices)
        assert scale.gain == 1.0


def test_a_calibration_fitted_from_a_trainer_that_generates_reproduces_it():
    truth = Calibration(device="h100", train_efficiency=0.31, compute_efficiency=0.31, optimizer_efficiency=0.2,
                        link_efficiency=0.4, decode_step_overhead_s=0.004, reward_s_per_sequence=2e-3,
                        step_overhead_s=0.3)
    workload = replace(WORKLOAD, prompts=16)
    placement = Placement(trainer_ranks=2, generator_replicas=0, generator_in_trainer=True)
    ph = phase_seconds(QWEN3_1_7B, workload, placement, device=H100, calibration=truth)
    step = predict(QWEN3_1_7B, workload, placement, device=H100, calibration=truth).step_s
    timelines = []
    for s in range(1, 7):  # each rank copies the weights and generates on its own lane, then trains
        lanes, spans = ["controller", "trainer 0", "trainer 1", "reward"], []
        for rank in (1, 2):
            spans += [[rank, "weight_load", 0.0, ph["weight_sync"]],
                      [rank, "generate", ph["weight_sync"], ph["weight_sync"] + ph["generate"]]]
        t = ph["weight_sync"] + ph["generate"]
        spans.append([3, "reward", t, t + ph["reward"]])
        t += ph["reward"]
        for rank in (1, 2):
            u = t
            for phase in ("forward_backward", "all_reduce", "optimizer"):
                spans.append([rank, phase, u, u + ph[phase]])
                u += ph[phase]
        timelines.append({"step": s, "seconds": step, "lanes": lanes, "spans": spans})
    measured = median_step(measured_steps(timelines), warmup=2)
    assert measured.phases["generate"] == pytest.approx(ph["generate"])
    assert measured.phases["weight_sync"] == pytest.approx(ph["weight_sync"])
    fitted = calibrate(QWEN3_1_7B, workload, placement, device=H100, measured=measured)
    for name in ("train_efficiency", "decode_step_overhead_s", "reward_s_per_sequence", "step_overhead_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert predict(QWEN3_1_7B, workload, placement, device=H100, calibration=fitted).step_s == pytest.approx(step,
                                                                                                            rel=1e-3)
