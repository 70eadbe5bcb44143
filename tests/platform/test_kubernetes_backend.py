"""The Kubernetes launch backend against a fake API server (httpx MockTransport) answering with recorded objects.

The recorded Job and pods (workers/launch/recorded/k8s_*.json) are those of run 42; the fake
serves them for the test's run, which is what the poller reads.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import yaml
from django.db.models import F
from django.utils import timezone

from forgeboard.runs.models import Run
from forgeboard.runs.reconcile import runs_reconcile
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.services import run_cancel, run_launch, run_launch_queue, run_transition
from forgeboard.runs.states import RunState
from forgeboard.runs.tokens import run_token_authenticate
from forgeboard.telemetry.models import RunEvent
from workers.launch import kubernetes_backend
from workers.launch.backends import start_run, stop_attempt
from workers.launch.kubernetes_backend import (KubernetesApi, KubernetesApiFailed, poll_kubernetes_runs,
                                               stop_kubernetes_job)
from workers.launch.slurm import JobStillCompleting

RECORDED = Path(__file__).resolve().parents[2] / "workers" / "launch" / "recorded"
K8S_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: /models/qwen3-0.6b
placement:
  backend: kubernetes
  trainer:
    gpus_per_proc: 1
trainer:
  ranks: 4
"""


class FakeApiServer:
    """One namespace of an API server and its garbage collector, as far as the backend uses them.

    Keeps what was created (Secrets, ConfigMaps, Jobs, by name: a second create of a name is 409, a read or delete of
    one not there 404) and the namespace's pods and Jobs, listed by label selector (`k=v,k2`). `show` sets the test's Job
    and pods from a recording (those of run 42), renamed to the Job the test's run created, if any, and labelled as
    its pods (`job` and `pods` are then that Job and every pod). Deletes as the API server and its garbage collector
    do: a Job deleted in the foreground stays, being deleted (`foregroundDeletion`), until its pods are removed; in
    the background it is gone at once; either way its pods are then being deleted (Terminating), as is a pod deleted
    by name, and what it owns (ownerReferences: the Secret and ConfigMap) is deleted, as is an object made a
    dependent of a Job that is gone. Pods are removed only when their kubelet says they have stopped: `pods_removed`.
    """

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.created: list[dict] = []
        self.objects: dict[tuple[str, str], dict] = {}  # by (collection, name): "secrets", "configmaps", "jobs"
        self.job_name = "forgeboard-run-42"  # the test's Job: the one its run created last, else the recording's
        self.run_id: str | None = None  # the run of the Job created last
        self.pods: list[dict] = []
        self.refuse: tuple[int, str] | None = None
        self.refuse_deleting: dict[str, tuple[int, str]] = {}  # by kind as in the path ("pods"): status, message
        self.refuse_creating: dict[str, tuple[int, str]] = {}  # likewise ("configmaps")
        self.refuse_patching: dict[str, tuple[int, str]] = {}  # likewise ("secrets")

    @property
    def job(self) -> dict | None:
        return self.objects.get(("jobs", self.job_name))

    @job.setter
    def job(self, job: dict | None) -> None:
        """None: the test's Job was removed (deleted by hand, or garbage-collected), and what it owned with it."""
        if job is None:
            self._remove("jobs", self.job_name)
        else:
            self.objects["jobs", self.job_name] = job

    def show(self, recorded: str) -> None:
        document = json.loads((RECORDED / f"{recorded}.json").read_text())
        pods = document["pods"]
        pods = pods["items"] if isinstance(pods, dict) else pods
        created, job = self.job, document["job"]
        if job is not None:  # the recording as the test's Job: its name, and the uid and labels it was created with
            job["metadata"]["name"] = self.job_name
            if created is not None:
                job["metadata"] |= {key: created["metadata"][key] for key in ("uid", "labels")}
        self.job = job
        if self.run_id is not None:
            for pod in pods:
                pod["metadata"]["labels"] |= {"forgeboard.run-id": self.run_id, "job-name": self.job_name,
                                              "batch.kubernetes.io/job-name": self.job_name}
        self.pods = pods

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.refuse is not None:
            return _status(*self.refuse)
        parts = request.url.path.rstrip("/").split("/")
        named = parts[-2] in ("secrets", "configmaps", "jobs", "pods")
        kind, name = (parts[-2], parts[-1]) if named else (parts[-1], None)
        refused = {"POST": self.refuse_creating, "DELETE": self.refuse_deleting,
                   "PATCH": self.refuse_patching}.get(request.method, {}).get(kind)
        if refused is not None:
            return _status(*refused)
        if request.method == "POST":
            return self._create(kind, json.loads(request.content))
        if request.method == "DELETE":
            return self._delete(kind, name, policy=request.url.params.get("propagationPolicy", "Background"))
        if request.method == "PATCH":
            return self._patch(kind, name, json.loads(request.content))
        if kind == "pods" and name is None:
            selector = request.url.params.get("labelSelector", "")
            return httpx.Response(200, json={"kind": "PodList", "items": [p for p in self.pods if _selected(p, selector)]})
        if kind == "jobs" and name is None:
            selector = request.url.params.get("labelSelector", "")
            return httpx.Response(200, json={"kind": "JobList", "items": [
                job for (collection, _), job in self.objects.items() if collection == "jobs" and _selected(job, selector)]})
        found = self.objects.get((kind, name))
        if found is None:
            return _status(404, f'{kind} "{name}" not found')
        return httpx.Response(200, json=found)

    def _create(self, kind: str, obj: dict) -> httpx.Response:
        name = obj["metadata"]["name"]
        if (kind, name) in self.objects:
            return _status(409, f'{kind} "{name}" already exists')
        self.created.append(obj)
        kept = copy.deepcopy(obj)
        kept["metadata"] |= {"uid": str(uuid.uuid4()), "creationTimestamp": "2026-11-30T04:10:00Z"}
        self.objects[kind, name] = kept
        if kind == "jobs":
            self.job_name, self.run_id = name, obj["metadata"]["labels"]["forgeboard.run-id"]
        return httpx.Response(201, json=kept)

    def _patch(self, kind: str, name: str, patch: dict) -> httpx.Response:
        found = self.objects.get((kind, name))
        if found is None:
            return _status(404, f'{kind} "{name}" not found')
        found["metadata"] |= patch.get("metadata", {})  # a merge patch of metadata's fields, as the backend sends
        owners = found["metadata"].get("ownerReferences") or []
        if owners and not any(self._exists(owner) for owner in owners):  # its owner is gone: collected
            self._remove(kind, name)
        return httpx.Response(200, json=found)

    def _exists(self, owner: dict) -> bool:
        job = self.objects.get(("jobs", owner["name"]))
        return owner["kind"] == "Job" and job is not None and job["metadata"].get("uid") == owner["uid"]

    def _delete(self, kind: str, name: str, *, policy: str) -> httpx.Response:
        if kind == "pods":
            pods = [pod for pod in self.pods if pod["metadata"]["name"] == name]
            if not pods:
                return _status(404, f'pods "{name}" not found')
            self.pods = [_being_deleted(pod) if pod in pods else pod for pod in self.pods]
            return httpx.Response(200, json=_being_deleted(pods[0]))
        found = self.objects.get((kind, name))
        if found is None:
            return _status(404, f'{kind} "{name}" not found')
        if kind != "jobs":
            self._remove(kind, name)
            return httpx.Response(200, json={"kind": "Status", "status": "Success"})
        if policy != "Orphan":
            self.pods = [_being_deleted(pod) if _selected(pod, f"batch.kubernetes.io/job-name={name}") else pod
                         for pod in self.pods]
        if policy == "Foreground":  # removed by the garbage collector once its pods are: pods_removed
            self.objects[kind, name] = _being_deleted(found, finalizers=["foregroundDeletion"])
            self._collect_dependents(found)
            return httpx.Response(200, json=self.objects[kind, name])
        self._remove(kind, name)
        return httpx.Response(200, json={"kind": "Status", "status": "Success"})

    def _remove(self, kind: str, name: str) -> None:
        found = self.objects.pop((kind, name), None)
        if found is not None and kind == "jobs":
            self._collect_dependents(found)

    def _collect_dependents(self, job: dict) -> None:
        uid = job["metadata"].get("uid")
        for key, obj in list(self.objects.items()):
            if any(owner.get("uid") == uid for owner in obj["metadata"].get("ownerReferences") or []):
                del self.objects[key]

    def pods_removed(self) -> None:
        """The pods' kubelets say they have stopped: they are removed, and a Job deleted in the foreground with them."""
        self.pods = []
        for (kind, name), obj in list(self.objects.items()):
            if kind == "jobs" and "foregroundDeletion" in obj["metadata"].get("finalizers", []):
                self._remove(kind, name)

    def left(self, name: str) -> list[tuple[str, str]]:
        """What is left of the attempt `name`: its Job, ConfigMap, Secret and pods."""
        return sorted([key for key in self.objects if key[1] in (name, f"{name}-token")] +
                      [("pods", p["metadata"]["name"]) for p in self.pods
                       if _selected(p, f"batch.kubernetes.io/job-name={name}")])


