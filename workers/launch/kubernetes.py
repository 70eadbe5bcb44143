"""Kubernetes: the objects that start a run, and run states read from Job and Pod status objects.

Django-free, and it imports neither Monarch nor the `kubernetes` client. What goes through
`monarch.job` is the attach: the engine controller finds the run's workers with
`monarch.job.kubernetes.KubernetesJob` in attach-only mode (workers/engine/actors/kubernetes_workers.py),
which watches the run's pods through the API and attaches a host mesh to them. Creating the pods does
not: KubernetesJob creates workers only as MonarchMesh objects, which need the MonarchMesh CRD and its
operator installed in the cluster, and it cannot hand back a spec offline. This builder produces plain
dicts for `kubectl apply` or the API's create calls:

- an Indexed Job, one pod per node: every pod serves a Monarch worker at `tcp://<pod IP>:<port>`
  (the IP from the downward API; the port also in MONARCH_PORT, where KubernetesJob looks for it),
  Ready once the worker accepts connections; pod 0 also runs the engine controller, and the Job's
  success policy ends the run when pod 0 succeeds;
- a ConfigMap holding the run's config file.

The engine's working directory RUN_DIR (its checkpoints) is an emptyDir, gone with the pod, unless the request names
a PersistentVolumeClaim (`run_volume_claim`): then it is that claim's folder `run-<run id>`, shared by the run's
attempts, so that a restarted run resumes from its own last checkpoint (the config's checkpoint.resume_latest). With
`fs_group` the pods' fsGroup is that group, so that an image running as non-root may write the claim's folder.

The job poller deletes a Job once its run's end is recorded; `ttlSecondsAfterFinished`, long, is a backstop for what
it missed.

The pods run as a service account that may get, list and watch pods in the namespace (the
controller's discovery; infra/k8s/engine-rbac.yaml). The run token comes from an existing Secret
(key `token`), mounted read-only.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.engine.actors.kubernetes_workers import PORT_ENV, RANK_LABEL, RUN_LABEL
from workers.engine.env import GPUS_PER_HOST_ENV, JOB_ENV, K8S_JOB_ENV, NAMESPACE_ENV, NODES_ENV, POD_IP_ENV
from workers.launch.slurm import (
    RESERVED_ENVIRONMENT,
    LaunchSpecError,
    SchedulerStatus,
    check_environment,
    check_positive,
    engine_argv,
    run_environment,
)

__all__ = ["KubernetesLaunchRequest", "kubernetes_objects", "kubernetes_job_status", "LaunchSpecError",
           "SchedulerStatus"]

DEFAULT_MONARCH_PORT = 26600
DEFAULT_SERVICE_ACCOUNT = "forgeboard-engine"  # infra/k8s/engine-rbac.yaml
# Set by the pod spec for the engine's discovery; not for a run's `environment` to override.
_DISCOVERY_ENVIRONMENT = frozenset({JOB_ENV, K8S_JOB_ENV, NODES_ENV, NAMESPACE_ENV, POD_IP_ENV, PORT_ENV})
TOKEN_DIR = "/var/run/secrets/forgeboard"
CONFIG_DIR = "/etc/forgeboard/run"
RUN_DIR = "/var/lib/forgeboard/run"  # the engine's working directory: its checkpoints and files
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_GROUP_ID = 2**31 - 1  # what the API server accepts as a pod's fsGroup
_QUANTITY = re.compile(r"^[1-9][0-9]*(Ki|Mi|Gi|Ti)?$")
# Waiting reasons after which a pod will not start without someone fixing the spec or the image.
_FATAL_WAITING = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
                  "CreateContainerError", "ErrImageNeverPull"}


def kubernetes_job_name(*, run_id: int, attempt: int) -> str:
    """The Job (and ConfigMap) of a run's attempt: a restart never meets its lost attempt's objects."""
    return f"forgeboard-run-{run_id}" + (f"-{attempt}" if attempt else "")


@dataclass(frozen=True)
class KubernetesLaunchRequest:
    run_id: int
    image: str
    config_yaml: str
    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    memory: str  # per node, as a Kubernetes quantity: "1600Gi"
    namespace: str
    control_plane_url: str
    token_secret: str  # an existing Secret with the run token under the key "token"
    python: str = "python"  # the interpreter inside the image (a venv path, if the image has one)
    overrides: tuple[str, ...] = ()
    environment: Mapping[str, str] = field(default_factory=dict)
    allowed_paths: tuple[str, ...] = ()  # what the engine's preflight accepts besides RUN_DIR (FORGEBOARD_ALLOWED_PATHS)
    shared_memory: str = "64Gi"  # /dev/shm for NCCL
    node_selector: Mapping[str, str] = field(default_factory=dict)
    service_account: str = DEFAULT_SERVICE_ACCOUNT  # may get, list and watch pods (the controller's discovery)
    active_deadline_s: int | None = None
    # The API server deletes the Job (its pods, ConfigMap and Secret with it) this long after it finished: a backstop
    # for what the job poller, which deletes it once the run's end is recorded, missed. None: never.
    ttl_after_finished_s: int | None = None
    monarch_port: int = DEFAULT_MONARCH_PORT
    attempt: int = 0  # the run's restart count: each attempt has a Job of its own
    # A PersistentVolumeClaim in the namespace holding RUN_DIR (ReadWriteMany for a run of several pods), in the folder
    # `run_subpath`: the run's checkpoints outlive its pods. None: an emptyDir, lost with the pod.
    run_volume_claim: str | None = None
    # The pods' fsGroup: volumes that honour it (the run volume claim, on most storage classes) are made writable by
    # this group, for an image that runs as non-root. None: the pod sets none, and the volumes stay as they are.
    fs_group: int | None = None

    @property
    def name(self) -> str:
        return kubernetes_job_name(run_id=self.run_id, attempt=self.attempt)

    @property
    def run_subpath(self) -> str:
        """The run's folder in the run volume claim: the same for every attempt of the run."""
        return f"run-{self.run_id}"

    @property
    def token_file(self) -> str:
        return f"{TOKEN_DIR}/token"

    @property
    def config_path(self) -> str:
        return f"{CONFIG_DIR}/config.yaml"

    def controller_argv(self) -> list[str]:
        return engine_argv(python=self.python, config_path=self.config_path, overrides=self.overrides)

    def check(self) -> None:
        check_positive("run_id", self.run_id)
        check_positive("nodes", self.nodes)
        check_positive("cpus_per_node", self.cpus_per_node)
        if not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool) or self.gpus_per_node < 0:
            raise LaunchSpecError("gpus_per_node", "must be an integer, 0 or more")
        if not self.image or any(c.isspace() for c in self.image):
            raise LaunchSpecError("image", "must be an image reference without spaces")
        for name in ("namespace", "token_secret", "service_account"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _DNS_LABEL.match(value):
                raise LaunchSpecError(name, f"{value!r} is not a DNS label (lowercase letters, digits, dashes)")
        if self.run_volume_claim is not None and not (isinstance(self.run_volume_claim, str)
                                                      and _DNS_SUBDOMAIN.match(self.run_volume_claim)):
            raise LaunchSpecError("run_volume_claim", f"{self.run_volume_claim!r} is not a DNS subdomain "
                                                      "(lowercase letters, digits, dashes and dots)")
        if self.fs_group is not None and not (isinstance(self.fs_group, int) and not isinstance(self.fs_group, bool)
                                              and 0 <= self.fs_group <= MAX_GROUP_ID):
            raise LaunchSpecError("fs_group", f"{self.fs_group!r} is not a group id (an integer, 0 to {MAX_GROUP_ID})")
        for name in ("memory", "shared_memory"):
            if not _QUANTITY.match(getattr(self, name)):
                raise LaunchSpecError(name, f"{getattr(self, name)!r} is not a quantity such as 512Gi")
        if not self.config_yaml.strip():
            raise LaunchSpecError("config_yaml", "must not be empty")
        if self.active_deadline_s is not None:
            check_positive("active_deadline_s", self.active_deadline_s)
        if self.ttl_after_finished_s is not None:
            check_positive("ttl_after_finished_s", self.ttl_after_finished_s)
        if not 1024 <= self.monarch_port <= 65535:
            raise LaunchSpecError("monarch_port", "must be from 1024 to 65535")
        check_environment(self.environment, reserved=RESERVED_ENVIRONMENT | _DISCOVERY_ENVIRONMENT)


# The worker advertises exactly the address KubernetesJob dials (the pod IP and MONARCH_PORT), listening on
# every interface; it runs until its host mesh shuts it down.
WORKER_CODE = ("import os; from monarch.actor import run_worker_loop_forever; "
               f'ip, port = os.environ["{POD_IP_ENV}"], os.environ["{PORT_ENV}"]; '
               'run_worker_loop_forever(address=f"tcp://{ip}:{port}@tcp://0.0.0.0:{port}", ca="trust_all_connections")')


def _container_script(request: KubernetesLaunchRequest) -> str:
    worker = shlex.join([request.python, "-c", WORKER_CODE])
    return "\n".join([
        "set -eu",
        'if [ "$JOB_COMPLETION_INDEX" = "0" ]; then',
        f"  {worker} &",
        f"  exec {shlex.join(request.controller_argv())}",
        "fi",
        f"exec {worker}",
    ])


def kubernetes_objects(request: KubernetesLaunchRequest) -> list[dict[str, Any]]:
    """The ConfigMap and Job for a run, in the order to create them."""
    request.check()
    labels = {"app.kubernetes.io/name": "forgeboard", "app.kubernetes.io/component": "engine",
              RUN_LABEL: str(request.run_id)}
    metadata = {"name": request.name, "namespace": request.namespace, "labels": labels}
    environment = run_environment(run_id=request.run_id, control_plane_url=request.control_plane_url,
                                  token_file=request.token_file, extra=request.environment,
                                  allowed_paths=list(dict.fromkeys((RUN_DIR, *request.allowed_paths)))
                                  if request.allowed_paths else ())
    environment |= {JOB_ENV: "kubernetes", K8S_JOB_ENV: request.name, NODES_ENV: str(request.nodes),
                    PORT_ENV: str(request.monarch_port)}
    if request.gpus_per_node:  # the engine hands them to procs (placement gpus_per_proc)
        environment[GPUS_PER_HOST_ENV] = str(request.gpus_per_node)
    from_pod = {NAMESPACE_ENV: "metadata.namespace", POD_IP_ENV: "status.podIP"}  # the downward API
    resources: dict[str, Any] = {
        "requests": {"cpu": str(request.cpus_per_node), "memory": request.memory},
        "limits": {"memory": request.memory},
    }
    if request.gpus_per_node:
        resources["requests"]["nvidia.com/gpu"] = str(request.gpus_per_node)
        resources["limits"]["nvidia.com/gpu"] = str(request.gpus_per_node)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "serviceAccountName": request.service_account,
        "automountServiceAccountToken": True,  # the controller's in-cluster config reads its token
        "containers": [{
            "name": "engine",
            "image": request.image,
            "command": ["/bin/sh", "-c", _container_script(request)],
            "workingDir": RUN_DIR,
            "env": [*({"name": key, "value": value} for key, value in environment.items()),
                    *({"name": key, "valueFrom": {"fieldRef": {"fieldPath": path}}} for key, path in from_pod.items())],
            "ports": [{"name": "monarch", "containerPort": request.monarch_port}],
            # Ready (what the controller's discovery waits for) once the worker accepts connections.
            "readinessProbe": {"tcpSocket": {"port": "monarch"}, "periodSeconds": 2},
            "resources": resources,
            "volumeMounts": [
                {"name": "run-token", "mountPath": TOKEN_DIR, "readOnly": True},
                {"name": "run-config", "mountPath": CONFIG_DIR, "readOnly": True},
                {"name": "dshm", "mountPath": "/dev/shm"},
                {"name": "run", "mountPath": RUN_DIR} | ({"subPath": request.run_subpath}
                                                        if request.run_volume_claim else {}),
            ],
        }],
        "volumes": [
            # Readable by the image's user, root or not: the container is the boundary.
            {"name": "run-token", "secret": {"secretName": request.token_secret, "defaultMode": 0o444,
                                             "items": [{"key": "token", "path": "token"}]}},
            {"name": "run-config", "configMap": {"name": request.name}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": request.shared_memory}},
            {"name": "run"} | ({"persistentVolumeClaim": {"claimName": request.run_volume_claim}}
                               if request.run_volume_claim else {"emptyDir": {}}),
        ],
    }
    if request.fs_group is not None:  # the group's ownership applied once, not again while the claim's root has it
        pod_spec["securityContext"] = {"fsGroup": request.fs_group, "fsGroupChangePolicy": "OnRootMismatch"}
    if request.gpus_per_node:
        pod_spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if request.node_selector:
        pod_spec["nodeSelector"] = dict(request.node_selector)
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": request.nodes,
        "parallelism": request.nodes,
        "backoffLimit": 0,
        # Pod 0 runs the controller: when it succeeds the run is done and the worker pods are stopped.
        "successPolicy": {"rules": [{"succeededIndexes": "0"}]},
        "template": {"metadata": {"labels": labels}, "spec": pod_spec},
    }
    if request.active_deadline_s:
        job_spec["activeDeadlineSeconds"] = request.active_deadline_s
    if request.ttl_after_finished_s:
        job_spec["ttlSecondsAfterFinished"] = request.ttl_after_finished_s
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
                  "data": {"config.yaml": request.config_yaml}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": job_spec}
    return [config_map, job]


