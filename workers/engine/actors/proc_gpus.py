"""Handing each proc of a mesh its GPU indices (see `devices`), through a small actor in every proc."""

from __future__ import annotations

import os
from monarch.actor import Actor, endpoint

from workers.engine.env import PROC_GPUS_ENV, read_env


def assign_gpus(procs, groups_by_host: list[list[list[int]]]) -> None:  # noqa: ANN001 - a Monarch ProcMesh
    """Tell each proc of `procs` (one host, or hosts x procs) its GPU group, before any other actor starts there."""
    assigner = procs.spawn("gpus", ProcGpus)
    extent = dict(procs.extent)
    for host_index, groups in enumerate(groups_by_host):
        for proc_index, group in enumerate(groups):
            point = {"procs": proc_index} | ({"hosts": host_index} if "hosts" in extent else {})
            assigner.slice(**point).assign.call_one(group).get(timeout=60)


class ProcGpus(Actor):
    @endpoint
    def assign(self, group: list[int]) -> None:
        os.environ[PROC_GPUS_ENV] = ",".join(str(i) for i in group)

    @endpoint
    def assigned(self) -> tuple[int, str | None]:
        """(this proc's pid, the GPU indices it was given)."""
        return os.getpid(), read_env(PROC_GPUS_ENV)