def _status(code: int, message: str) -> httpx.Response:
    reason = {404: "NotFound", 409: "AlreadyExists", 403: "Forbidden"}.get(code, "InternalError")
    return httpx.Response(code, json={"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                                      "reason": reason, "code": code})


def _selected(obj: dict, selector: str) -> bool:
    """Whether a label selector (`k=v,k2`: k is v, k2 is set) selects the object."""
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(key) == value if equals else key in labels
               for key, equals, value in (term.partition("=") for term in selector.split(",") if term))


def _being_deleted(obj: dict, *, finalizers: list[str] | None = None) -> dict:
    obj = copy.deepcopy(obj)
    obj["metadata"].setdefault("deletionTimestamp", "2026-11-30T05:02:41Z")
    if finalizers:
        obj["metadata"]["finalizers"] = finalizers
    return obj


@pytest.fixture
def k8s(settings, monkeypatch) -> FakeApiServer:
    settings.K8S_API_URL = "https://k8s.example:6443"
    settings.K8S_IMAGE = "registry.example/forgeboard:1.4"
    settings.K8S_NAMESPACE = "research"
    settings.K8S_GPUS_PER_NODE = 2
    settings.K8S_ENGINE_SERVICE_ACCOUNT = "research-engine"
    server = FakeApiServer()
    api = KubernetesApi(base_url=settings.K8S_API_URL, namespace="research", token="sa-token",
                        transport=httpx.MockTransport(server.handle))
    monkeypatch.setattr(kubernetes_backend, "kubernetes_api", lambda: api)
    return server


def _submitted(team) -> Run:
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=K8S_YAML)
    assert run.backend == "kubernetes" and run_launch_queue(run_id=run.pk) == "launch.kubernetes"
    assert run.pk in runs_schedule(now=timezone.now()), "Kubernetes places it: no inventory host is needed"
    start_run(run_id=run.pk)
    run.refresh_from_db()
    return run


