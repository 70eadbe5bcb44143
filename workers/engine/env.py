"""Every environment variable the engine reads: one table, and the readers every read goes through.

`VARIABLES` is the table (name, type, default, meaning); workers/engine/README.md's "Environment variables"
section is checked against it (tests/engine/test_engine_env.py). The launchers that set these for the engine
use the name constants below. A value of the wrong type is an `EnvValueError` naming the variable.
Variables the engine only writes for a child process (torch's, vLLM's, Monarch's) are where they are written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

CONTROL_PLANE_URL_ENV = "FORGEBOARD_URL"
RUN_ID_ENV = "FORGEBOARD_RUN_ID"
RUN_TOKEN_FILE_ENV = "FORGEBOARD_RUN_TOKEN_FILE"
SPOOL_DIR_ENV = "FORGEBOARD_SPOOL_DIR"
ALLOWED_PATHS_ENV = "FORGEBOARD_ALLOWED_PATHS"
WORKERS_ENV = "FORGEBOARD_MONARCH_WORKERS"
JOB_ENV = "FORGEBOARD_MONARCH_JOB"
GPUS_PER_HOST_ENV = "FORGEBOARD_GPUS_PER_HOST"
PROC_GPUS_ENV = "FORGEBOARD_PROC_GPUS"
NODES_ENV = "FORGEBOARD_RUN_NODES"
NAMESPACE_ENV = "FORGEBOARD_POD_NAMESPACE"
POD_IP_ENV = "FORGEBOARD_POD_IP"
K8S_JOB_ENV = "FORGEBOARD_K8S_JOB"
TORCH_THREADS_ENV = "ENGINE_TORCH_THREADS"
BATCH_ENV = "MONARCH_BATCH_JOB"
SLURM_JOB_ID_ENV = "SLURM_JOB_ID"
SLURM_NODELIST_ENV = "SLURM_JOB_NODELIST"
SLURM_NNODES_ENV = "SLURM_NNODES"
LOCAL_RANK_ENV = "LOCAL_RANK"
MASTER_ADDR_ENV = "MASTER_ADDR"


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str  # what a value must be, as an error says it
    default: str | None  # the value read when it is unset (None: unset is a case of its own)
    meaning: str  # what it holds, and who sets it


VARIABLES: dict[str, EnvVar] = {var.name: var for var in (
    EnvVar(CONTROL_PLANE_URL_ENV, "a URL", None,
           "the control plane to report to (with FORGEBOARD_RUN_ID and FORGEBOARD_RUN_TOKEN_FILE; any unset: no "
           "control plane); set by every launch backend"),
    EnvVar(RUN_ID_ENV, "a positive integer", None,
           "the run this process belongs to; on Kubernetes also its pods' label `forgeboard.run-id`; set by every "
           "launch backend"),
    EnvVar(RUN_TOKEN_FILE_ENV, "a path", None, "the file holding the run's token for the control plane"),
    EnvVar(SPOOL_DIR_ENV, "a path", None,
           "where telemetry waits to be sent and executed commands are noted (unset: `.forgeboard-spool-<run id>`); "
           "set by the local launcher"),
    EnvVar(ALLOWED_PATHS_ENV, "a JSON list of paths", None,
           "every path the config names must resolve inside one of these (unset: any local path); set by the "
           "launchers, checked by preflight"),
    EnvVar(WORKERS_ENV, "a worker list", None,
           "the Monarch workers of a multi-host run, `tcp://host:port` or `name=tcp://host:port`, comma-separated "
           "(unset: this machine); set by hand, or by the engine itself for `placement.local_hosts`"),
    EnvVar(JOB_ENV, "slurm or kubernetes", None,
           "which `monarch.job` started the run's workers (unset: FORGEBOARD_MONARCH_WORKERS or this machine); set "
           "by the SLURM and Kubernetes launchers"),
    EnvVar(GPUS_PER_HOST_ENV, "a number of GPUs", None,
           "GPUs of each host for `placement.<role>.gpus_per_proc` (unset: what CUDA shows the controller); set by "
           "the SLURM and Kubernetes launchers"),
    EnvVar(PROC_GPUS_ENV, "GPU indices, comma-separated", None,
           "the GPUs of its host a proc was given (unset: none of its own); set in each proc by the controller"),
    EnvVar(NODES_ENV, "a positive integer", None, "how many pods (hosts) a Kubernetes run has; set by its pod spec"),
    EnvVar(NAMESPACE_ENV, "a namespace", None, "the run's pods' namespace; the pod spec sets it from "
                                               "`metadata.namespace`"),
    EnvVar(POD_IP_ENV, "an IP address", None, "the pod's IP, which its worker advertises and the controller "
                                              "listens on; the pod spec sets it from `status.podIP`"),
    EnvVar(K8S_JOB_ENV, "a Job name", None, "the Kubernetes Job of the run's attempt: the controller attaches "
                                          "the pods of that Job only (`batch.kubernetes.io/job-name`), never an "
                                          "earlier attempt's; set by its pod spec"),
    EnvVar(TORCH_THREADS_ENV, "a number of threads", "1",
           "torch threads of each proc; set by the controller for its procs (`trainer.threads_per_process`)"),
    EnvVar(BATCH_ENV, "1 or unset", None, "1 in the client of a `monarch.job.SlurmJob` in batch mode; set by "
                                          "Monarch's batch runner"),
    EnvVar(SLURM_JOB_ID_ENV, "a job id", None, "the SLURM job, named in errors; set by SLURM"),
    EnvVar(SLURM_NODELIST_ENV, "host names, comma-separated", None, "the allocation's nodes; set by SLURM"),
    EnvVar(SLURM_NNODES_ENV, "a number of nodes", "1", "how many nodes the allocation has; set by SLURM"),
    EnvVar(LOCAL_RANK_ENV, "a number", "0", "a trainer rank's index on its host, which picks its GPU; set by "
                                            "Monarch's torch elastic setup"),
    EnvVar(MASTER_ADDR_ENV, "a host", None, "where the trainer ranks meet rank 0; set by Monarch's torch elastic "
                                            "setup, or by the controller when the ranks span hosts"),
)}

_NUMBER = re.compile(r"[0-9]+")


class EnvValueError(ValueError):
    """An environment variable's value is not of its type; the message names the variable."""


def read_env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable as set (empty included), its default when unset (None without one)."""
    return (os.environ if environ is None else environ).get(name, VARIABLES[name].default)


def env_is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the variable is in the environment at all (empty included)."""
    return VARIABLES[name].name in (os.environ if environ is None else environ)


def read_number(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """A whole number (surrounding blanks ignored); None when unset or blank and the variable has no default."""
    raw = (read_env(name, environ) or "").strip()
    if not raw and VARIABLES[name].default is None:
        return None
    if not _NUMBER.fullmatch(raw):
        raise EnvValueError(f"{name}: expected {VARIABLES[name].type}, got {raw!r}")
    return int(raw)