# --- run states from Job and Pod status ------------------------------------------------------------

def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return condition
    return None


def _pod_name(pod: Mapping[str, Any]) -> str:
    return (pod.get("metadata") or {}).get("name", "?")


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def _pod_failure(pod: Mapping[str, Any]) -> tuple[int, SchedulerStatus] | None:
    """Why this pod failed or will never start, ranked: 0 a specific cause, 1 an exit code, 2 no detail."""
    status = pod.get("status") or {}
    name = _pod_name(pod)
    if status.get("reason") == "Evicted":
        return 0, SchedulerStatus("lost", f"pod {name} was evicted: {status.get('message', '').strip()}".rstrip(": "))
    disruption = _condition(pod, "DisruptionTarget")
    if disruption is not None:
        return 0, SchedulerStatus("lost", f"pod {name} was disrupted ({disruption.get('reason')}): "
                                          f"{disruption.get('message', '')}".rstrip(": "))
    if status.get("phase") == "Unknown" or status.get("reason") == "NodeLost":
        return 0, SchedulerStatus("lost", f"pod {name} lost contact with its node")
    for container in _containers(pod):
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in _FATAL_WAITING:
            return 0, SchedulerStatus("failed", f"pod {name} cannot start: {waiting['reason']}: "
                                                f"{waiting.get('message', '')}".rstrip(": "))
        terminated = state.get("terminated") or {}
        if terminated.get("reason") == "OOMKilled":
            return 0, SchedulerStatus("failed", f"container {container.get('name')} in pod {name} ran out of "
                                                "memory (OOMKilled); raise the memory limit or lower the batch size")
        if terminated and terminated.get("exitCode", 0) != 0:
            detail = f"exit code {terminated.get('exitCode')}"
            if terminated.get("reason"):
                detail += f", {terminated['reason']}"
            return 1, SchedulerStatus("failed", f"container {container.get('name')} in pod {name} failed ({detail})")
    if status.get("phase") == "Failed":
        why = status.get("reason") or status.get("message") or "no reason given"
        return 2, SchedulerStatus("failed", f"pod {name} failed: {why}")
    return None