@pytest.mark.django_db
def test_a_kubernetes_run_is_created_through_the_api_and_failed_with_the_pods_reason(team, k8s):
    run = _submitted(team)
    name = f"forgeboard-run-{run.pk}"
    assert run.state == RunState.LAUNCHING and run.job_id == name
    posts = [(r.method, r.url.path) for r in k8s.requests]
    assert posts == [("POST", "/api/v1/namespaces/research/secrets"), ("POST", "/api/v1/namespaces/research/configmaps"),
                     ("POST", "/apis/batch/v1/namespaces/research/jobs"),
                     ("PATCH", f"/api/v1/namespaces/research/secrets/{name}-token"),
                     ("PATCH", f"/api/v1/namespaces/research/configmaps/{name}")]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": k8s.job["metadata"]["uid"]}
    assert k8s.objects["secrets", f"{name}-token"]["metadata"]["ownerReferences"] == [owner], "deleted with its Job"
    assert k8s.objects["configmaps", name]["metadata"]["ownerReferences"] == [owner]
    assert all(r.headers["authorization"] == "Bearer sa-token" for r in k8s.requests)
    secret, config_map, job = k8s.created
    assert secret["metadata"]["name"] == f"{name}-token"
    token = run_token_authenticate(raw=secret["stringData"]["token"])
    assert token is not None and token.run_id == run.pk, "the Secret holds the run's own token"
    assert "backend: kubernetes" in config_map["data"]["config.yaml"]
    assert job["spec"]["completions"] == 2, "4 GPUs at 2 per node"
    pod = job["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}
    assert env["FORGEBOARD_RUN_TOKEN_FILE"] == "/var/run/secrets/forgeboard/token" and env["FORGEBOARD_RUN_ID"] == str(run.pk)
    # the engine in pod 0 finds its workers through the API, as the configured service account
    assert pod["serviceAccountName"] == "research-engine"
    assert (env["FORGEBOARD_MONARCH_JOB"], env["FORGEBOARD_RUN_NODES"], env["MONARCH_PORT"]) == ("kubernetes", "2", "26600")
    assert env["FORGEBOARD_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "FORGEBOARD_MONARCH_WORKERS" not in env
    assert secret["stringData"]["token"] not in json.dumps(job), "the token is mounted, never written into the Job"
    submitted = RunEvent.objects.get(run=run, kind="message", payload__name="job_submitted")
    assert submitted.payload["job_id"] == name and submitted.payload["namespace"] == "research"

    k8s.show("k8s_running")
    assert poll_kubernetes_runs() == {run.pk: "running"}
    assert Run.objects.get(pk=run.pk).state == RunState.LAUNCHING, "the engine reports running itself"
    pods = [r for r in k8s.requests if r.url.path.endswith("/pods")][-1]
    assert pods.url.path == "/api/v1/namespaces/research/pods"
    assert pods.url.params["labelSelector"] == f"batch.kubernetes.io/job-name={name}", "this attempt's pods only"

    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    k8s.show("k8s_failed_oomkilled")
    assert poll_kubernetes_runs() == {run.pk: "failed"}
    run.refresh_from_db()
    assert run.state == RunState.FAILED and "ran out of memory (OOMKilled)" in run.exit_reason
    assert run.exit_reason.startswith(f"Kubernetes Job {name}: container engine in pod")


@pytest.mark.django_db
def test_cancelling_a_run_whose_pods_wait_for_nodes_deletes_its_job(team, k8s):
    run = _submitted(team)
    k8s.show("k8s_pending_unschedulable")
    assert poll_kubernetes_runs() == {run.pk: "queued"}
    run_cancel(actor=team.member, run=run)
    k8s.requests.clear()
    assert poll_kubernetes_runs() == {run.pk: "cancelled in the queue"}
    delete, *_ = [r for r in k8s.requests if r.method == "DELETE"]
    assert (delete.method, delete.url.path) == ("DELETE", f"/apis/batch/v1/namespaces/research/jobs/forgeboard-run-{run.pk}")
    assert delete.url.params["propagationPolicy"] == "Background", "its pods go with it"
    name = f"forgeboard-run-{run.pk}"
    assert k8s.left(name) == [("pods", "forgeboard-run-42-0-x7k2p"), ("pods", "forgeboard-run-42-1-q9m4d")]
    assert all(p["metadata"].get("deletionTimestamp") for p in k8s.pods), "its pods terminating; its Secret gone"
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED and "Insufficient nvidia.com/gpu" in run.exit_reason


@pytest.mark.django_db
def test_an_evicted_pod_or_a_vanished_job_loses_the_run(team, k8s):
    evicted = _submitted(team)
    run_transition(run_id=evicted.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    k8s.show("k8s_lost_evicted")
    assert poll_kubernetes_runs() == {evicted.pk: "lost"}
    assert "was evicted" in Run.objects.get(pk=evicted.pk).exit_reason

    vanished = _submitted(team)
    run_transition(run_id=vanished.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    k8s.job = None  # deleted by hand, or garbage-collected
    assert poll_kubernetes_runs() == {vanished.pk: "lost"}, "a lost run is not followed; the reconciler has it"
    assert Run.objects.get(pk=vanished.pk).exit_reason == (
        f"the scheduler no longer knows Kubernetes Job forgeboard-run-{vanished.pk}")


@pytest.mark.django_db
def test_a_refused_creation_fails_the_run_with_the_api_servers_message(team, k8s):
    k8s.refuse = (403, 'secrets is forbidden: User "system:serviceaccount:forgeboard:worker" cannot create resource')
    run = _submitted(team)
    assert run.state == RunState.FAILED and run.job_id == ""
    assert run.exit_reason.startswith(f"Kubernetes refused the run: creating Secret forgeboard-run-{run.pk}-token: "
                                      "HTTP 403: secrets is forbidden")


@pytest.mark.django_db
def test_an_unreachable_api_server_leaves_the_run_alone(team, k8s):
    run = _submitted(team)
    k8s.refuse = (500, "etcdserver: request timed out")
    assert poll_kubernetes_runs() == {run.pk: f"unreadable: reading Job forgeboard-run-{run.pk}: HTTP 500: "
                                              "etcdserver: request timed out"}
    assert Run.objects.get(pk=run.pk).state == RunState.LAUNCHING


@pytest.mark.django_db  # once nothing is left, the stop reads whether a lost run's end may be unknown
def test_a_job_being_deleted_in_the_foreground_is_stopped_once_its_pods_are_gone(k8s):
    """The Job stays, being deleted, while its pods terminate (pod 0's engine still runs through its grace period):
    it is not deleted again, and the stop is confirmed only once the pods, and with them the Job, are gone."""
    k8s.show("k8s_stopping_foreground")
    with pytest.raises(JobStillCompleting) as still:
        stop_kubernetes_job(name="forgeboard-run-42")
    assert str(still.value) == (
        "Kubernetes Job forgeboard-run-42 is being deleted: its pods are still stopping (forgeboard-run-42-0-x7k2p on "
        "gpu-node-07 terminating, forgeboard-run-42-1-q9m4d on gpu-node-08 terminating)")
    assert [r.method for r in k8s.requests] == ["GET", "GET", "GET"], "the Job, its pods, the Job; nothing deleted"

    k8s.pods = []  # the pods are gone; the garbage collector has not removed the Job yet
    with pytest.raises(JobStillCompleting, match="is being deleted: none of its pods is left, the Job goes next"):
        stop_kubernetes_job(name="forgeboard-run-42")

    k8s.pods_removed()
    assert stop_kubernetes_job(name="forgeboard-run-42") == "Kubernetes Job forgeboard-run-42 and its pods are gone"


def test_the_default_engine_service_account_is_the_one_infra_creates_and_may_watch_pods():
    import yaml
    from django.conf import settings

    manifests = list(yaml.safe_load_all((Path(__file__).resolve().parents[2] / "infra/k8s/engine-rbac.yaml").read_text()))
    by_kind = {m["kind"]: m for m in manifests}
    assert by_kind["ServiceAccount"]["metadata"]["name"] == settings.K8S_ENGINE_SERVICE_ACCOUNT == "forgeboard-engine"
    assert by_kind["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = by_kind["RoleBinding"]
    assert binding["roleRef"]["name"] == by_kind["Role"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "forgeboard-engine", "namespace": "forgeboard"}]
    kustomization = yaml.safe_load((Path(__file__).resolve().parents[2] / "infra/k8s/kustomization.yaml").read_text())
    assert "engine-rbac.yaml" in kustomization["resources"]


# --- a lost run's stop, a cancel during the submission, a submission failing half-way, an earlier attempt's pods ----

def _lost(team, asks) -> tuple[Run, dict]:
    """Submitted, running, then silent for two minutes: the reconciler takes it for lost and asks for its stop."""
    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    Run.objects.filter(pk=run.pk).update(max_restarts=2, last_heartbeat_at=timezone.now() - timedelta(seconds=120))
    report = runs_reconcile(now=timezone.now())
    assert (report.lost, report.stopping) == ([run.pk], [run.pk])
    [ask] = [a["kwargs"] for a in asks if a["name"] == "runs.stop_attempt"]
    asks.clear()
    return Run.objects.get(pk=run.pk), ask


def _pod_zero_counted_and_removed(k8s: FakeApiServer) -> None:
    """The Job controller counted pod 0's success in the Job's status (completedIndexes), removed its tracking
    finalizer, and the garbage collector removed it: only the Job, being deleted, says so now."""
    k8s.show("k8s_running")
    k8s.job["status"] |= {"succeeded": 1, "completedIndexes": "0", "active": 1, "ready": 1}
    k8s.pods = k8s.pods[1:]


@pytest.mark.django_db
@pytest.mark.parametrize("completed", ["pod 0 succeeded, the Job says so", "pod 0 counted and removed"])
def test_a_lost_runs_job_that_completes_just_before_the_stop_deletes_it_ends_the_run_succeeded(
        team, k8s, asks, monkeypatch, completed):
    """The stop read the Job running (not finished: stop it), then pod 0's engine finished the run and the Job
    completed, then the stop deleted it. Deleted in the foreground, the Job stays, being deleted, with its status: the
    stop reads it again (its pods first) and the run ends succeeded, not restarted to train again from its checkpoint.
    On the old code the stop waited for the pods to go and restarted the run."""
    run, ask = _lost(team, asks)
    k8s.show("k8s_running")
    transport = kubernetes_backend.kubernetes_api().transport

    def completes_as_it_is_deleted(request):
        if request.method == "DELETE" and request.url.path.endswith(f"/jobs/{run.job_id}"):
            if completed == "pod 0 counted and removed":
                _pod_zero_counted_and_removed(k8s)
            else:
                k8s.show("k8s_succeeded")
        return k8s.handle(request)

    monkeypatch.setattr(transport, "handler", completes_as_it_is_deleted)

    assert stop_attempt(**ask) == (f"Kubernetes Job {run.job_id} had completed as it was stopped (the controller pod "
                                   "succeeded); not restarted")

    run.refresh_from_db()
    assert (run.state, run.restart_count) == (RunState.SUCCEEDED, 0), run.exit_reason
    assert run.exit_reason.startswith("finished after it was taken for lost (no heartbeat for ")
    assert run.exit_reason.endswith(f"): Kubernetes Job {run.job_id}: the controller pod succeeded")
    assert k8s.job["metadata"]["deletionTimestamp"], "being deleted: it goes with its pods, by itself"
    k8s.pods_removed()
    assert k8s.left(run.job_id) == [], "its Secret and ConfigMap went with it"
    report = runs_reconcile(now=timezone.now() + timedelta(hours=1))
    assert (report.restarted, report.stopping) == ([], [])
    assert Run.objects.get(pk=run.pk).state == RunState.SUCCEEDED


@pytest.mark.django_db
def test_a_lost_runs_job_that_did_not_complete_is_still_stopped_and_restarted(team, k8s, asks):
    """Read again after its delete, a Job whose pod 0 was still running is stopped as before: the run restarts once
    its pods are gone, and nothing of the attempt is left."""
    run, ask = _lost(team, asks)
    k8s.show("k8s_running")
    assert stop_attempt(**ask).startswith(f"still stopping: Kubernetes Job {run.job_id} is being deleted")
    k8s.pods_removed()
    assert stop_attempt(**ask) == f"Kubernetes Job {run.job_id} and its pods are gone; restarted"
    assert k8s.left(run.job_id) == []
    assert Run.objects.get(pk=run.pk).state == RunState.QUEUED


@pytest.mark.django_db
@pytest.mark.parametrize(("kind", "refusal"), [
    ("configmaps", (403, 'configmaps "forgeboard-run-N" is forbidden: User '
                         '"system:serviceaccount:forgeboard:forgeboard-worker" cannot delete resource "configmaps"')),
    ("secrets", (500, "etcdserver: request timed out"))])
def test_a_lost_runs_stop_whose_last_deletion_is_refused_is_not_confirmed_and_is_asked_again(team, k8s, asks, kind,
                                                                                             refusal):
    """Its Job and pods gone, the stop deletes the attempt's ConfigMap and Secret by name (the garbage collector may
    not have yet): one refused raises, so the stop is not confirmed, the run neither restarted nor failed, and the
    reconciler asks again; the stop that deletes them restarts the run."""
    run, ask = _lost(team, asks)
    k8s.objects.pop(("jobs", run.job_id))  # gone with its pods, the garbage collector not yet at its dependents
    k8s.refuse_deleting[kind] = refusal
    code, message = refusal
    refused = {"configmaps": f"ConfigMap {run.job_id}", "secrets": f"Secret {run.job_id}-token"}[kind]

    with pytest.raises(KubernetesApiFailed) as raised:
        stop_kubernetes_job(name=run.job_id)
    assert str(raised.value) == f"deleting {refused}: HTTP {code}: {message}"
    assert stop_attempt(**ask) == f"not stopped: deleting {refused}: HTTP {code}: {message}"

    run.refresh_from_db()
    assert (run.state, run.restart_count, run.job_id) == (RunState.LOST, 0, ask["job_id"]), "not reported stopped"
    [said] = RunEvent.objects.filter(run=run, kind="message", payload__name="previous_attempt_not_stopped")
    assert said.payload["problem"] == f"deleting {refused}: HTTP {code}: {message}"
    assert ("secrets", f"{run.job_id}-token") in k8s.left(run.job_id)
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk], "asked again"

    del k8s.refuse_deleting[kind]
    assert stop_attempt(**ask) == f"Kubernetes Job {run.job_id} and its pods are gone; restarted"
    assert k8s.left(run.job_id) == []
    assert Run.objects.get(pk=run.pk).state == RunState.QUEUED


@pytest.mark.django_db
@pytest.mark.parametrize("lands_on", [("POST", "secrets"), ("POST", "configmaps"), ("POST", "jobs"),
                                      ("PATCH", "secrets"), ("PATCH", "configmaps")])
def test_a_cancel_during_the_submission_leaves_nothing_of_it_whichever_step_it_lands_on(team, k8s, monkeypatch,
                                                                                         lands_on):
    """The Secret holds the run's controller token: on the old code a cancel during the submission deleted only the
    Job, and the Secret and ConfigMap stayed. They are the Job's dependents now, and go with it."""
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=K8S_YAML)
    assert run.pk in runs_schedule(now=timezone.now())
    transport = kubernetes_backend.kubernetes_api().transport

    def cancel_on_that_step(request):
        if (request.method, request.url.path.split("/")[-1 if request.method == "POST" else -2]) == lands_on:
            run_cancel(actor=team.member, run=Run.objects.get(pk=run.pk))
        return k8s.handle(request)

    monkeypatch.setattr(transport, "handler", cancel_on_that_step)

    assert start_run(run_id=run.pk) is True
    run.refresh_from_db()
    name = f"forgeboard-run-{run.pk}"
    assert run.state == RunState.CANCELLED, run.exit_reason
    assert run.exit_reason == f"cancelled while it was being submitted; Kubernetes Job {name} removed"
    assert k8s.left(name) == []


@pytest.mark.django_db
@pytest.mark.parametrize(("refused", "step"), [
    ("refuse_creating", "jobs"), ("refuse_creating", "configmaps"), ("refuse_patching", "configmaps")])
def test_a_submission_refused_half_way_removes_what_it_created(team, k8s, refused, step):
    getattr(k8s, refused)[step] = (403, f'{step} is forbidden: User "system:serviceaccount:forgeboard:worker"')
    run = _submitted(team)
    name = f"forgeboard-run-{run.pk}"
    assert (run.state, run.job_id) == (RunState.FAILED, "")
    assert run.exit_reason.startswith("Kubernetes refused the run: ") and "is forbidden" in run.exit_reason
    assert k8s.created, "something was created before the refusal"
    assert k8s.left(name) == []
    assert run_token_authenticate(raw=k8s.created[0]["stringData"]["token"]) is None, "its token is revoked"


@pytest.mark.django_db
def test_a_submission_whose_leftovers_cannot_be_removed_has_the_reconciler_remove_them(team, k8s, asks):
    k8s.refuse_creating["jobs"] = (403, 'jobs.batch is forbidden: User "system:serviceaccount:forgeboard:worker"')
    k8s.refuse_deleting["configmaps"] = (503, "etcdserver: request timed out")
    run = _submitted(team)
    name = f"forgeboard-run-{run.pk}"
    assert (run.state, run.job_id) == (RunState.FAILED, name), "recorded: the reconciler stops what is left"
    assert run.exit_reason.endswith(f"left to remove: deleting ConfigMap {name}: HTTP 503: etcdserver: request timed out")
    assert run.leftover_stop_since is not None
    assert k8s.left(name) == [("configmaps", name)]

    del k8s.refuse_deleting["configmaps"]
    assert runs_reconcile(now=timezone.now()).leftover_stopping == [run.pk]
    [ask] = [a["kwargs"] for a in asks if a["name"] == "runs.stop_attempt"]
    assert stop_attempt(**ask) == f"Kubernetes Job {name} and its pods are gone; not restarted"
    assert k8s.left(name) == []
    assert Run.objects.get(pk=run.pk).state == RunState.FAILED


@pytest.mark.django_db
def test_a_new_attempt_is_judged_by_its_own_pods_not_the_earlier_attempts_still_terminating(team, k8s):
    """The run restarted (attempt 1, Job forgeboard-run-N-1) while its attempt 0's pods, evicted, still terminate
    with the same run label: the poller reads attempt 1's pods only. On the old code (pods by run label) the evicted
    pods of attempt 0 lost the new attempt."""
    run = _submitted(team)
    k8s.show("k8s_lost_evicted")
    earlier = [_being_deleted(pod) | {"metadata": pod["metadata"] | {"name": f"{pod['metadata']['name']}-old"}}
               for pod in k8s.pods]
    Run.objects.filter(pk=run.pk).update(restart_count=1, job_id="")
    start_run(run_id=run.pk)
    run.refresh_from_db()
    assert run.job_id == f"forgeboard-run-{run.pk}-1"
    k8s.show("k8s_running")
    k8s.pods = [*k8s.pods, *earlier]
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)

    assert poll_kubernetes_runs() == {run.pk: "running"}
    assert Run.objects.get(pk=run.pk).state == RunState.RUNNING
    pods = [r for r in k8s.requests if r.url.path.endswith("/pods")][-1]
    assert pods.url.params["labelSelector"] == f"batch.kubernetes.io/job-name={run.job_id}"


def _run_volume(job: dict) -> tuple[dict, dict]:
    pod = job["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "run"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "run"]
    return volume, mount


@pytest.mark.django_db
def test_with_a_run_volume_claim_every_attempt_resumes_from_the_runs_checkpoints_on_it(team, k8s, settings):
    """On the old code the run folder was always an emptyDir and the config said nothing of checkpoints: a restarted
    run's new Job trained from step 0."""
    settings.K8S_RUN_VOLUME_CLAIM = "forgeboard-runs"
    run = _submitted(team)
    Run.objects.filter(pk=run.pk).update(restart_count=1, job_id="")
    start_run(run_id=run.pk)
    assert Run.objects.get(pk=run.pk).job_id == f"forgeboard-run-{run.pk}-1"
    config_maps = [obj for obj in k8s.created if obj["kind"] == "ConfigMap"]
    jobs = [obj for obj in k8s.created if obj["kind"] == "Job"]
    assert [job["metadata"]["name"] for job in jobs] == [f"forgeboard-run-{run.pk}", f"forgeboard-run-{run.pk}-1"]
    for config_map, job in zip(config_maps, jobs, strict=True):
        config = yaml.safe_load(config_map["data"]["config.yaml"])
        assert config["checkpoint"] == {"folder": "/var/lib/forgeboard/run/checkpoints", "resume_latest": True}
        assert _run_volume(job) == ({"name": "run", "persistentVolumeClaim": {"claimName": "forgeboard-runs"}},
                                    {"name": "run", "mountPath": "/var/lib/forgeboard/run", "subPath": f"run-{run.pk}"})
    submitted = RunEvent.objects.filter(run=run, kind="message", payload__name="job_submitted").first()
    assert submitted.payload["checkpoints"] == (f"its checkpoints are in PersistentVolumeClaim forgeboard-runs, folder "
                                                f"run-{run.pk}: a restart resumes from the last")


@pytest.mark.django_db
def test_without_a_run_volume_claim_the_timeline_says_a_restart_starts_from_step_0(team, k8s, settings):
    assert settings.K8S_RUN_VOLUME_CLAIM is None
    run = _submitted(team)
    config_map, job = [obj for obj in k8s.created if obj["kind"] in ("ConfigMap", "Job")]
    assert "checkpoint" not in yaml.safe_load(config_map["data"]["config.yaml"])
    assert _run_volume(job) == ({"name": "run", "emptyDir": {}}, {"name": "run", "mountPath": "/var/lib/forgeboard/run"})
    (submitted,) = RunEvent.objects.filter(run=run, kind="message", payload__name="job_submitted")
    assert submitted.payload["checkpoints"] == ("its checkpoints are in the pod's emptyDir: a restart starts from "
                                                "step 0 (set FORGEBOARD_K8S_RUN_VOLUME_CLAIM)")


@pytest.mark.django_db
@pytest.mark.parametrize("fs_group", [None, 2000])
def test_the_run_pods_have_the_configured_fs_group_so_a_non_root_image_may_write_the_claim(team, k8s, settings,
                                                                                          fs_group):
    """On the old code the pods set no fsGroup: an image running as non-root could not write its folder on a claim
    whose storage class honours fsGroup."""
    settings.K8S_RUN_VOLUME_CLAIM = "forgeboard-runs"
    settings.K8S_RUN_FS_GROUP = fs_group
    _submitted(team)
    pod = k8s.created[-1]["spec"]["template"]["spec"]
    if fs_group is None:
        assert "securityContext" not in pod
    else:
        assert pod["securityContext"] == {"fsGroup": 2000, "fsGroupChangePolicy": "OnRootMismatch"}


# --- a run that has ended leaves nothing behind ----------------------------------------------------------------------

def _running(team) -> Run:
    run = _submitted(team)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    return Run.objects.get(pk=run.pk)


def _states_at_deletes(k8s: FakeApiServer, run: Run, monkeypatch) -> list[tuple[str, str]]:
    """Each deletion the fake is asked for, as the kind deleted and the run's state in the database at that moment."""
    seen: list[tuple[str, str]] = []
    transport = kubernetes_backend.kubernetes_api().transport

    def noting_the_runs_state(request):
        if request.method == "DELETE":
            seen.append((request.url.path.split("/")[-2], Run.objects.get(pk=run.pk).state))
        return k8s.handle(request)

    monkeypatch.setattr(transport, "handler", noting_the_runs_state)
    return seen


@pytest.mark.django_db
@pytest.mark.parametrize(("recorded", "ends"), [("k8s_succeeded", RunState.SUCCEEDED),
                                                ("k8s_failed_exit_code", RunState.FAILED),
                                                ("k8s_failed_oomkilled", RunState.FAILED)])
def test_a_run_whose_job_ended_has_its_objects_deleted_once_its_end_is_recorded(team, k8s, monkeypatch, recorded,
                                                                                 ends):
    """On the old code the Job, its Completed or Error pods, its ConfigMap and its token Secret stayed in the namespace
    for good."""
    run = _running(team)
    name = run.job_id
    k8s.show(recorded)
    deletes = _states_at_deletes(k8s, run, monkeypatch)

    assert poll_kubernetes_runs() == {run.pk: ends}
    assert deletes == [], "the poll that records the run's end leaves its Job to the next"
    assert {kind for kind, _ in k8s.left(name)} == {"jobs", "configmaps", "secrets", "pods"}

    assert poll_kubernetes_runs() == {run.pk: f"its Job {name} deleted"}

    assert deletes == [("jobs", ends), ("configmaps", ends), ("secrets", ends)], "only once the run's end is recorded"
    job_delete = next(r for r in k8s.requests if r.method == "DELETE")
    assert job_delete.url.params["propagationPolicy"] == "Background"
    assert {kind for kind, _ in k8s.left(name)} == {"pods"}, "the Job, ConfigMap and Secret are gone"
    assert all(pod["metadata"].get("deletionTimestamp") for pod in k8s.pods), "its pods are being deleted"
    k8s.pods_removed()
    assert k8s.left(name) == []
    assert poll_kubernetes_runs() == {}, "nothing is left to follow or to delete"
    assert Run.objects.get(pk=run.pk).state == ends


@pytest.mark.django_db
@pytest.mark.parametrize("refusal", [
    (403, ('jobs.batch "forgeboard-run-N" is forbidden: User "system:serviceaccount:forgeboard:worker" cannot delete '
           'resource "jobs" in API group "batch" in the namespace "research"')),
    (500, "etcdserver: request timed out")])
def test_a_refused_deletion_keeps_the_runs_end_and_is_tried_again_by_the_next_poll(team, k8s, refusal):
    run = _running(team)
    name = run.job_id
    k8s.show("k8s_succeeded")
    k8s.refuse_deleting["jobs"] = refusal
    code, message = refusal

    assert poll_kubernetes_runs() == {run.pk: "succeeded"}
    assert poll_kubernetes_runs() == {run.pk: f"its Job {name} is left: deleting Job {name}: HTTP {code}: {message}"}
    ended = Run.objects.get(pk=run.pk)
    assert (ended.state, ended.exit_reason) == (RunState.SUCCEEDED, f"Kubernetes Job {name}: the controller pod succeeded")
    assert {kind for kind, _ in k8s.left(name)} == {"jobs", "configmaps", "secrets", "pods"}, "all left, readable"
    assert poll_kubernetes_runs() == {run.pk: f"its Job {name} is left: deleting Job {name}: HTTP {code}: {message}"}

    del k8s.refuse_deleting["jobs"]
    assert poll_kubernetes_runs() == {run.pk: f"its Job {name} deleted"}
    k8s.pods_removed()
    assert k8s.left(name) == []
    run = Run.objects.get(pk=run.pk)
    assert (run.state, run.exit_reason, run.finished_at) == (ended.state, ended.exit_reason, ended.finished_at)


@pytest.mark.django_db
def test_jobs_that_cannot_be_listed_leave_the_runs_followed_as_before(team, k8s, monkeypatch):
    """A worker account not allowed to list Jobs (an upgrade that did not grant it) still follows and ends runs."""
    run = _running(team)
    k8s.show("k8s_succeeded")
    transport = kubernetes_backend.kubernetes_api().transport

    def listing_refused(request):
        if request.method == "GET" and request.url.path.endswith("/jobs"):
            return httpx.Response(403, json={"kind": "Status", "message": "jobs.batch is forbidden", "code": 403})
        return k8s.handle(request)

    monkeypatch.setattr(transport, "handler", listing_refused)
    assert poll_kubernetes_runs() == {run.pk: "succeeded"}
    assert Run.objects.get(pk=run.pk).state == RunState.SUCCEEDED
    assert ("jobs", run.job_id) in k8s.left(run.job_id)


class WorkerKilled(BaseException):
    """The worker died (its pod evicted, OOM-killed) in the middle of a poll."""


@pytest.mark.django_db
def test_a_poller_that_dies_between_recording_the_end_and_deleting_deletes_on_the_next_poll(team, k8s, monkeypatch):
    run = _running(team)
    name = run.job_id
    k8s.show("k8s_succeeded")
    remove = kubernetes_backend.remove_ended_attempts

    def dies(**_kwargs):
        raise WorkerKilled

    monkeypatch.setattr(kubernetes_backend, "remove_ended_attempts", dies)
    with pytest.raises(WorkerKilled):
        poll_kubernetes_runs()
    assert Run.objects.get(pk=run.pk).state == RunState.SUCCEEDED, "recorded before anything is deleted"
    assert {kind for kind, _ in k8s.left(name)} == {"jobs", "configmaps", "secrets", "pods"}

    monkeypatch.setattr(kubernetes_backend, "remove_ended_attempts", remove)
    assert poll_kubernetes_runs() == {run.pk: f"its Job {name} deleted"}, "the ended run is found by its Job"
    k8s.pods_removed()
    assert k8s.left(name) == []


@pytest.mark.django_db
def test_a_run_whose_engine_reported_its_end_has_its_job_deleted_once_the_job_has_ended_too(team, k8s):
    """The engine reports its run's end before its pod exits: the Job, still running, is left to end (pod 0 may still
    be uploading), and deleted by the poll that finds it ended."""
    run = _running(team)
    name = run.job_id
    k8s.show("k8s_running")
    run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.SUCCEEDED, reason="the engine says so")

    assert poll_kubernetes_runs() == {run.pk: f"its Job {name} is still running, though its run has ended: left to end"}
    assert not [r for r in k8s.requests if r.method == "DELETE"]
    k8s.show("k8s_succeeded")
    assert poll_kubernetes_runs() == {run.pk: f"its Job {name} deleted"}
    assert {kind for kind, _ in k8s.left(name)} == {"pods"}


@pytest.mark.django_db
def test_a_job_still_running_long_after_its_run_ended_is_deleted(team, k8s, settings):
    """An engine that reported its run's end but whose pod does not exit (hung at shutdown) holds its GPUs for nothing:
    past the cancel grace after the run's end its Job is deleted all the same."""
    run = _running(team)
    name = run.job_id
    k8s.show("k8s_running")
    run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.SUCCEEDED, reason="the engine says so")
    assert poll_kubernetes_runs() == {run.pk: f"its Job {name} is still running, though its run has ended: left to end"}
    Run.objects.filter(pk=run.pk).update(finished_at=timezone.now() - timedelta(seconds=settings.JOB_CANCEL_GRACE_S + 5))
    [answer] = poll_kubernetes_runs().values()
    assert re.fullmatch(rf"its Job {name} deleted: still running \d+ s after its run had ended", answer), answer
    assert "jobs" not in {kind for kind, _ in k8s.left(name)}
    run.refresh_from_db()
    assert (run.state, run.exit_reason) == (RunState.SUCCEEDED, "the engine says so"), "its outcome is kept"


