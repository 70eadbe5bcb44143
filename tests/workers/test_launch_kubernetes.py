"""Kubernetes launch: the Job and ConfigMap for a run, and Job/Pod status read as run states."""

from __future__ import annotations

import json
import shlex
import sys
import types
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from workers.launch import kubernetes
from workers.launch.kubernetes import KubernetesLaunchRequest, kubernetes_job_status, kubernetes_objects
from workers.launch.slurm import LaunchSpecError

RECORDED = Path(kubernetes.__file__).parent / "recorded"

REQUEST = KubernetesLaunchRequest(
    run_id=42, image="registry.example/forgeboard:1.0", config_yaml="recipe: grpo\nmodel: {path: /models/q}\n",
    nodes=2, gpus_per_node=8, cpus_per_node=96, memory="1600Gi", namespace="forgeboard",
    control_plane_url="https://forgeboard.example", token_secret="forgeboard-run-42-token",
    environment={"NCCL_DEBUG": "WARN"}, overrides=("trainer.steps=200",),
)


def _job() -> dict:
    config_map, job = kubernetes_objects(REQUEST)
    assert (config_map["kind"], job["kind"]) == ("ConfigMap", "Job")
    return job


def _container(job: dict) -> dict:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def test_job_runs_once_one_pod_per_node():
    job = _job()
    assert job["apiVersion"] == "batch/v1" and job["metadata"]["namespace"] == "forgeboard"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed", 2, 2, 0)
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and "subdomain" not in pod
    assert job["metadata"]["labels"]["forgeboard.run-id"] == "42"
    assert spec["template"]["metadata"]["labels"]["forgeboard.run-id"] == "42"


