"""GPUs of each host, handed to the run's procs: `placement.<role>.gpus_per_proc`.

The controller keeps one `DeviceLedger` per run. A proc mesh spawned with `gpus_per_proc > 0` takes
that many free GPU indices of its host per proc (the lowest free ones), and gives them back when it
stops; a replacement, a moved replica or a restarted trainer takes them again. The indices travel to
each proc (`proc_gpus.assign_gpus`, before any other actor starts there), and the proc's first actor makes
them the only GPUs CUDA shows it (`bind_proc_gpus`), so `cuda:0` is the proc's own GPU.

How many GPUs a host has comes from GPUS_PER_HOST_ENV (set by the SLURM and Kubernetes launchers from
the job's request) or, for this machine's procs, from CUDA; unknown, the ledger hands out indices
without a ceiling and the proc refuses GPUs CUDA does not show it.
Django- and Monarch-free; imports torch only in `bind_proc_gpus`, in the proc.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from workers.engine.env import GPUS_PER_HOST_ENV, PROC_GPUS_ENV, read_env, read_number


class NoRoomForGpus(RuntimeError):
    """A host has fewer free GPUs than a proc mesh asks for; the message says who holds them."""


class DeviceLedger:
    def __init__(self, *, gpus_per_host: int | Callable[[], int | None] | None = None):
        self._capacity = gpus_per_host  # a callable is asked once, when GPUs are first counted
        self._held: dict[tuple[str, str], list[list[int]]] = {}  # (owner, host) -> index groups

    def capacity(self, host: str) -> int | None:  # noqa: ARG002 - a job's hosts are alike
        if callable(self._capacity):
            self._capacity = self._capacity()
        return self._capacity

    def held_on(self, host: str) -> dict[str, list[int]]:
        return {owner: [i for group in groups for i in group]
                for (owner, held_host), groups in self._held.items() if held_host == host}

    def holdings(self) -> dict[str, dict[str, list[int]]]:
        """{owner: {host: GPU indices}}, for events."""
        held: dict[str, dict[str, list[int]]] = {}
        for (owner, host), groups in sorted(self._held.items()):
            held.setdefault(owner, {})[host] = [i for group in groups for i in group]
        return held

    def free(self, host: str) -> int | None:
        capacity = self.capacity(host)
        return None if capacity is None else capacity - sum(len(ix) for ix in self.held_on(host).values())

    def take(self, *, host: str, owner: str, procs: int, gpus_per_proc: int) -> list[list[int]]:
        """`procs` groups of `gpus_per_proc` indices on `host`, held by `owner` until `release(owner)`."""
        if (owner, host) in self._held:
            raise ValueError(f"{owner} already holds GPUs on {host}")
        taken = {i for indices in self.held_on(host).values() for i in indices}
        need = procs * gpus_per_proc
        capacity = self.capacity(host)
        free = None if capacity is None else capacity - len(taken)
        if free is not None and free < need:
            holders = "; ".join(f"{o}: {','.join(map(str, sorted(ix)))}" for o, ix in sorted(self.held_on(host).items()))
            raise NoRoomForGpus(f"{owner} needs {need} GPU(s) on host {host}, which has {capacity} and {free} free"
                                + (f" (held by {holders})" if holders else ""))
        indices = (i for i in range(capacity if capacity is not None else len(taken) + need) if i not in taken)
        groups = [[next(indices) for _ in range(gpus_per_proc)] for _ in range(procs)]
        self._held[(owner, host)] = groups
        return groups

    def release(self, owner: str) -> None:
        for key in [k for k in self._held if k[0] == owner]:
            del self._held[key]


def gpus_per_host_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    return read_number(GPUS_PER_HOST_ENV, environ)


def bind_proc_gpus() -> list[int] | None:
    """In a proc, before CUDA starts: show CUDA only this proc's GPUs; None when the proc was given none.

    RuntimeError when CUDA does not see them all (a host with fewer GPUs than the plan assumed)."""
    raw = read_env(PROC_GPUS_ENV)
    if not raw:
        return None
    os.environ["CUDA_VISIBLE_DEVICES"] = raw
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < len(raw.split(",")):
        raise RuntimeError(f"this proc was given GPU {raw} of its host (placement gpus_per_proc), "
                           f"but CUDA shows it {visible}: the host has fewer GPUs, or none")
    return [int(i) for i in raw.split(",")]
