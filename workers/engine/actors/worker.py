"""A Monarch worker the controller attaches to, and the one transport this process listens on towards the workers.

Every way of finding a run's workers (`hosts.py` from FORGEBOARD_MONARCH_WORKERS, `monarch_job.py` from a SLURM
job, `kubernetes_workers.py` from the run's pods) gives `Worker`s and chooses the transport here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Worker:
    name: str
    address: str  # tcp://host:port
    host: str
    port: int
    proc_id: str = ""  # the worker's service identity, when its launcher gave it one (monarch.job does)

    @property
    def attach_address(self) -> str:
        return f"{self.proc_id}@{self.address}" if self.proc_id else self.address


_transport: str | None = None


def choose_transport(address: str) -> None:
    """Listen at `address` (this machine's, as the workers reach it); Monarch's transport can be chosen once per
    process, so later calls keep the first choice."""
    global _transport
    if _transport is None:
        from monarch.actor import enable_transport

        enable_transport(f"tcp://{address}:0")
        _transport = address
