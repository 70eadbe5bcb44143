"""Spawning process meshes with the environment the engine's procs need.

Monarch procs on this machine inherit the client's environment at spawn time (later changes do
not reach them), so everything is set here, before `spawn_procs`. Procs on a worker host inherit
the worker's environment instead: `apply_proc_env` (their bootstrap) sets the same variables there.
The worker must already have the repository on its PYTHONPATH (the bootstrap is imported from it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import workers
from workers.engine.env import TORCH_THREADS_ENV, read_number

REPO_ROOT = str(Path(workers.__file__).resolve().parent.parent)


def prepare_proc_env(*, threads: int) -> None:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, *paths])
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ[TORCH_THREADS_ENV] = str(threads)
    os.environ["HF_HUB_OFFLINE"] = "1"
    # notice a dead proc within ~1 s instead of ~10 s
    os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")


def proc_env(*, threads: int) -> dict[str, str]:
    """What a proc on another host needs from this one: thread counts, offline Hub, vLLM's settings."""
    prepare_proc_env(threads=threads)
    keys = ("OMP_NUM_THREADS", TORCH_THREADS_ENV, "HF_HUB_OFFLINE")
    return {k: v for k, v in os.environ.items() if k in keys or k.startswith("VLLM_")}


def apply_proc_env(env: dict[str, str]) -> None:
    """A worker-host proc's bootstrap: runs in the proc before any actor."""
    os.environ.update(env)


def spawn_procs(count: int, *, threads: int) -> Any:
    """`count` procs on this machine."""
    from monarch.actor import this_host

    prepare_proc_env(threads=threads)
    procs = this_host().spawn_procs(per_host={"procs": count})
    procs.initialized.get()
    return procs


def set_proc_threads() -> None:
    """Called in every actor's __init__: the procs of a run share the machine's cores."""
    import torch

    torch.set_num_threads(read_number(TORCH_THREADS_ENV))
