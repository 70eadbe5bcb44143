"""A Kubernetes run's workers found through monarch.job's KubernetesJob: real Monarch workers, a fake API server.

Two workers run on this machine with the pod's own worker command (workers/launch/kubernetes.py), on
127.0.0.1 and a free port each. A small HTTP server stands in for the API server: it answers the pod
watch with `ADDED` events and the pod list with a PodList, both made of copies of a recorded pod of
the run's Indexed Job (workers/launch/recorded/k8s_engine_pod_ready.json) whose IP, MONARCH_PORT
and rank point at those workers. The kubernetes client is pointed at it where the in-cluster config
would be loaded, and nowhere else.

The controller side runs in a subprocess: KubernetesJob chooses Monarch's transport for its
process (TCP with the hostname), which must not leak into other tests of this pytest session
(tests/engine/conftest.py orders them by the transport they need).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.engine.test_monarch_hosts import ancestors
from workers.engine.actors.hosts import port_open
from workers.engine.actors.kubernetes_workers import KubernetesWorkersError, kubernetes_hosts
from workers.engine.actors.local_workers import REPO_DIR, LocalWorker, free_port, stop_workers
from workers.launch.kubernetes import KubernetesLaunchRequest, kubernetes_objects

pytestmark = pytest.mark.slow

RECORDED_POD = REPO_DIR / "workers" / "launch" / "recorded" / "k8s_engine_pod_ready.json"
NAMESPACE = "research"
PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"
DISCOVERY_ENV = {"FORGEBOARD_MONARCH_JOB": "kubernetes", "FORGEBOARD_RUN_ID": "42", "FORGEBOARD_RUN_NODES": "2",
                 "FORGEBOARD_POD_NAMESPACE": NAMESPACE, "FORGEBOARD_POD_IP": "127.0.0.1",
                 "FORGEBOARD_K8S_JOB": "forgeboard-run-42-1"}  # attempt 1 of run 42
SELECTOR = "forgeboard.run-id=42,batch.kubernetes.io/job-name=forgeboard-run-42-1"

# The controller: the in-cluster config becomes the fake API server over plain HTTP (the real one needs the
# service-account files and https); then the engine's own discovery (Hosts.from_job), and one proc per host.
CONTROLLER = r"""
import json, os, sys
import kubernetes
from kubernetes import client

def load_fake_config():
    configuration = client.Configuration()
    configuration.host = sys.argv[1]
    client.Configuration.set_default(configuration)

kubernetes.config.load_incluster_config = load_fake_config

from workers.engine.actors.hosts import Hosts, HostsUnreachable
from workers.engine.actors.proc_gpus import ProcGpus

try:
    hosts = Hosts.from_job(kind="kubernetes", timeout_s=float(sys.argv[2]))  # as the engine does
except HostsUnreachable as error:
    print(json.dumps({"error": str(error)}))
    sys.exit(0)
workers = list(hosts.workers.values())
pids = {}
for worker in workers:
    procs = hosts.spawn_procs(host=worker.name, count=1, threads=1)
    pids[worker.name] = procs.spawn("probe", ProcGpus).assigned.call_one().get(timeout=60)[0]
