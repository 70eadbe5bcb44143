"""The worker's Role (infra/k8s/worker-rbac.yaml) against what the Kubernetes launch backend calls.

Every code path of the backend that reaches the API server is driven against the fake API server of
test_kubernetes_backend.py; each request it sent is read as the API server's authorizer reads it (namespace, apiGroup,
resource, verb), and the set of them must be exactly what the Role grants: a call it does not grant is a 403 in a
cluster, a rule no call uses is a privilege the worker does not need.
"""

from __future__ import annotations

from itertools import product
from pathlib import Path

import httpx
import pytest
import yaml

from forgeboard.runs.models import Run
from forgeboard.runs.services import run_cancel, run_transition
from forgeboard.runs.states import RunState
from tests.platform.test_kubernetes_backend import FakeApiServer, _lost, _submitted, k8s  # noqa: F401 (a fixture)
from workers.launch import kubernetes_backend
from workers.launch.backends import start_run, stop_attempt
from workers.launch.kubernetes_backend import KubernetesApi, poll_kubernetes_runs

K8S_DIR = Path(__file__).resolve().parents[2] / "infra" / "k8s"
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def _manifests(name: str) -> dict[str, dict]:
    return {m["kind"]: m for m in yaml.safe_load_all((K8S_DIR / name).read_text())}


