"""Monarch actors for distributed GRPO: dataset, generator, reward, reference, replay buffer, trainer.

Each actor wraps the same primitives the single-controller recipe uses (TorchSampler,
CombinedReward, ReplayBuffer, policy_update), so both paths compute the same thing.
Only this package imports monarch.
"""

import os

# Monarch reads this once, when it is first imported: a dead proc is then noticed within ~1 s,
# not ~10 s. Importing this package before monarch is what makes it take effect.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