print(json.dumps({"workers": [[w.name, w.address, w.host, w.port] for w in workers], "pids": pids}))
"""


def recorded_pod(*, rank: int, port: int, ready: bool = True, job: str = "forgeboard-run-42-1") -> dict[str, Any]:
    """The recorded pod of rank 0, as the pod of `rank` of Job `job` whose worker listens on 127.0.0.1:`port`."""
    pod = copy.deepcopy(json.loads(RECORDED_POD.read_text()))
    metadata, spec, status = pod["metadata"], pod["spec"], pod["status"]
    metadata["name"] = f"{job}-{rank}-{'x7k2p' if rank == 0 else 'm3q8z'}"
    metadata["namespace"] = NAMESPACE
    metadata["labels"]["batch.kubernetes.io/job-name"] = metadata["labels"]["job-name"] = job
    metadata["labels"]["batch.kubernetes.io/job-completion-index"] = str(rank)
    metadata["annotations"]["batch.kubernetes.io/job-completion-index"] = str(rank)
    spec["hostname"] = f"{job}-{rank}"
    (monarch_port,) = [e for e in spec["containers"][0]["env"] if e["name"] == "MONARCH_PORT"]
    monarch_port["value"] = str(port)
    status["podIP"], status["podIPs"] = "127.0.0.1", [{"ip": "127.0.0.1"}]
    for condition in status["conditions"]:
        if condition["type"] in ("Ready", "ContainersReady"):
            condition["status"] = "True" if ready else "False"
    return pod


class FakeApiServer:
    """Pods of one namespace: the watch streams those its label selector (`k=v,k2=v2`) selects as ADDED events and
    stays open for its timeoutSeconds, as the API server does; the plain list returns them. Keeps every request's path
    and query."""

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []
        self.refuse: int | None = None  # answer every request with this HTTP status
        self.requests: list[tuple[str, dict[str, list[str]]]] = []
        self.closing = threading.Event()
        fake = self

        def selected(query: dict[str, list[str]]) -> list[dict[str, Any]]:
            terms = [term.partition("=") for term in query.get("labelSelector", [""])[0].split(",") if term]
            return [pod for pod in fake.pods if all(pod["metadata"]["labels"].get(k) == v for k, _, v in terms)]

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                fake.requests.append((url.path, query))
                if fake.refuse is not None or url.path != PODS_PATH:
                    status = fake.refuse or 404
                    self._json(status, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status,
                                        "reason": "Forbidden" if status == 403 else "NotFound",
                                        "message": f'pods is forbidden: User "system:serviceaccount:{NAMESPACE}:'
                                                   f'default" cannot watch resource "pods"'})
                elif query.get("watch", ["false"])[0].lower() == "true":
                    self._watch(float(query.get("timeoutSeconds", ["60"])[0]), selected(query))
                else:
                    self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "918300"},
                                     "items": selected(query)})

            def _json(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _watch(self, timeout_s: float, pods: list[dict[str, Any]]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for pod in pods:
                        self._chunk(json.dumps({"type": "ADDED", "object": pod}).encode() + b"\n")
                    fake.closing.wait(timeout_s)
                    self._chunk(b"")
                except OSError:  # the client stopped watching
                    pass
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def watches(self) -> list[dict[str, list[str]]]:
        return [query for path, query in self.requests if query.get("watch")]


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    fake = FakeApiServer()
    fake.thread.start()
    try:
        yield fake
    finally:
        fake.closing.set()
        fake.server.shutdown()
        fake.server.server_close()


@pytest.fixture(scope="module")
def pod_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalWorker]]:
    """Two Monarch workers started with the Job's own container command, as pods of rank >= 1 run it."""
    request = KubernetesLaunchRequest(run_id=42, image="registry.example/forgeboard:1.0", config_yaml="recipe: grpo\n",
                                      nodes=2, gpus_per_node=0, cpus_per_node=2, memory="4Gi", namespace=NAMESPACE,
                                      control_plane_url="https://forgeboard.example", token_secret="run-42-token",
                                      python=sys.executable)
    (container,) = kubernetes_objects(request)[1]["spec"]["template"]["spec"]["containers"]
    folder = tmp_path_factory.mktemp("pod-workers")
    workers: list[LocalWorker] = []
    try:
        for index in range(2):
            port = free_port()
            env = dict(os.environ) | {"PYTHONPATH": str(REPO_DIR), "JOB_COMPLETION_INDEX": str(index + 1),
                                      "FORGEBOARD_POD_IP": "127.0.0.1", "MONARCH_PORT": str(port)}
            log_path = folder / f"pod{index}.log"
            with open(log_path, "ab") as log:
                process = subprocess.Popen(container["command"], cwd=REPO_DIR, env=env, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            workers.append(LocalWorker(f"pod{index}", f"tcp://127.0.0.1:{port}", process, log_path))
        deadline = time.monotonic() + 120
        for worker in workers:
            while not port_open("127.0.0.1", int(worker.address.rsplit(":", 1)[1]), timeout_s=0.5):
                assert worker.process.poll() is None, worker.log_path.read_text()
                assert time.monotonic() < deadline, worker.log_path.read_text()
                time.sleep(0.2)
        yield workers
    finally:
        stop_workers(workers)


def discover(api_url: str, *, timeout_s: float) -> tuple[dict[str, Any], float]:
    """Run the controller in a process of its own; what it printed, and how long it took."""
    env = dict(os.environ) | {"PYTHONPATH": str(REPO_DIR)} | DISCOVERY_ENV
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CONTROLLER, api_url, str(timeout_s)], cwd=REPO_DIR, env=env,
                          capture_output=True, text=True, timeout=180, check=False)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), elapsed


