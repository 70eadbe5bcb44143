"""The Kubernetes launch backend: create a claimed run's objects through the API server, follow its Job, delete it.

A run whose config says `placement.backend: kubernetes` is placed by Kubernetes, not on the
inventory. A worker configured for it (`FORGEBOARD_K8S_API_URL`, `FORGEBOARD_K8S_NAMESPACE`,
`FORGEBOARD_K8S_IMAGE`; in a pod, the service account's token and CA) creates a Secret with the run
token, then the ConfigMap and Indexed Job built by `workers/launch/kubernetes.py`, and makes the Secret and ConfigMap
dependents of the Job (ownerReferences): whoever deletes the Job deletes them too. A submission that fails half-way
deletes what it created. The Job's pods run as
`FORGEBOARD_K8S_ENGINE_SERVICE_ACCOUNT`, which must exist in the namespace and may read its pods (the
engine controller finds its workers through the API: infra/k8s/engine-rbac.yaml).
With `FORGEBOARD_K8S_RUN_VOLUME_CLAIM` the pods' run folder is that PersistentVolumeClaim's `run-<run id>`, shared by
the run's attempts, and the engine's config resumes from the newest checkpoint there (checkpoint.resume_latest): a
restarted run goes on from its last checkpoint. Without it the run folder is an emptyDir, and the submission's
timeline message says that a restart starts from step 0.
`runs.poll_jobs` reads the Job and its pods (by the Job's label: never an earlier attempt's) and moves the run as
`workers/launch/jobs.py` says; a run cancelled while its pods wait to be scheduled has its Job, ConfigMap and Secret
deleted. Once a run's end is recorded and its Job has ended, the next poll deletes the Job, its pods, ConfigMap and
Secret (`remove_ended_attempts`): never before, so a poller that stops in between leaves it readable; one whose
deletion is refused is deleted by a later poll. The Job's `ttlSecondsAfterFinished`
(`FORGEBOARD_K8S_JOB_TTL_S`, a week) is a backstop for what no poll deleted. A lost run's Job is deleted with its pods
(`stop_kubernetes_job`, asked by the reconciler) and the run restarts, as a Job of its own named for the attempt,
only once none of those pods is left; if the Job turns out to have completed as it was deleted, the run ends
succeeded instead.

Plain HTTP through httpx (no `kubernetes` client package): a few object kinds, create / get / list / patch / delete.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from django.conf import settings
from django.utils import timezone

from forgeboard.runs.models import LaunchBackend, Run
from forgeboard.runs.reconcile import lost_attempt_finished
from forgeboard.runs.states import TERMINAL_STATES, RunState
from forgeboard.runs.tokens import run_token_issue
from forgeboard.telemetry.models import EventKind
from forgeboard.telemetry.services import event_append
from workers.engine.actors.kubernetes_workers import JOB_NAME_LABEL
from workers.launch.jobs import FOLLOWED_STATES, fail_launch, follow_job, node_shape
from workers.launch.kubernetes import (RUN_DIR, RUN_LABEL, KubernetesLaunchRequest, kubernetes_job_name,
                                      kubernetes_job_status, kubernetes_objects)
from workers.launch.local import engine_allowed_paths, engine_config_yaml
from workers.launch.slurm import JobStillCompleting, LaunchSpecError, SchedulerStatus

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30
_PATHS = {  # kind -> collection path under a namespace
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs",
    "Pod": "/api/v1/namespaces/{ns}/pods",
}


class KubernetesApiFailed(RuntimeError):
    """The API server refused a request or could not be reached: the reason says which and why."""


@dataclass
class KubernetesApi:
    base_url: str
    namespace: str
    token: str | None = None
    verify: str | bool = True  # a CA bundle path, or True for the system's
    transport: httpx.BaseTransport | None = None

    def _client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.base_url.rstrip("/"), headers=headers, verify=self.verify,
                            timeout=REQUEST_TIMEOUT_S, transport=self.transport)

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            with self._client() as client:
                return client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise KubernetesApiFailed(f"{method} {path}: {exc}") from None

    @staticmethod
    def _refused(response: httpx.Response, what: str) -> KubernetesApiFailed:
        try:
            message = response.json().get("message") or response.text
        except ValueError:
            message = response.text
        return KubernetesApiFailed(f"{what}: HTTP {response.status_code}: {str(message).strip()[:500]}")

    def _collection(self, kind: str) -> str:
        return _PATHS[kind].format(ns=quote(self.namespace, safe=""))

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create an object; the object as the API server keeps it. One that already exists (a redelivered launch) is
        left as it is, and read."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        response = self._call("POST", self._collection(kind), json=obj)
        if response.status_code == 409:
            existing = self._get(kind, name)
            if existing is None:
                raise KubernetesApiFailed(f"creating {kind} {name}: it exists, then it does not (being deleted?)")
            return existing
        if response.status_code >= 300:
            raise self._refused(response, f"creating {kind} {name}")
        return response.json()

    def owned_by(self, kind: str, name: str, *, owner: dict[str, Any]) -> None:
        """Make the object a dependent of `owner` (an ownerReference: apiVersion, kind, name, uid): the garbage
        collector deletes it once its owner is deleted, however that is, or is found gone already."""
        response = self._call("PATCH", f"{self._collection(kind)}/{quote(name, safe='')}",
                              content=json.dumps({"metadata": {"ownerReferences": [owner]}}),
                              headers={"Content-Type": "application/merge-patch+json"})
        if response.status_code >= 300:
            raise self._refused(response, f"making {kind} {name} a dependent of {owner['kind']} {owner['name']}")

    def get_job(self, name: str) -> dict[str, Any] | None:
        return self._get("Job", name)

    def _get(self, kind: str, name: str) -> dict[str, Any] | None:
        response = self._call("GET", f"{self._collection(kind)}/{quote(name, safe='')}")
        if response.status_code == 404:
            return None
        if response.status_code >= 300:
            raise self._refused(response, f"reading {kind} {name}")
        return response.json()

    def jobs(self, selector: str) -> list[dict[str, Any]]:
        """The namespace's Jobs that a label selector selects."""
        response = self._call("GET", self._collection("Job"), params={"labelSelector": selector})
        if response.status_code >= 300:
            raise self._refused(response, f"listing the Jobs labelled {selector}")
        return list(response.json().get("items") or [])

    def job_pods(self, name: str) -> list[dict[str, Any]]:
        """The pods of one Job (one attempt of a run), by the label the Job controller gives them: also those left
        after the Job is gone (still terminating, or orphaned)."""
        return self._pods(f"{JOB_NAME_LABEL}={name}", what=f"the pods of Job {name}")

    def _pods(self, selector: str, *, what: str) -> list[dict[str, Any]]:
        response = self._call("GET", self._collection("Pod"), params={"labelSelector": selector})
        if response.status_code >= 300:
            raise self._refused(response, f"listing {what}")
        return list(response.json().get("items") or [])

    def delete(self, kind: str, name: str, *, propagation: str = "Background") -> None:
        """Delete an object and what it owns (a Job's pods); one already gone is fine. With "Foreground" propagation
        the object stays (being deleted) until what it owns is gone."""
        response = self._call("DELETE", f"{self._collection(kind)}/{quote(name, safe='')}",
                              params={"propagationPolicy": propagation})
        if response.status_code not in (200, 202, 404):
            raise self._refused(response, f"deleting {kind} {name}")