@pytest.mark.django_db
def test_the_objects_of_runs_not_ended_or_not_this_control_planes_to_delete_are_never_touched(team, k8s):
    launching = _submitted(team)  # its Job as created: no pods yet
    running = _running(team)
    k8s.show("k8s_running")
    pods = k8s.pods
    leftover = _submitted(team)  # failed with its Job left: the reconciler's to stop, in the foreground
    k8s.show("k8s_failed_exit_code")
    pods += k8s.pods
    run_transition(run_id=leftover.pk, from_state=RunState.LAUNCHING, to_state=RunState.FAILED,
                   reason="its launch failed", leftover_stop_since=timezone.now())
    earlier = _submitted(team)  # ended as its attempt 1; its attempt 0's Job is the reconciler's
    k8s.show("k8s_failed_exit_code")
    pods += k8s.pods
    lost = _running(team)  # lost, its pod evicted: the reconciler's to stop, in the foreground, before it restarts
    k8s.show("k8s_lost_evicted")
    k8s.pods += pods
    Run.objects.filter(pk=earlier.pk).update(state=RunState.FAILED, job_id=f"{earlier.job_id}-1")
    for run_id in ("999999", "99999999999999999999999", "x"):  # Jobs of another control plane's runs, ended
        foreign = copy.deepcopy(k8s.job)
        foreign["metadata"] |= {"name": f"forgeboard-run-{run_id}", "labels": {"forgeboard.run-id": run_id}}
        k8s.objects["jobs", f"forgeboard-run-{run_id}"] = foreign
    pods_before, objects_before = copy.deepcopy(k8s.pods), copy.deepcopy(k8s.objects)
    k8s.requests.clear()

    assert poll_kubernetes_runs() == {launching.pk: "launching", running.pk: "running", lost.pk: "lost"}
    assert [r for r in k8s.requests if r.method != "GET"] == []
    assert (k8s.pods, k8s.objects) == (pods_before, objects_before)
    assert Run.objects.get(pk=running.pk).state == RunState.RUNNING
    assert poll_kubernetes_runs() == {launching.pk: "launching", running.pk: "running"}, "a lost run is not followed"
    assert (k8s.pods, k8s.objects) == (pods_before, objects_before)