def authorized_as(method: str, url: httpx.URL) -> tuple[str | None, str, str, str]:
    """A request as the API server's authorizer reads it: (namespace or None, apiGroup, resource, verb).

    /api/v1/... is the core group "", /apis/<group>/<version>/... that group; a subresource is a resource of its own
    (pods/log). GET or HEAD on a named object is get, on a collection list, either with watch=true watch; POST create,
    PUT update, PATCH patch, DELETE delete (on a collection deletecollection)."""
    parts = url.path.strip("/").split("/")
    if parts[0] == "api" and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        raise AssertionError(f"{method} {url.path} is not a resource path")
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:  # /namespaces/<ns> alone is the Namespace object, cluster-scoped
        namespace, rest = rest[1], rest[2:]
    resource, name = rest[0], (rest[1] if len(rest) > 1 else None)
    if len(rest) > 2:
        resource = "/".join([resource, *rest[2:]])
    if method in ("GET", "HEAD"):
        verb = "watch" if url.params.get("watch") in ("true", "1") else ("get" if name else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _VERBS[method]
    return namespace, group, resource, verb


def role_grants(role: dict) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every combination the Role's rules name."""
    granted = set()
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, f"a rule the check does not read: {rule}"
        granted |= set(product(rule["apiGroups"], rule["resources"], rule["verbs"]))
    return granted


@pytest.mark.parametrize(("method", "url", "expected"), [
    ("GET", "/apis/batch/v1/namespaces/ns/jobs?labelSelector=a", ("ns", "batch", "jobs", "list")),
    ("GET", "/apis/batch/v1/namespaces/ns/jobs/j", ("ns", "batch", "jobs", "get")),
    ("GET", "/api/v1/namespaces/ns/pods?watch=true", ("ns", "", "pods", "watch")),
    ("GET", "/api/v1/namespaces/ns/pods/p/log", ("ns", "", "pods/log", "get")),
    ("POST", "/api/v1/namespaces/ns/secrets", ("ns", "", "secrets", "create")),
    ("PUT", "/api/v1/namespaces/ns/configmaps/c", ("ns", "", "configmaps", "update")),
    ("PATCH", "/api/v1/namespaces/ns/configmaps/c", ("ns", "", "configmaps", "patch")),
    ("DELETE", "/api/v1/namespaces/ns/pods/p", ("ns", "", "pods", "delete")),
    ("DELETE", "/api/v1/namespaces/ns/pods", ("ns", "", "pods", "deletecollection")),
    ("GET", "/api/v1/pods", (None, "", "pods", "list")),
    ("GET", "/api/v1/namespaces/ns", (None, "", "namespaces", "get")),
])
def test_a_request_is_read_as_the_api_servers_authorizer_reads_it(method, url, expected):
    assert authorized_as(method, httpx.URL(f"https://k8s.example{url}")) == expected


@pytest.fixture
def worker_k8s(k8s, settings, monkeypatch) -> FakeApiServer:  # noqa: F811 (k8s: the fixture)
    """The fake API server, the worker calling it in the Role's namespace."""
    settings.K8S_NAMESPACE = _manifests("worker-rbac.yaml")["Role"]["metadata"]["namespace"]
    api = KubernetesApi(base_url=settings.K8S_API_URL, namespace=settings.K8S_NAMESPACE, token="sa-token",
                        transport=kubernetes_backend.kubernetes_api().transport)
    monkeypatch.setattr(kubernetes_backend, "kubernetes_api", lambda: api)
    return k8s


def _launched_redelivered_followed_and_cleaned_up(team, server: FakeApiServer) -> None:
    """Created, made dependents of the Job; a launch delivered again after a worker died before recording the Job finds
    each object there and reads it; followed (its Job, its pods); ended, then deleted with the Jobs listed."""
    run = _submitted(team)
    Run.objects.filter(pk=run.pk).update(job_id="")
    sent = len(server.requests)
    assert start_run(run_id=run.pk) is True
    assert [r.method for r in server.requests[sent:]] == ["POST", "GET"] * 3 + ["PATCH"] * 2, "each found there, read"
    server.show("k8s_running")
    assert poll_kubernetes_runs() == {run.pk: "running"}
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    server.show("k8s_succeeded")
    assert poll_kubernetes_runs() == {run.pk: "succeeded"}
    assert poll_kubernetes_runs() == {run.pk: f"its Job {run.job_id} deleted"}
    server.pods_removed()


def _cancelled_in_the_queue(team, server: FakeApiServer) -> None:
    run = _submitted(team)
    server.show("k8s_pending_unschedulable")
    run_cancel(actor=team.member, run=run)
    assert poll_kubernetes_runs() == {run.pk: "cancelled in the queue"}
    server.pods_removed()


def _cancelled_while_submitted(team, server: FakeApiServer, monkeypatch) -> None:
    transport = kubernetes_backend.kubernetes_api().transport

    def cancel_at_the_job(request):
        if request.method == "POST" and request.url.path.endswith("/jobs"):
            run = Run.objects.filter(state=RunState.LAUNCHING).get()
            run_cancel(actor=team.member, run=run)
        return server.handle(request)

    monkeypatch.setattr(transport, "handler", cancel_at_the_job)
    run = _submitted(team)
    monkeypatch.setattr(transport, "handler", server.handle)
    assert run.state == RunState.CANCELLED and run.exit_reason.endswith(f"Kubernetes Job {run.job_id} removed")


def _refused_half_way(team, server: FakeApiServer) -> None:
    server.refuse_creating["jobs"] = (403, "jobs.batch is forbidden")
    run = _submitted(team)
    del server.refuse_creating["jobs"]
    assert run.state == RunState.FAILED and server.left(f"forgeboard-run-{run.pk}") == []


def _lost_and_stopped(team, server: FakeApiServer, asks, *, orphaned: bool) -> None:
    """A lost run's stop: its Job deleted in the foreground, or, gone already with its pods left (orphaned), the pods
    one by one; then its ConfigMap and Secret."""
    run, ask = _lost(team, asks)
    server.show("k8s_running")
    if orphaned:
        server.job = None
    assert stop_attempt(**ask).startswith(f"still stopping: Kubernetes Job {run.job_id}")
    server.pods_removed()
    assert stop_attempt(**ask) == f"Kubernetes Job {run.job_id} and its pods are gone; restarted"
    Run.objects.filter(pk=run.pk).update(state=RunState.CANCELLED)  # out of the next scenario's reconcile


@pytest.mark.django_db
def test_the_workers_role_grants_exactly_what_the_launch_backend_calls(team, worker_k8s, asks, monkeypatch):
    server = worker_k8s
    _lost_and_stopped(team, server, asks, orphaned=False)
    _lost_and_stopped(team, server, asks, orphaned=True)
    _launched_redelivered_followed_and_cleaned_up(team, server)
    _cancelled_in_the_queue(team, server)
    _cancelled_while_submitted(team, server, monkeypatch)
    _refused_half_way(team, server)
    role = _manifests("worker-rbac.yaml")["Role"]

    called: dict[tuple[str, str, str], str] = {}
    for request in server.requests:
        namespace, *rule = authorized_as(request.method, request.url)
        assert namespace == role["metadata"]["namespace"], f"{request.method} {request.url.path}: not in the Role's"
        called.setdefault(tuple(rule), f"{request.method} {request.url.path}")

    granted = role_grants(role)
    assert {rule: call for rule, call in called.items() if rule not in granted} == {}, "refused by the Role"
    assert granted - set(called) == set(), "granted by the Role, called by nothing"


def test_the_worker_runs_as_the_account_the_role_is_bound_to_and_no_other_pod_has_a_token():
    rbac = _manifests("worker-rbac.yaml")
    account = rbac["ServiceAccount"]["metadata"]
    binding = rbac["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": rbac["Role"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                    "namespace": account["namespace"]}]
    assert account["namespace"] == rbac["Role"]["metadata"]["namespace"] == binding["metadata"]["namespace"]

    def pod_spec(name: str) -> dict:
        manifests = _manifests(name)
        return (manifests.get("Deployment") or manifests["StatefulSet"])["spec"]["template"]["spec"]

    assert pod_spec("worker.yaml")["serviceAccountName"] == account["name"] == "forgeboard-worker"
    assert "serviceAccountName" not in pod_spec("beat.yaml") and "serviceAccountName" not in pod_spec("web.yaml")
    # Neither calls the API (only the worker's launch backend does): neither mounts the default account's token.
    assert pod_spec("beat.yaml")["automountServiceAccountToken"] is False
    assert pod_spec("web.yaml")["automountServiceAccountToken"] is False
    assert "automountServiceAccountToken" not in pod_spec("worker.yaml"), "the worker needs its token"
    assert pod_spec("postgres.yaml")["automountServiceAccountToken"] is False  # nor do the databases
    assert pod_spec("redis.yaml")["automountServiceAccountToken"] is False
    assert "worker-rbac.yaml" in yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())["resources"]