def test_the_run_pods_become_a_host_mesh_in_rank_order(api: FakeApiServer, pod_workers: list[LocalWorker]) -> None:
    ports = [int(w.address.rsplit(":", 1)[1]) for w in pod_workers]
    api.pods = [recorded_pod(rank=1, port=ports[1]), recorded_pod(rank=0, port=ports[0])]  # rank 1 is seen first
    found, _ = discover(api.url, timeout_s=60)
    assert found["workers"] == [["forgeboard-run-42-1-0", f"tcp://127.0.0.1:{ports[0]}", "127.0.0.1", ports[0]],
                                ["forgeboard-run-42-1-1", f"tcp://127.0.0.1:{ports[1]}", "127.0.0.1", ports[1]]]
    (watch,) = api.watches()
    assert watch["labelSelector"] == [SELECTOR] and watch["watch"] == ["true"]
    lists = [query for _, query in api.requests if not query.get("watch")]  # the names and IPs, after the attach
    assert [query["labelSelector"] for query in lists] == [[SELECTOR]]
    assert all(path == PODS_PATH for path, _ in api.requests)
    # each host of the mesh is the pod of its rank: the proc spawned there is that worker's descendant
    for worker, name in zip(pod_workers, ["forgeboard-run-42-1-0", "forgeboard-run-42-1-1"]):
        assert worker.pid in ancestors(found["pids"][name]), (name, found["pids"])


def test_an_earlier_attempts_pods_still_terminating_are_never_attached(
        api: FakeApiServer, pod_workers: list[LocalWorker]) -> None:
    """Attempt 0's pods (Job forgeboard-run-42), still Ready through their grace period, carry the same run label and
    ranks, and their workers no longer answer: the controller of attempt 1 attaches its own Job's pods only. By the run
    label alone (the old selector) both attempts' pods were listed, and the workers it named for ranks 0 and 1 were
    attempt 0's pods, at ports where nothing answers."""
    ports = [int(w.address.rsplit(":", 1)[1]) for w in pod_workers]
    earlier = [recorded_pod(rank=rank, port=free_port(), job="forgeboard-run-42") for rank in (0, 1)]
    api.pods = [recorded_pod(rank=0, port=ports[0]), recorded_pod(rank=1, port=ports[1]), *earlier]
    found, _ = discover(api.url, timeout_s=60)
    assert [w[0] for w in found["workers"]] == ["forgeboard-run-42-1-0", "forgeboard-run-42-1-1"], found
    assert [w[3] for w in found["workers"]] == ports


def test_a_pod_that_never_becomes_ready_is_named_within_the_timeout(api: FakeApiServer) -> None:
    api.pods = [recorded_pod(rank=0, port=free_port()), recorded_pod(rank=1, port=free_port(), ready=False)]
    found, elapsed = discover(api.url, timeout_s=3)
    assert f"pods {SELECTOR} in namespace research not attached within 3 s" in found["error"]
    assert "Missing ranks: [1]" in found["error"]
    assert 3 <= elapsed < 15, "the watch ends at its timeout (the rest is Monarch's import)"


def test_a_refused_watch_says_the_api_refused(api: FakeApiServer) -> None:
    api.refuse = 403
    found, _ = discover(api.url, timeout_s=5)
    assert f"pods {SELECTOR} in namespace research" in found["error"]
    assert "403" in found["error"] and "cannot watch resource" in found["error"]


def test_an_api_server_that_cannot_be_reached_is_named() -> None:
    found, _ = discover(f"http://127.0.0.1:{free_port()}", timeout_s=5)  # nothing listens there
    assert f"pods {SELECTOR} in namespace research not attached within 5 s" in found["error"]
    assert "Connection refused" in found["error"]


@pytest.mark.parametrize(("missing", "says"), [
    ("FORGEBOARD_RUN_NODES", "FORGEBOARD_RUN_NODES must be a positive integer"),
    ("FORGEBOARD_RUN_ID", "FORGEBOARD_RUN_ID must be a positive integer"),
    ("FORGEBOARD_POD_NAMESPACE", "FORGEBOARD_POD_NAMESPACE is not set"),
    ("FORGEBOARD_POD_IP", r"FORGEBOARD_POD_IP is not set \(the pod spec sets it from status.podIP\)"),
    ("FORGEBOARD_K8S_JOB", r"FORGEBOARD_K8S_JOB is not set \(the pod spec sets it from the Job's name\)"),
])
def test_a_missing_variable_is_named_before_any_api_call(missing: str, says: str) -> None:
    environ = {k: v for k, v in DISCOVERY_ENV.items() if k != missing}
    with pytest.raises(KubernetesWorkersError, match=says):
        kubernetes_hosts(environ=environ, timeout_s=1)


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "0", "-1", "2.0"])
def test_a_node_count_that_is_not_a_positive_integer_is_named(value: str) -> None:
    with pytest.raises(KubernetesWorkersError, match="FORGEBOARD_RUN_NODES must be a positive integer"):
        kubernetes_hosts(environ={**DISCOVERY_ENV, "FORGEBOARD_RUN_NODES": value}, timeout_s=1)
