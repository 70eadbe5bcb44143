"""The workers of a run that a cluster started through `monarch.job`, attached through the job itself.

FORGEBOARD_MONARCH_JOB names the job kind (set by the launcher in the job's environment):
- `slurm`: the engine is the client script of a `monarch.job.SlurmJob` in batch mode. Monarch's batch
  runner started a worker on every node of the allocation (each with its service identity) and then
  this process with MONARCH_BATCH_JOB=1, in the job's working directory, where the submitting process
  pickled the job (`.monarch/job_state.pkl`). `job.state()` finds the allocation's nodes (squeue) and
  attaches the host mesh.
- `kubernetes`: see `kubernetes_workers.py`.

Both return the workers in the host mesh's order, so that slices of the mesh and `Worker` entries agree.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from typing import Any

from workers.engine.actors.worker import Worker, choose_transport
from workers.engine.env import (BATCH_ENV, JOB_ENV, SLURM_JOB_ID_ENV, SLURM_NNODES_ENV, SLURM_NODELIST_ENV, read_env,
                                read_number)

JOB_KINDS = ("slurm", "kubernetes")
JOB_STATE_FILE = ".monarch/job_state.pkl"
HOST_MESH = "hosts"  # the one mesh of the jobs Forgeboard submits


class MonarchJobError(RuntimeError):
    """The run's monarch.job cannot be used; the message says why."""


def job_kind(environ: Mapping[str, str] | None = None) -> str | None:
    """Which monarch.job started this run's workers (None: FORGEBOARD_MONARCH_WORKERS or this machine)."""
    kind = (read_env(JOB_ENV, environ) or "").strip()
    if not kind:
        return None
    if kind not in JOB_KINDS:
        raise MonarchJobError(f"{JOB_ENV}: {kind!r} is not one of {', '.join(JOB_KINDS)}")
    return kind


def _loopback_only(host: str) -> bool:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _listen_on_loopback_if_alone() -> None:
    """Monarch's SlurmJob makes the client listen on what its hostname resolves to, and refuses a hostname that
    resolves to loopback only. When every node of the allocation is this machine (one node, or a plain node list
    of loopback names) loopback is the right address; otherwise the other nodes could not reach this client, which
    is a fault of the nodes' naming."""
    host = socket.gethostname()
    if not _loopback_only(host):
        return
    nodes = [n for n in (read_env(SLURM_NODELIST_ENV) or "").split(",") if n]
    alone = read_number(SLURM_NNODES_ENV) == 1 or (nodes and all(
        "[" not in n and _loopback_only(n) for n in nodes))
    if not alone:
        raise MonarchJobError(f"this node's hostname {host!r} resolves to loopback only, so the other nodes' workers "
                              "could not reach the engine: give the nodes routable names (DNS or /etc/hosts)")
    choose_transport("127.0.0.1")


def slurm_batch_workers(*, state_file: str) -> tuple[list[Worker], Any]:
    """The nodes of this SLURM allocation as workers, and the host mesh SlurmJob attached to them."""
    if read_env(BATCH_ENV) != "1":
        raise MonarchJobError(f"{JOB_ENV}=slurm: this process is not the client of a SlurmJob in batch mode "
                              f"({BATCH_ENV} is not 1); submit the run through the SLURM backend")
    from monarch.job import job_load

    try:
        job = job_load(state_file)
    except FileNotFoundError:
        raise MonarchJobError(f"{JOB_ENV}=slurm: no {state_file} in {os.getcwd()} (the submitting process "
                              "pickles the job there, in the job's working directory)") from None
    _listen_on_loopback_if_alone()
    try:
        state = job.state(cached_path=None)
    except RuntimeError as exc:  # squeue says the job is gone, or its nodes do not add up
        raise MonarchJobError(f"SLURM job {read_env(SLURM_JOB_ID_ENV) or '?'}: {exc}") from None
    mesh = getattr(state, HOST_MESH)
    # What the job resolved while attaching: monarch 0.7 has no public accessor for it.
    slurm = getattr(job, "_job", job)  # the pickle holds a BatchJob around the SlurmJob
    hostnames, proc_ids, port = slurm._all_hostnames, slurm._service_proc_ids, slurm._port
    return [Worker(name=host, address=f"tcp://{host}:{port}", host=host, port=port, proc_id=str(proc_id))
            for host, proc_id in zip(hostnames, proc_ids, strict=True)], mesh
