"""The node agent: NVML readings, report bodies, backoff, and the register/heartbeat loop (no Django)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.workers.fake_nvml import FakeNvml
from workers import agent
from workers.agent import Agent, Backoff, Collector, ControlPlane, Gpu, Inventory

REPO_DIR = Path(__file__).resolve().parents[2]
H200_BYTES = 150_754_820_096


def test_agent_and_launch_specs_import_without_django():
    code = ("import sys, workers.agent, workers.launch.slurm, workers.launch.kubernetes\n"
            "leaked = [m for m in ('django', 'forgeboard') if m in sys.modules]\n"
            "assert not leaked, leaked\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_DIR, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_reads_eight_h200s_from_nvml():
    gpus = agent.read_gpus(FakeNvml())
    assert [g.index for g in gpus] == list(range(8))
    assert {g.model for g in gpus} == {"NVIDIA H200"}
    assert all(g.memory_bytes == H200_BYTES for g in gpus)
    assert gpus[0] == Gpu(index=0, model="NVIDIA H200", memory_bytes=H200_BYTES, memory_used_bytes=93_467_361_280,
                          utilization=97.0, uuid="GPU-3f2a9c1e-8b4d-5e6f-a7b8-c9d0e1f2a3b4", health="healthy")
    assert gpus[7].utilization == 0.0 and gpus[7].health == "healthy"


def test_old_pynvml_bytes_are_decoded():
    gpus = agent.read_gpus(FakeNvml(names_as_bytes=True))
    assert gpus[3].model == "NVIDIA H200" and gpus[3].uuid.startswith("GPU-9e8d7c6b")


@pytest.mark.parametrize(
    ("ecc", "remapped", "health"),
    [
        (0, [0, 0, False, False], "healthy"),
        (2, [0, 0, False, False], "unhealthy"),
        (0, [3, 0, True, False], "degraded"),
        (0, [0, 1, False, True], "unhealthy"),
    ],
)
def test_gpu_health_from_ecc_and_row_remapping(ecc, remapped, health):
    nvml = FakeNvml()
    nvml.gpus[5] |= {"ecc_uncorrected_volatile": ecc, "remapped_rows": remapped}
    gpus = agent.read_gpus(nvml)
    assert gpus[5].health == health
    assert {g.health for i, g in enumerate(gpus) if i != 5} == {"healthy"}


def test_boards_without_row_remapping_are_healthy():
    nvml = FakeNvml()
    nvml.no_remapping = True
    assert {g.health for g in agent.read_gpus(nvml)} == {"healthy"}


def test_a_lost_gpu_is_reported_unhealthy_not_skipped():
    nvml = FakeNvml()
    nvml.lost = {2}
    gpus = agent.read_gpus(nvml)
    assert len(gpus) == 8
    assert gpus[2] == Gpu(index=2, model="unknown", memory_bytes=0, memory_used_bytes=None, utilization=None,
                          uuid="", health="unhealthy")
    assert gpus[3].health == "healthy"


def test_no_pynvml_means_no_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert agent.load_nvml() is None
    inventory = Collector(nvml=None, hostname="cpu-01").collect()
    assert inventory.gpus == [] and inventory.hostname == "cpu-01"
    assert inventory.cpu_count >= 1 and inventory.memory_bytes > 0
    assert 0 <= inventory.cpu_utilization <= 100 and 0 < inventory.memory_utilization <= 100


def test_report_bodies_carry_the_inventory():
    inventory = Inventory(hostname="gpu-001", cpu_count=192, memory_bytes=2 * 2**40, cpu_utilization=41.5,
                          memory_utilization=37.0, gpus=agent.read_gpus(FakeNvml()))
    body = agent.register_body(inventory, pool="h200", labels={"rack": "a1"})
    assert body["agent_version"] == agent.AGENT_VERSION and body["pool"] == "h200"
    assert len(body["devices"]) == 8
    assert body["devices"][1] == {"kind": "gpu", "index": 1, "model": "NVIDIA H200", "memory_bytes": H200_BYTES,
                                  "uuid": "GPU-5b7e0d2c-1a3f-4e5d-96c7-b8a9f0e1d2c3", "health": "healthy",
                                  "utilization": 96.0, "memory_used_bytes": 93_469_458_432}
    beat = agent.heartbeat_body(inventory)
    assert set(beat) == {"hostname", "cpu_utilization", "memory_utilization", "devices"}
    assert beat["devices"][7] == {"kind": "gpu", "index": 7, "health": "healthy", "utilization": 0.0,
                                  "memory_used_bytes": 617_611_264}
    json.dumps(body), json.dumps(beat)  # both must be plain JSON


def test_backoff_grows_exponentially_with_full_jitter_and_a_cap():
    backoff = Backoff(base_s=1, cap_s=30, rng=random.Random(0))
    delays = [backoff.next_delay() for _ in range(10)]
    ceilings = [1, 2, 4, 8, 16, 30, 30, 30, 30, 30]
    assert all(0 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert len(set(delays)) == 10  # jittered, not a fixed schedule
    assert max(delays[5:]) > 16  # the later delays use the larger ceiling
    backoff.reset()
    assert backoff.next_delay() <= 1


class FakeServer:
    """An httpx transport playing the control plane: a script of answers, and a log of what was asked."""

    def __init__(self, answers: list):
        self.answers = list(answers)
        self.requests: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.url.path, json.loads(request.content)))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer, json={"code": "x", "message": f"status {answer}", "errors": []})

    @property
    def paths(self) -> list[str]:
        return [path.rsplit("/", 1)[-1] for path, _ in self.requests]


def _agent(server: FakeServer, sleeps: list[float]) -> Agent:
    client = httpx.Client(base_url="http://cp.test", transport=httpx.MockTransport(server))
    inventory = Inventory(hostname="gpu-001", cpu_count=8, memory_bytes=2**35, cpu_utilization=5.0,
                          memory_utilization=10.0, gpus=agent.read_gpus(FakeNvml()))
    return Agent(plane=ControlPlane(client), collect=lambda: inventory, interval_s=10,
                 backoff=Backoff(base_s=1, cap_s=60, rng=random.Random(1)), sleep=sleeps.append)


def test_registers_then_heartbeats_on_the_interval():
    server = FakeServer([200, 200, 200])
    sleeps: list[float] = []
    assert _agent(server, sleeps).run(max_reports=3) == agent.EXIT_OK
    assert server.paths == ["register", "heartbeat", "heartbeat"]
    assert sleeps == [10, 10]
    assert len(server.requests[0][1]["devices"]) == 8


def test_network_errors_back_off_then_recover():
    server = FakeServer([httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), 503, 200, 200])
    sleeps: list[float] = []
    assert _agent(server, sleeps).run(max_reports=2) == agent.EXIT_OK
    assert server.paths == ["register"] * 4 + ["heartbeat"]
    backoffs, interval = sleeps[:3], sleeps[3:]
    assert all(0 <= d <= c for d, c in zip(backoffs, [1, 2, 4], strict=True))
    assert interval == [10]


def test_forgotten_host_registers_again():
    server = FakeServer([200, 404, 200, 409, 200])
    sleeps: list[float] = []
    assert _agent(server, sleeps).run(max_reports=3) == agent.EXIT_OK
    assert server.paths == ["register", "heartbeat", "register", "heartbeat", "register"]


@pytest.mark.parametrize("status", [400, 401, 413])
def test_refused_reports_stop_the_agent(status):
    server = FakeServer([status])
    assert _agent(server, []).run() == agent.EXIT_REFUSED
    assert server.paths == ["register"]


def test_once_gives_up_after_a_few_attempts():
    server = FakeServer([httpx.ConnectError("down")] * agent.ONCE_ATTEMPTS)
    sleeps: list[float] = []
    assert _agent(server, sleeps).run(once=True) == agent.EXIT_UNREACHABLE
    assert len(server.requests) == agent.ONCE_ATTEMPTS and len(sleeps) == agent.ONCE_ATTEMPTS - 1


def test_command_line_refuses_a_bad_token_file(tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text("fb_notanagenttoken\n")
    server = ["--server", "http://127.0.0.1:9"]
    assert agent.main([*server, "--token-file", str(token_file), "--once"]) == agent.EXIT_REFUSED
    assert "does not hold an agent token" in capsys.readouterr().err
    assert agent.main([*server, "--token-file", str(tmp_path / "missing")]) == agent.EXIT_REFUSED
    assert "No such file" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--interval", "0"], ["--label", "novalue"]])
def test_command_line_rejects_bad_options(argv, tmp_path):
    with pytest.raises(SystemExit) as caught:
        agent.build_parser().parse_args(["--server", "http://x", "--token-file", str(tmp_path / "t"), *argv])
    assert caught.value.code == 2