def test_pod_requests_gpus_cpus_and_memory():
    container = _container(_job())
    assert container["resources"] == {
        "requests": {"cpu": "96", "memory": "1600Gi", "nvidia.com/gpu": "8"},
        "limits": {"memory": "1600Gi", "nvidia.com/gpu": "8"},
    }
    assert _job()["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_pod_gets_the_run_environment_and_what_the_engine_discovers_its_workers_with():
    env = _container(_job())["env"]
    assert {e["name"]: e["value"] for e in env if "value" in e} == {
        "FORGEBOARD_RUN_ID": "42", "FORGEBOARD_URL": "https://forgeboard.example",
        "FORGEBOARD_RUN_TOKEN_FILE": "/var/run/secrets/forgeboard/token", "NCCL_DEBUG": "WARN",
        "FORGEBOARD_MONARCH_JOB": "kubernetes", "FORGEBOARD_RUN_NODES": "2",
        "FORGEBOARD_K8S_JOB": "forgeboard-run-42",  # the controller attaches this Job's pods, not an earlier attempt's
        "MONARCH_PORT": "26600",  # KubernetesJob dials each pod at the port its MONARCH_PORT says
        "FORGEBOARD_GPUS_PER_HOST": "8",  # the engine hands each node's GPUs to procs (placement gpus_per_proc)
    }
    assert {e["name"]: e["valueFrom"] for e in env if "valueFrom" in e} == {
        "FORGEBOARD_POD_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        "FORGEBOARD_POD_IP": {"fieldRef": {"fieldPath": "status.podIP"}},
    }


def test_pods_run_as_the_service_account_that_may_watch_pods():
    pod = _job()["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "forgeboard-engine" and pod["automountServiceAccountToken"] is True
    other = kubernetes_objects(replace(REQUEST, service_account="team-a-engine"))[1]
    assert other["spec"]["template"]["spec"]["serviceAccountName"] == "team-a-engine"


def test_pod_is_ready_when_its_worker_accepts_connections():
    container = _container(_job())
    assert container["ports"] == [{"name": "monarch", "containerPort": 26600}]
    assert container["readinessProbe"]["tcpSocket"] == {"port": "monarch"}


def test_token_comes_from_a_secret_volume_and_config_from_a_config_map():
    job = _job()
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["run-token"]["secret"]["secretName"] == "forgeboard-run-42-token"
    assert volumes["run-token"]["secret"]["items"] == [{"key": "token", "path": "token"}]
    assert volumes["run-config"]["configMap"]["name"] == "forgeboard-run-42"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    mounts = {m["name"]: m for m in _container(job)["volumeMounts"]}
    assert mounts["run-token"] == {"name": "run-token", "mountPath": "/var/run/secrets/forgeboard", "readOnly": True}
    config_map = kubernetes_objects(REQUEST)[0]
    assert config_map["data"] == {"config.yaml": REQUEST.config_yaml}
    assert "forgeboard-run-42-token" not in json.dumps(config_map)


def test_without_a_run_volume_claim_the_run_folder_is_an_emptydir_lost_with_the_pod():
    job = _job()
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["run"] == {"name": "run", "emptyDir": {}}
    mounts = {m["name"]: m for m in _container(job)["volumeMounts"]}
    assert mounts["run"] == {"name": "run", "mountPath": "/var/lib/forgeboard/run"}
    assert _container(job)["workingDir"] == "/var/lib/forgeboard/run"


def test_a_run_volume_claim_holds_the_run_folder_one_folder_per_run_shared_by_its_attempts():
    config_yaml = "recipe: grpo\ncheckpoint: {folder: /var/lib/forgeboard/run/checkpoints, resume_latest: true}\n"
    request = replace(REQUEST, run_volume_claim="forgeboard-runs", config_yaml=config_yaml)
    objects = {attempt: kubernetes_objects(replace(request, attempt=attempt)) for attempt in (0, 3)}
    for config_map, job in objects.values():
        volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
        assert volumes["run"] == {"name": "run", "persistentVolumeClaim": {"claimName": "forgeboard-runs"}}
        mounts = {m["name"]: m for m in _container(job)["volumeMounts"]}
        assert mounts["run"] == {"name": "run", "mountPath": "/var/lib/forgeboard/run", "subPath": "run-42"}
        assert config_map["data"] == {"config.yaml": config_yaml}
    assert objects[0][1]["metadata"]["name"] != objects[3][1]["metadata"]["name"], "a Job per attempt, one folder"


def test_an_fs_group_is_the_pods_fsgroup_applied_only_when_the_volumes_root_lacks_it_and_none_is_set_without():
    assert "securityContext" not in _job()["spec"]["template"]["spec"]
    for gid in (0, 2000):
        job = kubernetes_objects(replace(REQUEST, run_volume_claim="forgeboard-runs", fs_group=gid))[1]
        pod = job["spec"]["template"]["spec"]
        assert pod["securityContext"] == {"fsGroup": gid, "fsGroupChangePolicy": "OnRootMismatch"}
        assert "securityContext" not in _container(job), "the image's own user is left as it is"


def test_pod_zero_runs_the_controller_and_every_pod_a_worker_on_its_pod_ip():
    command = _container(_job())["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    script = command[2].splitlines()
    assert script[1] == 'if [ "$JOB_COMPLETION_INDEX" = "0" ]; then'
    assert script[2].endswith(" &") and "run_worker_loop_forever" in script[2]
    assert script[3] == ("  exec python -m workers.engine train --config /etc/forgeboard/run/config.yaml "
                         "trainer.steps=200")
    assert script[-1] == f"exec python -c {shlex.quote(kubernetes.WORKER_CODE)}"
    assert script[2] == f"  python -c {shlex.quote(kubernetes.WORKER_CODE)} &"


def test_the_worker_advertises_the_address_kubernetes_job_dials():
    """tcp://<pod IP>:<MONARCH_PORT>, listening on every interface (tests/engine/test_kubernetes_workers.py runs it)."""
    captured = {}
    fake_monarch = types.ModuleType("monarch.actor")
    fake_monarch.run_worker_loop_forever = lambda **kwargs: captured.update(kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "monarch.actor", fake_monarch)
        patch.setenv("FORGEBOARD_POD_IP", "10.244.3.21")
        patch.setenv("MONARCH_PORT", "26600")
        exec(kubernetes.WORKER_CODE, {})  # noqa: S102 - the pod's own worker code, against a fake monarch.actor
    assert captured == {"address": "tcp://10.244.3.21:26600@tcp://0.0.0.0:26600", "ca": "trust_all_connections"}


def test_no_service_is_created_the_workers_are_found_by_label():
    assert [obj["kind"] for obj in kubernetes_objects(REQUEST)] == ["ConfigMap", "Job"]
    assert _job()["spec"]["template"]["metadata"]["labels"]["forgeboard.run-id"] == "42"


def test_cpu_only_runs_request_no_gpus():
    job = kubernetes_objects(replace(REQUEST, gpus_per_node=0, node_selector={"pool": "cpu"}))[1]
    container = _container(job)
    assert "nvidia.com/gpu" not in container["resources"]["requests"]
    assert "tolerations" not in job["spec"]["template"]["spec"]
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}


def test_a_finished_job_is_deleted_by_the_api_server_only_after_its_ttl_a_backstop_for_the_poller():
    assert "ttlSecondsAfterFinished" not in _job()["spec"], "none unless asked: the poller deletes it"
    job = kubernetes_objects(replace(REQUEST, ttl_after_finished_s=7 * 24 * 3600))[1]
    assert job["spec"]["ttlSecondsAfterFinished"] == 604800


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"namespace": "Forge Board"}, "namespace"),
        ({"image": ""}, "image"),
        ({"memory": "1.5TB"}, "memory"),
        ({"nodes": 0}, "nodes"),
        ({"config_yaml": "  "}, "config_yaml"),
        ({"token_secret": "Bad_Secret"}, "token_secret"),
        ({"environment": {"FORGEBOARD_RUN_TOKEN_FILE": "/tmp/x"}}, "environment.FORGEBOARD_RUN_TOKEN_FILE"),
        ({"environment": {"MONARCH_PORT": "1"}}, "environment.MONARCH_PORT"),
        ({"environment": {"FORGEBOARD_POD_IP": "10.0.0.1"}}, "environment.FORGEBOARD_POD_IP"),
        ({"environment": {"FORGEBOARD_K8S_JOB": "forgeboard-run-41"}}, "environment.FORGEBOARD_K8S_JOB"),
        ({"service_account": "Engine SA"}, "service_account"),
        ({"control_plane_url": "forgeboard.example"}, "control_plane_url"),
        ({"ttl_after_finished_s": 0}, "ttl_after_finished_s"),  # 0 would delete a Job as soon as it finished
        ({"run_volume_claim": "Runs_Volume"}, "run_volume_claim"),
        ({"run_volume_claim": "runs/../other"}, "run_volume_claim"),
        ({"fs_group": -1}, "fs_group"),
        ({"fs_group": 2**31}, "fs_group"),
        ({"fs_group": "2000"}, "fs_group"),
        ({"fs_group": True}, "fs_group"),
    ],
)
def test_bad_requests_name_the_field(change, field):
    with pytest.raises(LaunchSpecError) as caught:
        kubernetes_objects(replace(REQUEST, **change))
    assert caught.value.field == field


