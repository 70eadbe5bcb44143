"""The Monarch workers of a Kubernetes run, found and attached through `monarch.job`'s KubernetesJob.

A run's Indexed Job (workers/launch/kubernetes.py) has one pod per node; each pod serves a Monarch
worker at `tcp://<pod IP>:<MONARCH_PORT>`, and pod 0 also runs this controller. With
FORGEBOARD_MONARCH_JOB=kubernetes the controller does not read FORGEBOARD_MONARCH_WORKERS: it asks
the Kubernetes API for the pods of its attempt's Job. KubernetesJob in attach-only mode (no MonarchMesh
operator) watches the pods labelled `forgeboard.run-id=<run id>` and `batch.kubernetes.io/job-name=<the
attempt's Job>` (never an earlier attempt's, whose pods may still be terminating) until ranks 0..N-1 (the
Indexed Job's label `batch.kubernetes.io/job-completion-index`) are Ready, then attaches one host mesh to their workers, in
rank order. It dials each pod's IP at the port its container's MONARCH_PORT says (26600 without one).

Variables, set by the pod spec:
- FORGEBOARD_MONARCH_JOB: `kubernetes` selects this discovery;
- FORGEBOARD_RUN_ID: the run; its pods carry the label forgeboard.run-id=<id>;
- FORGEBOARD_K8S_JOB: the Job of the run's attempt; its pods carry the label batch.kubernetes.io/job-name=<it>;
- FORGEBOARD_RUN_NODES: how many pods (hosts) the run has;
- FORGEBOARD_POD_NAMESPACE: the pods' namespace (downward API `metadata.namespace`);
- FORGEBOARD_POD_IP: the pod's IP (downward API `status.podIP`): its worker advertises it, and this
  controller listens on it for the workers' replies.

The API is reached with the pod's in-cluster config: its service account must be allowed to get,
list and watch pods in the namespace (infra/k8s/engine-rbac.yaml).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from workers.engine.actors.monarch_job import MonarchJobError
from workers.engine.actors.worker import Worker, choose_transport
from workers.engine.env import K8S_JOB_ENV, NAMESPACE_ENV, NODES_ENV, POD_IP_ENV, RUN_ID_ENV, read_env

PORT_ENV = "MONARCH_PORT"  # on each pod's container; KubernetesJob reads it from the pod spec
DEFAULT_PORT = 26600  # KubernetesJob's port for a pod without MONARCH_PORT
RUN_LABEL = "forgeboard.run-id"
RANK_LABEL = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # the Job controller's label on each pod of a Job (1.27+)


class KubernetesWorkersError(MonarchJobError):
    """The run's pods could not be found or attached: the message says which and why."""


def _positive(environ: Mapping[str, str], name: str) -> int:
    raw = read_env(name, environ) or ""
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise KubernetesWorkersError(f"{name} must be a positive integer (set by the pod spec), got {raw!r}")
    return int(raw)


def kubernetes_hosts(*, environ: Mapping[str, str], timeout_s: float) -> tuple[list[Worker], Any]:
    """The run's workers in pod-rank order and the host mesh attached to them (its hosts in the same order).

    Waits up to `timeout_s` for every pod to be Ready; KubernetesWorkersError naming the cause when not."""
    run_id, nodes = _positive(environ, RUN_ID_ENV), _positive(environ, NODES_ENV)
    namespace, pod_ip = read_env(NAMESPACE_ENV, environ) or "", read_env(POD_IP_ENV, environ) or ""
    job_name = read_env(K8S_JOB_ENV, environ) or ""
    for name, value, source in ((NAMESPACE_ENV, namespace, "metadata.namespace"), (POD_IP_ENV, pod_ip, "status.podIP"),
                                (K8S_JOB_ENV, job_name, "the Job's name")):
        if not value:
            raise KubernetesWorkersError(f"{name} is not set (the pod spec sets it from {source})")
    # The pods of this attempt's Job only: an earlier attempt's may still be terminating, with the same run label.
    selector = f"{RUN_LABEL}={run_id},{JOB_NAME_LABEL}={job_name}"
    where = f"pods {selector} in namespace {namespace}"
    try:
        from monarch.job.kubernetes import KubernetesJob

        job = KubernetesJob(namespace=namespace, timeout=max(1, math.ceil(timeout_s)))
        # KubernetesJob chose TCP on whatever the hostname resolves to (refused when that is loopback only);
        # the pod's own IP is the address the workers can reach.
        choose_transport(f"[{pod_ip}]" if ":" in pod_ip else pod_ip)
        mesh_name = f"run{run_id}"  # lowercase letters and digits only
        job.add_mesh(mesh_name, nodes, label_selector=selector, pod_rank_label=RANK_LABEL)
        mesh = getattr(job.state(cached_path=None), mesh_name)  # no job cache file in the working directory
    except Exception as error:  # the package missing, the API refusing or unreachable, pods not Ready, the attach
        raise KubernetesWorkersError(f"Monarch workers of {where} not attached within {timeout_s:g} s: "
                                     f"{type(error).__name__}: {error}") from error
    # KubernetesJob keeps the pods it found only in private state that `state()` clears, so list them again
    # through the public client: an Indexed Job with backoffLimit 0 never replaces a pod, so this is the
    # same pod for each rank, with the same IP, and only our own labels and the pod spec are relied on.
    try:
        from kubernetes import client

        pods = client.CoreV1Api().list_namespaced_pod(namespace=namespace, label_selector=selector).items
    except Exception as error:  # the API refused or could not be reached
        raise KubernetesWorkersError(f"listing {where}: {type(error).__name__}: {error}") from error
    return _ranked_workers(pods, nodes=nodes, where=where), mesh


def _ranked_workers(pods: list[Any], *, nodes: int, where: str) -> list[Worker]:
    by_rank: dict[int, Any] = {}
    for pod in pods:
        rank = (pod.metadata.labels or {}).get(RANK_LABEL, "")
        if rank.isascii() and rank.isdigit() and int(rank) < nodes and _ready(pod) and pod.status.pod_ip:
            by_rank[int(rank)] = pod
    missing = [rank for rank in range(nodes) if rank not in by_rank]
    if missing:
        raise KubernetesWorkersError(f"{where}: no Ready pod with an IP for rank(s) {missing} after the attach")
    return [_worker(by_rank[rank]) for rank in range(nodes)]


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _worker(pod: Any) -> Worker:
    port = next((int(e.value) for c in pod.spec.containers for e in c.env or []
                 if e.name == PORT_ENV and (e.value or "").isascii() and (e.value or "").isdigit()), DEFAULT_PORT)
    ip = pod.status.pod_ip
    # An Indexed Job's pod has the hostname <job name>-<index>
    return Worker(name=pod.spec.hostname or pod.metadata.name, address=f"tcp://{ip}:{port}", host=ip, port=port)