def kubernetes_configured() -> bool:
    return bool(settings.K8S_API_URL and settings.K8S_IMAGE)


def kubernetes_api() -> KubernetesApi:
    token_file = Path(settings.K8S_TOKEN_FILE)
    ca_file = Path(settings.K8S_CA_FILE)
    return KubernetesApi(base_url=settings.K8S_API_URL, namespace=settings.K8S_NAMESPACE,
                         token=token_file.read_text().strip() if token_file.is_file() else None,
                         verify=str(ca_file) if ca_file.is_file() else True)


def kubernetes_request(*, run: Run) -> KubernetesLaunchRequest:
    """The Job request for a run: pods (one per node) enough for its GPUs, the worker's Kubernetes settings. With a run
    volume claim the engine keeps its checkpoints there and resumes from the newest at start."""
    nodes, gpus_per_node = node_shape(run=run, gpus_per_node=settings.K8S_GPUS_PER_NODE)
    name = kubernetes_job_name(run_id=run.pk, attempt=run.restart_count)
    claim = settings.K8S_RUN_VOLUME_CLAIM
    config_yaml = engine_config_yaml(run, run_folder=Path(RUN_DIR) if claim else None)
    return KubernetesLaunchRequest(
        run_id=run.pk, attempt=run.restart_count, image=settings.K8S_IMAGE, config_yaml=config_yaml,
        run_volume_claim=claim, fs_group=settings.K8S_RUN_FS_GROUP,
        nodes=nodes, gpus_per_node=gpus_per_node,
        cpus_per_node=settings.K8S_CPUS_PER_NODE, memory=settings.K8S_MEMORY, namespace=settings.K8S_NAMESPACE,
        control_plane_url=settings.PUBLIC_URL, token_secret=_token_secret(name), python=settings.K8S_PYTHON,
        service_account=settings.K8S_ENGINE_SERVICE_ACCOUNT, ttl_after_finished_s=settings.K8S_JOB_TTL_S or None,
        allowed_paths=tuple(engine_allowed_paths(run=run, run_folder=RUN_DIR)),
    )