# --- ttlSecondsAfterFinished: a backstop --------------------------------------------------------------------------

@pytest.mark.django_db
def test_jobs_are_created_with_a_long_ttl_after_finished_unless_it_is_turned_off(team, k8s, settings):
    assert settings.K8S_JOB_TTL_S == 7 * 24 * 3600
    _submitted(team)
    assert k8s.created[-1]["spec"]["ttlSecondsAfterFinished"] == 604800
    settings.K8S_JOB_TTL_S = 0
    _submitted(team)
    assert "ttlSecondsAfterFinished" not in k8s.created[-1]["spec"]


@pytest.mark.django_db
def test_a_job_its_ttl_deleted_after_its_run_ended_changes_nothing(team, k8s):
    run = _running(team)
    run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.SUCCEEDED, reason="the engine says so")
    k8s.job, k8s.pods = None, []  # ended, then deleted by the API server (its TTL) before any poll read it
    assert poll_kubernetes_runs() == {}
    assert Run.objects.get(pk=run.pk).state == RunState.SUCCEEDED


@pytest.mark.django_db
@pytest.mark.parametrize("silent", [timedelta(days=8), timedelta(minutes=3)])
def test_a_lost_run_whose_job_its_ttl_may_have_deleted_fails_rather_than_train_again(team, k8s, asks, silent):
    """The control plane was down: nobody read the Job's end, nor heard the engine's. Its Job and pods gone, a run
    silent for longer than the TTL may have finished: on the old code (without the check) it was restarted, to train
    again. Silent for less, the TTL cannot have deleted it (its engine heartbeats until its pod ends): it restarts."""
    run = _running(team)
    Run.objects.filter(pk=run.pk).update(max_restarts=2, last_heartbeat_at=timezone.now() - silent)
    k8s.job, k8s.pods = None, []
    assert poll_kubernetes_runs() == {run.pk: "lost"}
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    [ask] = [a["kwargs"] for a in asks if a["name"] == "runs.stop_attempt"]

    done = stop_attempt(**ask)

    run.refresh_from_db()
    if silent < timedelta(seconds=604800):
        assert done == f"Kubernetes Job {ask['job_id']} and its pods are gone; restarted"
        assert (run.state, run.restart_count) == (RunState.QUEUED, 1)
        return
    assert done.startswith(f"Kubernetes Job {ask['job_id']} and its pods are gone, the run silent for 691")
    assert done.endswith("longer than the Job's ttlSecondsAfterFinished (604800 s): the API server may have deleted "
                         "it once it had ended, how is not known; not restarted")
    assert (run.state, run.restart_count) == (RunState.FAILED, 0)
    assert run.exit_reason.startswith(f"failed after it was taken for lost (the scheduler no longer knows Kubernetes "
                                      f"Job {ask['job_id']}): Kubernetes Job {ask['job_id']} and its pods are gone")
    assert runs_reconcile(now=timezone.now()).restarted == []


