"""Monarch actors for distributed GRPO: dataset, generator, reward, reference, replay buffer, trainer.

Each actor wraps the same primitives the single-controller recipe uses (TorchSampler,
CombinedReward, ReplayBuffer, policy_update), so both paths compute the same thing.
Only this package imports monarch.
"""
