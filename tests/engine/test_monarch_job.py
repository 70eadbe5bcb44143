"""Where a cluster run's workers come from (FORGEBOARD_MONARCH_JOB), and the errors when its job cannot be used.

The SLURM path end to end (a SlurmJob's batch runner starting a worker and the engine) is in
tests/system/test_slurm_job_live.py; Kubernetes discovery in test_kubernetes_workers.py.
"""

from __future__ import annotations

import os
import socket

import pytest

from workers.engine.actors import monarch_job
from workers.engine.actors.hosts import Hosts, HostsUnreachable
from workers.engine.actors.monarch_job import MonarchJobError, expand_hostlist, job_kind, slurm_batch_workers


def test_the_job_kind_is_read_and_checked():
    assert job_kind({}) is None
    assert job_kind({"FORGEBOARD_MONARCH_JOB": " slurm "}) == "slurm"
    assert job_kind({"FORGEBOARD_MONARCH_JOB": "kubernetes"}) == "kubernetes"
    with pytest.raises(MonarchJobError, match="'ray' is not one of slurm, kubernetes"):
        job_kind({"FORGEBOARD_MONARCH_JOB": "ray"})


def test_outside_a_batch_job_the_engine_says_how_to_submit(monkeypatch):
    monkeypatch.delenv("MONARCH_BATCH_JOB", raising=False)
    with pytest.raises(MonarchJobError, match="not the client of a SlurmJob in batch mode"):
        slurm_batch_workers(state_file=".monarch/job_state.pkl")


def test_a_missing_job_file_names_the_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("MONARCH_BATCH_JOB", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MonarchJobError, match=f"no .monarch/job_state.pkl in {tmp_path}"):
        slurm_batch_workers(state_file=".monarch/job_state.pkl")


def test_hosts_from_a_job_that_cannot_be_used_are_unreachable_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("MONARCH_BATCH_JOB", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HostsUnreachable, match="no .monarch/job_state.pkl"):
        Hosts.from_job(kind="slurm", timeout_s=5)


def _resolving_to(monkeypatch, names: dict[str, str]) -> None:
    """Names resolve as `names` says; any other (this host's own name among them) to loopback only."""
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (names.get(host, "127.0.1.1"), 0))])


@pytest.mark.parametrize("nodelist", [None, "gpu[001-002]", "gpu001,gpu002"])
def test_a_multi_node_job_on_a_loopback_hostname_is_refused(monkeypatch, nodelist):
    _resolving_to(monkeypatch, {"gpu001": "10.0.0.1", "gpu002": "10.0.0.2"})
    monkeypatch.setenv("SLURM_NNODES", "2")
    if nodelist is None:
        monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    else:
        monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    with pytest.raises(MonarchJobError, match="resolves to loopback only, so the other nodes' workers"):
        monarch_job._listen_on_loopback_if_alone()


@pytest.mark.parametrize(("nodes", "nodelist"), [("1", "vm"), ("2", "127.0.0.2,127.0.0.3"), ("2", "fbslurm[1-2]")])
def test_an_allocation_all_on_this_machine_listens_on_loopback(monkeypatch, nodes, nodelist):
    _resolving_to(monkeypatch, {})
    monkeypatch.setenv("SLURM_NNODES", nodes)
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    chosen = []
    monkeypatch.setattr("monarch.actor.enable_transport", chosen.append)
    monkeypatch.setattr("workers.engine.actors.worker._transport", None)  # not chosen yet in this process
    monarch_job._listen_on_loopback_if_alone()
    assert chosen == ["tcp://127.0.0.1:0"]


def test_a_routable_hostname_keeps_monarchs_own_transport(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu001")
    _resolving_to(monkeypatch, {"gpu001": "10.0.0.1"})
    monkeypatch.setenv("SLURM_NNODES", "2")
    chosen = []
    monkeypatch.setattr("monarch.actor.enable_transport", chosen.append)
    monkeypatch.setattr("workers.engine.actors.worker._transport", None)
    monarch_job._listen_on_loopback_if_alone()
    assert chosen == []


@pytest.mark.parametrize(("hostlist", "names"), [
    ("gpu[001-003,7],cpu1", ["gpu001", "gpu002", "gpu003", "gpu7", "cpu1"]),
    ("fbslurm[1-2]", ["fbslurm1", "fbslurm2"]),
    ("a,b", ["a", "b"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("node[9-11]", ["node9", "node10", "node11"]),
    ("", []),
])
def test_a_slurm_host_list_expands_in_slurms_order(hostlist, names):
    assert expand_hostlist(hostlist) == names


@pytest.mark.parametrize("hostlist", ["x[1-", "x]", "x[a-b]", "x[[1]]", "x[3-1]", "x[1,]", "x[\u00b2]", "x[1-\u0663]"])
def test_a_host_list_that_is_not_one_is_refused(hostlist):
    with pytest.raises(MonarchJobError, match="is not a SLURM host list"):
        expand_hostlist(hostlist)


@pytest.mark.parametrize(("printed", "found"), [
    ('{"jobs": [{"job_id": 3, "job_state": "COMPLETED"}, {"job_id": 7, "job_state": "RUNNING"}]}', "RUNNING"),
    ('{"jobs": [{"job_id": 3, "job_state": "COMPLETED"}]}', None),  # not in the queue
    ("squeue: error: slurm_load_jobs error", None),  # not JSON
    ('["a list"]', None),
])
def test_the_jobs_squeue_record_is_picked_by_its_id(monkeypatch, tmp_path, printed, found):
    """Slurm 22.05's squeue --json lists every job whatever --jobs says; an ended job listed first is not ours."""
    fake = tmp_path / "squeue"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{printed}\nEOF\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    record = monarch_job.squeue_record("7")
    assert (record or {}).get("job_state") == found
