"""Monarch actors for distributed GRPO: dataset, generator, reward, reference, replay buffer, trainer.

Each actor wraps the same primitives the single-controller recipe uses (TorchSampler,
CombinedReward, ReplayBuffer, policy_update), so both paths compute the same thing.
Only this package imports monarch.

The controller imports these modules to spawn their actors, before any proc has started, so they
import no model code (torchtitan, the HF folder loader) at module level: an actor imports it where
it builds its model, in its proc. The controller then starts spawning within a few seconds of its
own start, and its imports no longer come before every proc's (tests/engine/test_fast_start.py keeps it so).
"""

import os

# Monarch reads this once, when it is first imported: a dead proc is then noticed within ~1 s,
# not ~10 s. Importing this package before monarch is what makes it take effect.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