# --- Job and Pod status --------------------------------------------------------------------------

def _status(name: str):
    recorded = json.loads((RECORDED / name).read_text())
    return kubernetes_job_status(recorded["job"], recorded["pods"]["items"])


@pytest.mark.parametrize(
    ("fixture", "state", "reason_has"),
    [
        ("k8s_pending_unschedulable.json", "queued", "8 Insufficient nvidia.com/gpu"),
        ("k8s_suspended_kueue.json", "queued", "suspended"),
        ("k8s_launching_container_creating.json", "launching", "1 of 2 pods running"),
        ("k8s_running.json", "running", "2 of 2 pods running"),
        ("k8s_succeeded.json", "succeeded", "controller pod succeeded"),
        ("k8s_failed_oomkilled.json", "failed", "forgeboard-run-42-1-q9m4d ran out of memory (OOMKilled)"),
        ("k8s_failed_image_pull.json", "failed",
         'ImagePullBackOff: Back-off pulling image "registry.example/forgeboard:1.1"'),
        ("k8s_failed_exit_code.json", "failed", "pod forgeboard-run-42-0-x7k2p failed (exit code 1, Error)"),
        ("k8s_failed_deadline.json", "failed", "active deadline"),
        ("k8s_lost_evicted.json", "lost", "was evicted: The node was low on resource: ephemeral-storage"),
        ("k8s_lost_preempted.json", "lost", "disrupted (PreemptionByScheduler)"),
    ],
)
def test_job_and_pod_status_map_to_run_states(fixture, state, reason_has):
    status = _status(fixture)
    assert status.state == state
    assert reason_has in status.reason
    assert status.job_id == "forgeboard-run-42"
    assert status.terminal == (state in ("succeeded", "failed", "lost"))


def test_a_running_jobs_status_names_the_nodes_its_pods_run_on():
    assert _status("k8s_running.json").nodes == "gpu-node-07,gpu-node-08"
    assert _status("k8s_launching_container_creating.json").nodes == ""  # said once every pod runs


def test_controller_pod_success_counts_before_the_job_says_so():
    recorded = json.loads((RECORDED / "k8s_succeeded.json").read_text())
    recorded["job"]["status"].pop("conditions")
    assert kubernetes_job_status(recorded["job"], recorded["pods"]["items"]).state == "succeeded"


def test_a_job_with_no_pods_yet_is_launching():
    recorded = json.loads((RECORDED / "k8s_running.json").read_text())
    assert kubernetes_job_status(recorded["job"], []).state == "launching"


def test_not_a_job_is_refused():
    with pytest.raises(LaunchSpecError, match="Job"):
        kubernetes_job_status({"kind": "Pod"}, [])


@pytest.mark.parametrize(("completed", "state"), [("0", "succeeded"), ("0-1", "succeeded"), ("0,2-3", "succeeded"),
                                                  ("1", "running"), ("10-11", "running"), ("", "running")])
def test_the_controller_index_counted_completed_is_a_success_once_its_pod_is_gone(completed, state):
    """The Job controller counts pod 0's success in the Job's status (completedIndexes) before the pod can be removed
    (deleted with its Job): a stop that reads the Job after that finds the success there."""
    recorded = json.loads((RECORDED / "k8s_running.json").read_text())
    recorded["job"]["status"]["completedIndexes"] = completed
    recorded["job"]["metadata"]["deletionTimestamp"] = "2026-11-30T05:02:41Z"
    pods = [p for p in recorded["pods"]["items"] if p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] != "0"]
    if state == "running":
        pods = recorded["pods"]["items"]
    assert kubernetes_job_status(recorded["job"], pods).state == state


def test_a_create_answered_exists_whose_object_is_then_gone_is_a_refusal_that_says_so():
    """A redelivered launch's create finds the object (409), whose read then finds none (it was being deleted)."""
    from workers.launch.kubernetes_backend import KubernetesApi, KubernetesApiFailed

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409 if request.method == "POST" else 404, json={"message": "no"})

    api = KubernetesApi(base_url="https://k8s.test", namespace="research", transport=httpx.MockTransport(answer))
    with pytest.raises(KubernetesApiFailed, match=r"^creating Secret s: it exists, then it does not \(being deleted\?\)$"):
        api.create({"kind": "Secret", "metadata": {"name": "s"}})