def submit_kubernetes(*, run: Run, api: KubernetesApi | None = None) -> str:
    """Create the run's Secret, ConfigMap and Job; the Job's name (stored as the run's job id)."""
    api = api or kubernetes_api()
    try:
        request = kubernetes_request(run=run)
        objects = kubernetes_objects(request)
    except LaunchSpecError as exc:
        fail_launch(run=run, reason=f"Kubernetes launch settings: {exc}")
        return ""
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": request.token_secret, "namespace": request.namespace,
                           "labels": {RUN_LABEL: str(run.pk)}},
              "stringData": {"token": run_token_issue(run=run)}}
    created: list[tuple[str, str]] = []
    try:
        for obj in [secret, *objects]:
            kept = api.create(obj)
            created.append((obj["kind"], obj["metadata"]["name"]))
        # The Job owns the Secret and ConfigMap: whoever deletes the Job (a cancel, a stop, `kubectl delete job`)
        # deletes them with it, at whatever step of this submission that comes.
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": request.name, "uid": kept["metadata"]["uid"]}
        for kind, name in created[:-1]:
            api.owned_by(kind, name, owner=owner)
    except KubernetesApiFailed as exc:
        left = _delete_created(api, created)
        if left:  # recorded, so that the launch's failure has the reconciler remove them (leftover_stop_since)
            Run.objects.filter(pk=run.pk).update(job_id=request.name)
        fail_launch(run=run, reason=f"Kubernetes refused the run: {exc}" + (f"; {left}" if left else ""))
        return ""
    Run.objects.filter(pk=run.pk).update(job_id=request.name)
    event_append(run=run, kind=EventKind.MESSAGE,
                 payload={"name": "job_submitted", "backend": "kubernetes", "job_id": request.name,
                          "namespace": request.namespace, "nodes": request.nodes, "gpus_per_node": request.gpus_per_node,
                          "checkpoints": _where_checkpoints_are(request)})
    logger.info("run %s created as Kubernetes Job %s", run.pk, request.name, extra={"run_id": run.pk})
    return request.name


def _where_checkpoints_are(request: KubernetesLaunchRequest) -> str:
    if request.run_volume_claim:
        return (f"its checkpoints are in PersistentVolumeClaim {request.run_volume_claim}, folder "
                f"{request.run_subpath}: a restart resumes from the last")
    return ("its checkpoints are in the pod's emptyDir: a restart starts from step 0 "
            "(set FORGEBOARD_K8S_RUN_VOLUME_CLAIM)")


def _delete_created(api: KubernetesApi, created: list[tuple[str, str]]) -> str:
    """Delete what a submission that failed half-way created, the Job (with its pods) first; what is left, said."""
    left = []
    for kind, name in reversed(created):
        try:
            api.delete(kind, name)
        except KubernetesApiFailed as exc:
            left.append(str(exc))
    return f"left to remove: {'; '.join(left)}" if left else ""


def delete_kubernetes_objects(*, name: str, api: KubernetesApi) -> None:
    """Delete an attempt's Job (its pods with it, in the background), ConfigMap and token Secret: a run cancelled
    while its pods wait, or one whose end is recorded. The Job owns the other two; they are deleted by name as well,
    whatever the garbage collector has done yet."""
    api.delete("Job", name)
    _delete_dependents(name=name, api=api)


def _token_secret(job: str) -> str:
    return f"{job}-token"


def _delete_dependents(*, name: str, api: KubernetesApi) -> None:
    """The attempt's ConfigMap and token Secret (dependents of its Job), by name: a 404 is fine."""
    api.delete("ConfigMap", name)
    api.delete("Secret", _token_secret(name))