@pytest.mark.django_db
def test_a_job_whose_engine_never_reports_in_loses_its_run_and_one_whose_engine_reported_a_start_up_phase_does_not(
        team, k8s, asks, client, settings):
    """Pods running, an engine that never reports in (a broken node, no route to the control plane) kept its run
    launching for ever on the old code, its GPUs held (the poll said "running"). Its engine has ENGINE_START_TIMEOUT_S
    from the poll that first saw its Job running (recorded on its timeline: Kubernetes records no job_status of its
    own); hours waiting for nodes do not count. Past it the run is lost, its Job deleted, and it restarts once the
    pods are gone; the new attempt's clock starts afresh, and its engine's first report, a start-up phase, makes the run
    running: never lost for its start-up after that, however long it takes."""
    def later(**elapsed) -> None:  # time passes: what the polls recorded is that much older
        RunEvent.objects.filter(run=run).update(created_at=F("created_at") - timedelta(**elapsed))

    settings.ENGINE_START_TIMEOUT_S = 600
    run = _submitted(team)
    Run.objects.filter(pk=run.pk).update(max_restarts=1)
    k8s.show("k8s_pending_unschedulable")
    assert poll_kubernetes_runs() == {run.pk: "queued"}
    later(hours=3)
    k8s.show("k8s_running")
    assert poll_kubernetes_runs() == {run.pk: "running"}, "its time waiting for nodes does not count"
    later(seconds=599)
    assert poll_kubernetes_runs() == {run.pk: "running"}
    [seen] = RunEvent.objects.filter(run=run, kind="message", payload__name="job_status")
    assert seen.payload | {} == {"name": "job_status", "backend": "kubernetes", "job_id": run.job_id, "state": "running",
                                 "reason": "2 of 2 pods running", "nodes": "gpu-node-07,gpu-node-08",
                                 "nodes_down": {}}
    later(seconds=13)

    assert poll_kubernetes_runs() == {run.pk: "lost"}

    run.refresh_from_db()
    assert run.state == RunState.LOST
    assert run.exit_reason == (f"Kubernetes Job {run.job_id} ran for 612 s on gpu-node-07,gpu-node-08 and its engine never reported in "
                               "(start-up timeout 600 s)")
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    [ask] = [a["kwargs"] for a in asks if a["name"] == "runs.stop_attempt"]
    assert stop_attempt(**ask).startswith(f"still stopping: Kubernetes Job {run.job_id} is being deleted")
    assert Run.objects.get(pk=run.pk).state == RunState.LOST, "not restarted beside its pods"
    k8s.pods_removed()
    assert stop_attempt(**ask) == f"Kubernetes Job {run.job_id} and its pods are gone; restarted"

    assert run.pk in runs_schedule(now=timezone.now())
    start_run(run_id=run.pk)
    run.refresh_from_db()
    assert (run.state, run.job_id) == (RunState.LAUNCHING, f"forgeboard-run-{run.pk}-1")
    k8s.show("k8s_running")
    assert poll_kubernetes_runs() == {run.pk: "running"}, "the new attempt's clock starts afresh"
    later(seconds=599)
    [secret] = [obj for obj in k8s.created if obj["metadata"]["name"] == f"{run.job_id}-token"]
    phase = {"name": "startup_phase", "phase": "imports", "label": "importing torch", "elapsed_s": 3.2}
    response = client.post(f"/api/v1/controller/runs/{run.pk}/telemetry", content_type="application/json",
                           data={"batches": [{"seq": 1, "metrics": [], "logs": [],
                                              "events": [{"kind": "message", "payload": phase, "time": 1.7e9}]}]},
                           HTTP_AUTHORIZATION=f"Bearer {secret['stringData']['token']}")
    assert response.status_code == 200, response.content
    later(hours=2)

    assert poll_kubernetes_runs() == {run.pk: "running"}
    assert Run.objects.get(pk=run.pk).state == RunState.RUNNING