def _index(pod: Mapping[str, Any]) -> str | None:
    metadata = pod.get("metadata") or {}
    return (metadata.get("labels") or {}).get(RANK_LABEL) or (metadata.get("annotations") or {}).get(RANK_LABEL)


def _controller_index_completed(job: Mapping[str, Any]) -> bool:
    """Whether the Job's status counts index 0 (pod 0, the controller's) among its completed indexes: "0", "0-3,5"."""
    completed = str((job.get("status") or {}).get("completedIndexes") or "")
    return completed.split(",")[0].split("-")[0] == "0"


def _unschedulable(pod: Mapping[str, Any]) -> str | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return condition.get("message") or condition.get("reason") or "not scheduled yet"
    return None


def kubernetes_job_status(job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> SchedulerStatus:
    """A run's Job and its pods (`kubectl get pods -l batch.kubernetes.io/job-name=<Job> -o json`) as a run state."""
    if not isinstance(job, Mapping) or job.get("kind", "Job") != "Job":
        raise LaunchSpecError("job", "expected a batch/v1 Job object")
    job_id = (job.get("metadata") or {}).get("name", "")
    ordered = sorted(pods, key=_pod_name)
    if _condition(job, "Complete") or _condition(job, "SuccessCriteriaMet"):
        return SchedulerStatus("succeeded", "the controller pod succeeded", job_id)
    if any(_index(p) == "0" and (p.get("status") or {}).get("phase") == "Succeeded" for p in ordered):
        return SchedulerStatus("succeeded", "the controller pod succeeded", job_id)
    if _controller_index_completed(job):  # counted by the Job controller, the pod itself perhaps removed since
        return SchedulerStatus("succeeded", "the controller pod succeeded", job_id)
    failed = _condition(job, "Failed") or _condition(job, "FailureTarget")
    # A pod's own failure says more than the Job's summary (BackoffLimitExceeded); once one pod fails the
    # others are stopped with generic exit codes, so the most specific cause wins.
    failures = [f for f in map(_pod_failure, ordered) if f is not None]
    if failures:
        _rank, failure = min(failures, key=lambda f: f[0])
        return SchedulerStatus(failure.state, failure.reason, job_id)
    if failed is not None:
        reason = failed.get("reason") or "Failed"
        if reason == "DeadlineExceeded":
            return SchedulerStatus("failed", "the job ran past its active deadline", job_id)
        return SchedulerStatus("failed", f"the job failed ({reason}): {failed.get('message', '')}".rstrip(": "), job_id)
    if (job.get("spec") or {}).get("suspend") or _condition(job, "Suspended"):
        return SchedulerStatus("queued", "the job is suspended, waiting for admission", job_id)
    for pod in ordered:
        reason = _unschedulable(pod)
        if reason is not None:
            return SchedulerStatus("queued", f"pod {_pod_name(pod)} is waiting for a node: {reason}", job_id)
    expected = (job.get("spec") or {}).get("parallelism") or len(ordered) or 1
    running = [p for p in ordered if (p.get("status") or {}).get("phase") == "Running"]
    if ordered and len(running) >= expected:
        nodes = ",".join(dict.fromkeys(str(node) for p in running if (node := (p.get("spec") or {}).get("nodeName"))))
        return SchedulerStatus("running", f"{len(running)} of {expected} pods running", job_id, nodes=nodes)
    return SchedulerStatus("launching", f"{len(running)} of {expected} pods running; the rest are starting", job_id)
