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
import json
import os
import re
import socket
import subprocess
from collections.abc import Mapping
from typing import Any

from workers.engine.actors.worker import Worker, choose_transport
from workers.engine.env import (BATCH_ENV, JOB_ENV, SLURM_JOB_ID_ENV, SLURM_NNODES_ENV, SLURM_NODELIST_ENV, read_env,
                                read_number)

JOB_KINDS = ("slurm", "kubernetes")
JOB_STATE_FILE = ".monarch/job_state.pkl"
HOST_MESH = "hosts"  # the one mesh of the jobs Forgeboard submits
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


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


def expand_hostlist(hostlist: str) -> list[str]:
    """A SLURM host list as node names, in order: `gpu[001-003,7],cpu1` -> gpu001, gpu002, gpu003, gpu7, cpu1
    (ranges keep their zero padding; several bracket groups in one name expand as a product)."""
    names, depth, item = [], 0, ""
    for char in hostlist.strip() + ",":
        if char == "," and depth == 0:
            if item:
                names.extend(_expand_name(item, hostlist))
            item = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise MonarchJobError(f"{SLURM_NODELIST_ENV}: {hostlist!r} is not a SLURM host list")
        item += char
    if depth:
        raise MonarchJobError(f"{SLURM_NODELIST_ENV}: {hostlist!r} is not a SLURM host list")
    return names


def _expand_name(item: str, hostlist: str) -> list[str]:
    match = _BRACKETS.search(item)
    if match is None:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    expanded = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not (low + high).isascii() or not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
            raise MonarchJobError(f"{SLURM_NODELIST_ENV}: {hostlist!r} is not a SLURM host list")
        width = len(low)
        for number in range(int(low), int(high or low) + 1):
            expanded.extend(_expand_name(f"{head}{number:0{width}d}{tail}", hostlist))
    return expanded


def allocation_hosts(environ: Mapping[str, str] | None = None) -> list[str]:
    """This allocation's node names in SLURM's order (the order of SLURM_NODEID)."""
    return expand_hostlist(read_env(SLURM_NODELIST_ENV, environ) or "")


def squeue_record(job_id: str) -> dict[str, Any] | None:
    """The job's record in `squeue --json` (None: not in the queue, or squeue could not be asked)."""
    try:
        done = subprocess.run(["squeue", "--json", f"--jobs={job_id}"], capture_output=True, text=True, timeout=60,
                              check=False)
        jobs = json.loads(done.stdout).get("jobs") if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, AttributeError):
        return None
    return next((job for job in jobs or () if isinstance(job, dict) and str(job.get("job_id")) == str(job_id)), None)


def _listen_on_loopback_if_alone() -> None:
    """Monarch's SlurmJob makes the client listen on what its hostname resolves to, and refuses a hostname that
    resolves to loopback only. When every node of the allocation is this machine (one node, or nodes whose names
    all resolve to loopback) loopback is the right address; otherwise the other nodes could not reach this client, which
    is a fault of the nodes' naming."""
    host = socket.gethostname()
    if not _loopback_only(host):
        return
    nodes = allocation_hosts()
    alone = read_number(SLURM_NNODES_ENV) == 1 or (bool(nodes) and all(_loopback_only(n) for n in nodes))
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
    slurm = getattr(job, "_job", job)  # the pickle holds a BatchJob around the SlurmJob
    # monarch 0.7 takes the first job `squeue --json --job ID` lists; Slurm 22.05 lists every job there, so an
    # older job that ended (squeue keeps them for MinJobAge) made this one look ended. Ours picks it by its id.
    slurm._get_job_info_json = squeue_record
    if not slurm._all_hostnames:
        # monarch 0.7 reads the nodes from squeue's JSON as Slurm 23.02+ prints it (job_resources.nodes.allocation);
        # Slurm 22.05 (Debian 12's) prints a node list there. Inside the allocation its node list is the answer.
        hosts = allocation_hosts()
        wanted = sum(slurm._meshes.values())
        if len(hosts) != wanted:
            raise MonarchJobError(f"SLURM job {read_env(SLURM_JOB_ID_ENV) or '?'}: the allocation has "
                                  f"{len(hosts)} nodes ({', '.join(hosts) or 'none'}), the job asked for {wanted}")
        slurm._all_hostnames = hosts
    try:
        state = job.state(cached_path=None)
    except RuntimeError as exc:  # squeue says the job is gone, or its nodes do not add up
        raise MonarchJobError(f"SLURM job {read_env(SLURM_JOB_ID_ENV) or '?'}: {exc}") from None
    mesh = getattr(state, HOST_MESH)
    # What the job resolved while attaching: monarch 0.7 has no public accessor for it.
    hostnames, proc_ids, port = slurm._all_hostnames, slurm._service_proc_ids, slurm._port
    return [Worker(name=host, address=f"tcp://{host}:{port}", host=host, port=port, proc_id=str(proc_id))
            for host, proc_id in zip(hostnames, proc_ids, strict=True)], mesh