def remove_ended_attempts(*, api: KubernetesApi, followed: Collection[int] = ()) -> dict[int, str]:
    """Delete the Job, pods, ConfigMap and token Secret of each attempt whose run has ended and whose Job has ended
    too; what was done, by run id.

    The namespace's Jobs are what is left to delete: those of runs whose end is recorded in the database (a terminal
    state) are deleted once they say they have ended themselves (an engine reports its run's end before its pod
    exits). A Job is left as it is while it still runs (for FORGEBOARD_JOB_CANCEL_GRACE_S after its run's end: then
    its pods hold their GPUs for nothing, and it is deleted all the same), while it is being deleted already, when it is not its run's
    current attempt, when its run's leftover attempt is the reconciler's to stop (`leftover_stop_since`), and when
    its run is not this control plane's; so are those of the runs `followed` by this poll, whose end it may have
    just recorded, or lost to a stop that ended the run meanwhile: the next poll deletes them, the run's end read
    back from the database. A deletion that fails is logged; the Job stays, and the next poll tries again.
    """
    jobs = {_name(job): job for job in api.jobs(RUN_LABEL)}
    run_ids = {int(run_id) for job in jobs.values()  # not a run id of ours: another's, or out of any id's range
               if (run_id := str(_labels(job).get(RUN_LABEL, ""))).isdigit() and len(run_id) <= 18}
    ended = Run.objects.filter(pk__in=run_ids, backend=LaunchBackend.KUBERNETES, state__in=TERMINAL_STATES,
                               leftover_stop_since__isnull=True).exclude(job_id="").exclude(pk__in=followed)
    done: dict[int, str] = {}
    for run in ended:
        job = jobs.get(run.job_id)
        if job is None or _labels(job).get(RUN_LABEL) != str(run.pk) or _being_deleted(job):
            continue
        try:
            status = kubernetes_job_status(job, api.job_pods(run.job_id))
            ended_s = (timezone.now() - (run.finished_at or timezone.now())).total_seconds()
            if not status.terminal and ended_s < settings.JOB_CANCEL_GRACE_S:
                done[run.pk] = f"its Job {run.job_id} is still {status.state}, though its run has ended: left to end"
                continue
            delete_kubernetes_objects(name=run.job_id, api=api)
            if not status.terminal:  # its pods hold their GPUs for nothing: the run's token no longer works
                done[run.pk] = (f"its Job {run.job_id} deleted: still {status.state} {round(ended_s)} s after its run "
                                "had ended")
                continue
        except (KubernetesApiFailed, LaunchSpecError) as exc:
            logger.warning("run %s ended, its Kubernetes Job %s is left: %s", run.pk, run.job_id, exc,
                           extra={"run_id": run.pk})
            done[run.pk] = f"its Job {run.job_id} is left: {exc}"
            continue
        done[run.pk] = f"its Job {run.job_id} deleted"
    return done


def kubernetes_attempt_status(*, name: str, job: dict[str, Any] | None,
                              pods: list[dict[str, Any]]) -> SchedulerStatus | None:
    """An attempt's Job and its pods (by the Job's label) as a run state; its Job gone, only what its pods left say:
    its controller pod succeeded. None when nothing says."""
    if job is not None:
        return kubernetes_job_status(job, pods)
    if not pods:
        return None
    status = kubernetes_job_status({"kind": "Job", "metadata": {"name": name}}, pods)
    return status if status.state == "succeeded" else None


def stop_kubernetes_job(*, name: str, api: KubernetesApi | None = None,
                        finished: Callable[[SchedulerStatus], bool] | None = None) -> str:
    """Delete a lost run's Job with its pods, then its ConfigMap and token Secret; what was done once none of its pods
    is left.

    A pod being deleted (Terminating: its deletionTimestamp set) may still run the engine through its grace period, or
    for as long as its node does not answer, and a Job deleted without waiting for its pods (`kubectl delete job`) is
    gone while they still run; so the Job's pods are listed by its label, whatever became of the Job. The Job is
    deleted in the foreground: it stays, being deleted, until the garbage collector has removed its pods. Pods left
    without their Job and not being deleted (orphaned: `kubectl delete job --cascade=orphan`) are deleted one by one.

    The attempt may have completed just before its Job was deleted: while the Job (being deleted, its status kept)
    or its pods are left, every stop reads them, the pods first, then the Job, which counts a succeeded pod before
    that pod can be removed. Once they say the controller pod succeeded, `finished` is told (it ends a lost run
    succeeded and says whether it did so); if it did, that is what is returned, and the deletion goes on by itself.
    Once nothing is left, a lost run silent for longer than the Jobs' ttlSecondsAfterFinished fails instead of
    restarting (`_end_unknown`): its Job may have ended, finished even, and been deleted by that TTL before any poll
    read it.
    Raises JobStillCompleting while the Job or any of its pods is left, KubernetesApiFailed when the API server cannot
    be read or refuses a deletion."""
    api = api or kubernetes_api()
    job = api.get_job(name)
    if job is not None and not _being_deleted(job):
        api.delete("Job", name, propagation="Foreground")
    pods = api.job_pods(name)
    if job is not None:
        job = api.get_job(name)  # read after its pods: a pod counted and removed meanwhile is in its status
    status = kubernetes_attempt_status(name=name, job=job, pods=pods)
    if finished is not None and status is not None and status.state == "succeeded" and finished(status):
        return f"Kubernetes Job {name} had completed as it was stopped ({status.reason})"
    if job is None:
        for pod in pods:
            if not _being_deleted(pod):
                api.delete("Pod", _pod_name(pod))
    if job is not None or pods:
        raise JobStillCompleting(_still_stopping(name, job_left=job is not None, pods=pods))
    unknown = _end_unknown(name=name)
    if unknown:
        return unknown
    # Owned by the Job, so gone with it by now, or soon; deleted by name all the same (a 404 is fine): a stop is
    # confirmed only once nothing the submission created is left. The token in the Secret is revoked already.
    _delete_dependents(name=name, api=api)
    return f"Kubernetes Job {name} and its pods are gone"


