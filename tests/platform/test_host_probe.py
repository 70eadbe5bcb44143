"""Workers report their own hosts (`cluster.probe`), so a cluster without node agents still has an inventory."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from forgeboard.audit.models import AuditEvent
from forgeboard.cluster.models import Host, HostLiveness
from forgeboard.cluster.services import DeviceReport, WorkerProbe, host_probe_record, host_register
from tests.support.processes import REPO_DIR, celery_worker, platform_env, wait_for
from tests.workers.fake_nvml import FakeNvml


def _record(**overrides) -> Host:
    reading = {"probe": WorkerProbe(worker="w1"), "hostname": "node-1", "pool": "cpu", "cpu_count": 16,
               "memory_bytes": 64 << 30, "cpu_utilization": 12.5, "memory_utilization": 40.0, "version": "0.1.0",
               "devices": [DeviceReport(kind="gpu", index=0, model="H200", memory_bytes=141 << 30, uuid="GPU-a",
                                        utilization=3.0, memory_used_bytes=1 << 30)]}
    return host_probe_record(**(reading | overrides))


def test_a_probe_registers_a_new_host_then_heartbeats_it(db):
    host = _record()
    assert (host.pool, host.cpu_count, host.memory_bytes, host.agent_version) == ("cpu", 16, 64 << 30,
                                                                                 "worker-probe/0.1.0")
    assert host.devices.get().model == "H200" and host.last_heartbeat_at is not None
    [entry] = AuditEvent.objects.filter(action="host.register")
    assert entry.actor is None and entry.payload["worker"] == "w1"
    first_beat = host.last_heartbeat_at
    same = _record(cpu_utilization=90.0, devices=[DeviceReport(kind="gpu", index=0, model="H200",
                                                               memory_bytes=141 << 30, uuid="GPU-a",
                                                               utilization=88.0, memory_used_bytes=9 << 30)])
    assert same.cpu_utilization == 90.0 and same.last_heartbeat_at > first_beat
    assert same.devices.get().utilization == 88.0
    assert AuditEvent.objects.filter(action__startswith="host.").count() == 1  # heartbeats are not audited


def test_a_changed_host_is_registered_again_keeping_its_labels(db):
    Host.objects.filter(pk=_record().pk).update(labels={"rack": "a1"})
    changed = _record(devices=[])  # its GPU is gone
    assert changed.devices.count() == 0 and changed.labels == {"rack": "a1"}
    assert AuditEvent.objects.filter(action="host.update").count() == 1


def test_a_down_host_comes_back_up_when_its_worker_reports(db):
    Host.objects.filter(pk=_record().pk).update(liveness=HostLiveness.DOWN)
    assert _record().liveness == HostLiveness.UP


def test_an_agent_reported_host_keeps_its_pool_and_agent_version(team):
    host_register(actor=team.operator, hostname="node-1", pool="h200", labels={"zone": "b"}, agent_version="0.1.0",
                  cpu_count=16, memory_bytes=64 << 30)
    host = _record(devices=[])
    assert (host.pool, host.agent_version, host.labels) == ("h200", "0.1.0", {"zone": "b"})


def test_the_probe_task_reports_this_machine_with_the_agents_reading(db, settings, monkeypatch):
    from workers import tasks

    settings.WORKER_POOL = "gpu-a"
    monkeypatch.setattr(tasks, "_collector", None)
    monkeypatch.setattr("workers.agent.load_nvml", lambda: FakeNvml())
    assert tasks.probe_own_host() == socket.gethostname()
    host = Host.objects.get(hostname=socket.gethostname())
    assert host.pool == "gpu-a" and host.cpu_count >= 1 and host.memory_bytes > 0
    assert host.cpu_utilization is not None and host.memory_utilization is not None
    gpus = list(host.devices.filter(kind="gpu").order_by("index"))
    assert len(gpus) == 8 and all("H200" in gpu.model for gpu in gpus)


def test_the_beat_task_asks_the_other_probed_hosts_through_their_queues(db, settings, monkeypatch):
    from workers import tasks
    from workers.celery import app

    settings.PROBE_SECONDS = 20
    monkeypatch.setattr(tasks, "probe_own_host", lambda: "me")
    for name, version, liveness, intent in (("me", "worker-probe/0.1.0", "up", "schedulable"),
                                            ("w2", "worker-probe/0.1.0", "up", "schedulable"),
                                            ("w3", "worker-probe/0.1.0", "up", "cordoned"),
                                            ("gone", "worker-probe/0.1.0", "down", "schedulable"),
                                            ("agent-host", "0.1.0", "up", "schedulable")):
        Host.objects.create(hostname=name, agent_version=version, liveness=liveness, intent=intent)
    sent = []
    monkeypatch.setattr(app, "send_task", lambda name, **kw: sent.append((name, kw["queue"], kw["expires"])))
    assert tasks.probe_hosts() == ["w2", "w3"]
    assert sent == [("cluster.probe_host", "probe.w2", 20), ("cluster.probe_host", "probe.w3", 20)]


def test_beat_runs_the_probe_unless_it_is_turned_off():
    code = "import django; django.setup(); from django.conf import settings; print(settings.CELERY_BEAT_SCHEDULE)"
    out = {}
    for value in ("15", "0"):
        result = subprocess.run([sys.executable, "-c", code], cwd=REPO_DIR, capture_output=True, text=True,
                                env=platform_env(FORGEBOARD_PROBE_SECONDS=value), timeout=120)
        assert result.returncode == 0, result.stderr
        out[value] = result.stdout
    assert "'probe-hosts': {'task': 'cluster.probe', 'schedule': 15}" in out["15"]
    assert "cluster.probe'" not in out["0"]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_reports_its_host_when_ready(tmp_path):
    """No agent: a worker started with probes on puts its own machine into the inventory through its host queue."""
    with celery_worker(tmp_path / "worker.log", FORGEBOARD_PROBE_SECONDS="20", FORGEBOARD_WORKER_POOL="cpu-pool"):
        assert f"probe.{socket.gethostname()}" in (tmp_path / "worker.log").read_text()
        host = wait_for(lambda: Host.objects.filter(hostname=socket.gethostname()).first(), timeout=60,
                        what="the worker's host in the inventory")
    assert host.pool == "cpu-pool" and host.cpu_count >= 1 and host.agent_version.startswith("worker-probe/")
