"""What a GRPO step reports about its rollouts and its policy update, in every recipe."""

from __future__ import annotations

import torch

from workers.engine.replay_buffer import RolloutBatchRecord


def _weighted_mean(parts: list[dict[str, float]], key: str) -> float:
    total = sum(p["tokens"] for p in parts if key in p)
    return sum(p[key] * p["tokens"] for p in parts if key in p) / max(total, 1.0)


def rollout_metrics(record: RolloutBatchRecord) -> dict[str, float]:
    rewards = torch.tensor(record.rewards)
    lengths = [len(r) for r in record.responses]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        **{f"reward/{name}": sum(v) / len(v) for name, v in record.reward_parts.items()},
        "response_length/mean": sum(lengths) / len(lengths),
    }


def update_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    metrics = {
        "ratio/mean": _weighted_mean(parts, "ratio_mean"),
        "ratio/max": max(p["ratio_max"] for p in parts),
        "ratio/min": min(p["ratio_min"] for p in parts),
        "clip_fraction": _weighted_mean(parts, "clip_fraction"),
        "dual_clip_fraction": _weighted_mean(parts, "dual_clip_fraction"),
        "entropy": _weighted_mean(parts, "entropy"),
        "mismatch/abs_mean": _weighted_mean(parts, "mismatch_abs_mean"),
        "mismatch/abs_max": max(p["mismatch_abs_max"] for p in parts),
    }
    if any("kl" in p for p in parts):
        metrics["kl"] = _weighted_mean(parts, "kl")
    if any("forward_positions" in p for p in parts):  # accumulate_gradients': the update's forwards, grpo.packing or not
        positions = sum(p.get("forward_positions", 0.0) for p in parts)
        metrics["data/forward_positions"] = positions
        padding = sum(p.get("padding_positions", 0.0) for p in parts)
        metrics["data/padding_share"] = padding / max(positions, 1.0)
        # grpo.packing runs a group's prompt once: the share of the samples' own positions the forwards did not run
        samples = sum(p.get("sample_positions", 0.0) for p in parts)
        metrics["data/shared_prompt_share"] = max(0.0, samples - (positions - padding)) / max(samples, 1.0)
    if any("is_weight_mean" in p for p in parts):  # grpo.rollout_correction
        metrics["mismatch/is_weight_mean"] = _weighted_mean(parts, "is_weight_mean")
        metrics["mismatch/truncated_share"] = _weighted_mean(parts, "is_truncated_share")
        metrics["mismatch/masked_share"] = _weighted_mean(parts, "is_masked_share")
    return metrics