def _end_unknown(*, name: str) -> str:
    """The lost run whose Job `name` is gone, its pods too, may have had it deleted by its ttlSecondsAfterFinished
    once it had ended, nobody having read its end, if it has been silent at least that long (its engine heartbeats
    until its pod ends): it fails, said why, rather than restart to train again after it perhaps finished. What was
    done; "" when nothing was (the TTL cannot have deleted it, or the run no longer records it)."""
    ttl = settings.K8S_JOB_TTL_S
    run = Run.objects.filter(backend=LaunchBackend.KUBERNETES, job_id=name, state=RunState.LOST).first()
    if not ttl or run is None or run.last_heartbeat_at is None:
        return ""
    silent = int((timezone.now() - run.last_heartbeat_at).total_seconds())
    if silent < ttl:
        return ""
    how = (f"Kubernetes Job {name} and its pods are gone, the run silent for {silent} s, longer than the Job's "
           f"ttlSecondsAfterFinished ({ttl} s): the API server may have deleted it once it had ended, how is not known")
    if not lost_attempt_finished(run_id=run.pk, job_id=name, pid=None, to_state=RunState.FAILED, how=how):
        return ""
    return how


def _being_deleted(obj: dict[str, Any]) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def _name(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _labels(obj: dict[str, Any]) -> dict[str, Any]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _pod_name(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name", "?"))


def _still_stopping(name: str, *, job_left: bool, pods: list[dict[str, Any]]) -> str:
    left = ", ".join(_pod_left(pod, orphaned=not job_left) for pod in pods)
    if not job_left:
        return f"Kubernetes Job {name} is gone, but its pods are still stopping: {left}"
    if pods:
        return f"Kubernetes Job {name} is being deleted: its pods are still stopping ({left})"
    return f"Kubernetes Job {name} is being deleted: none of its pods is left, the Job goes next"


def _pod_left(pod: dict[str, Any], *, orphaned: bool) -> str:
    """A pod still there, as a person looks for it: its name, its node, and why it is there."""
    node = (pod.get("spec") or {}).get("nodeName")
    on = f" on {node}" if node else ""
    if _being_deleted(pod):
        return f"{_pod_name(pod)}{on} terminating"
    return f"{_pod_name(pod)}{on} " + ("left without its Job, deleted now" if orphaned else "not deleted yet")


def poll_kubernetes_runs(*, api: KubernetesApi | None = None) -> dict[int, str]:
    """Move each followed Kubernetes run by what its Job and pods say, then delete what the runs that ended before
    this poll left (`remove_ended_attempts`); what was done, by run id."""
    api = api or kubernetes_api()
    done: dict[int, str] = {}
    for run in Run.objects.filter(backend=LaunchBackend.KUBERNETES, state__in=FOLLOWED_STATES).exclude(job_id=""):
        try:
            job = api.get_job(run.job_id)
            # The pods of this attempt's Job only: an earlier attempt's may still be terminating.
            status = None if job is None else kubernetes_job_status(job, api.job_pods(run.job_id))
            done[run.pk] = follow_job(run=run, status=status, job=f"Kubernetes Job {run.job_id}",
                                      cancel=lambda run=run: delete_kubernetes_objects(name=run.job_id, api=api))
        except (KubernetesApiFailed, LaunchSpecError) as exc:
            logger.warning("Kubernetes Job %s of run %s: %s", run.job_id, run.pk, exc, extra={"run_id": run.pk})
            done[run.pk] = f"unreadable: {exc}"
    try:
        removed = remove_ended_attempts(api=api, followed=done)
    except KubernetesApiFailed as exc:  # the Jobs could not be listed: the next poll lists them again
        logger.warning("the Jobs of ended Kubernetes runs are left: %s", exc)
        return done
    return done | removed
