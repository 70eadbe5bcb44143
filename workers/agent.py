"""Node agent: reports this host's inventory to the control plane, then heartbeats.

    python -m workers.agent --server URL --token-file PATH [--interval 10] [--pool NAME]
                            [--label KEY=VALUE ...] [--hostname NAME] [--once]

Runs on GPU nodes without Django. GPUs are read through NVML when `pynvml` imports and NVML
initialises; otherwise the host reports no GPUs. Network errors and 5xx answers are retried with
exponential backoff and full jitter; a refused token or a refused report stops the agent.
"""

from __future__ import annotations

import argparse
import logging
import random
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

AGENT_VERSION = "0.1.0"
REGISTER_PATH = "/api/agent/v1/hosts/register"
HEARTBEAT_PATH = "/api/agent/v1/hosts/heartbeat"
ONCE_ATTEMPTS = 5
EXIT_OK, EXIT_UNREACHABLE, EXIT_REFUSED = 0, 1, 2

logger = logging.getLogger("forgeboard.agent")


@dataclass(frozen=True)
class Gpu:
    index: int
    model: str
    memory_bytes: int
    memory_used_bytes: int | None
    utilization: float | None
    uuid: str
    health: str


@dataclass(frozen=True)
class Inventory:
    hostname: str
    cpu_count: int
    memory_bytes: int
    cpu_utilization: float
    memory_utilization: float
    gpus: list[Gpu] = field(default_factory=list)


# --- GPUs through NVML ------------------------------------------------------------------------

def load_nvml() -> Any | None:
    """The initialised `pynvml` module, or None when it is missing or NVML cannot start (no driver)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        logger.warning("NVML did not initialise, reporting no GPUs: %s", exc)
        return None
    return pynvml


def _text(value: str | bytes) -> str:
    # Older pynvml releases return bytes.
    return value.decode() if isinstance(value, bytes) else value


def _gpu_health(nvml: Any, handle: Any) -> str:
    """Unhealthy on uncorrected ECC errors or a failed row remap; degraded while a remap waits for a reset."""
    try:
        uncorrected = nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    except nvml.NVMLError:
        uncorrected = 0  # ECC disabled or not supported on this board
    if uncorrected > 0:
        return "unhealthy"
    try:
        _corrected_rows, _uncorrected_rows, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
    except nvml.NVMLError:
        pending = failed = False  # row remapping exists from Ampere on
    if failed:
        return "unhealthy"
    return "degraded" if pending else "healthy"


def read_gpus(nvml: Any) -> list[Gpu]:
    """One reading per GPU. A GPU that stops answering is reported unhealthy, not skipped."""
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            rates = nvml.nvmlDeviceGetUtilizationRates(handle)
            gpus.append(Gpu(
                index=index, model=_text(nvml.nvmlDeviceGetName(handle)), memory_bytes=int(memory.total),
                memory_used_bytes=int(memory.used), utilization=float(rates.gpu),
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)), health=_gpu_health(nvml, handle),
            ))
        except nvml.NVMLError as exc:
            logger.warning("GPU %d did not answer NVML: %s", index, exc)
            gpus.append(Gpu(index=index, model="unknown", memory_bytes=0, memory_used_bytes=None,
                            utilization=None, uuid="", health="unhealthy"))
    return gpus


# --- the host ---------------------------------------------------------------------------------

class Collector:
    FIRST_CPU_SAMPLE_S = 0.5

    def __init__(self, *, nvml: Any | None, hostname: str | None = None):
        self.nvml = nvml
        self.hostname = hostname or socket.gethostname()
        self.sampled = False

    def collect(self) -> Inventory:
        # psutil measures CPU use since its previous call, so the first reading waits for a short sample.
        cpu = psutil.cpu_percent(interval=None if self.sampled else self.FIRST_CPU_SAMPLE_S)
        self.sampled = True
        memory = psutil.virtual_memory()
        return Inventory(
            hostname=self.hostname, cpu_count=psutil.cpu_count(logical=True) or 0, memory_bytes=int(memory.total),
            cpu_utilization=float(cpu), memory_utilization=float(memory.percent),
            gpus=read_gpus(self.nvml) if self.nvml is not None else [],
        )


def register_body(inventory: Inventory, *, pool: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "hostname": inventory.hostname, "pool": pool, "labels": labels, "cpu_count": inventory.cpu_count,
        "memory_bytes": inventory.memory_bytes, "cpu_utilization": inventory.cpu_utilization,
        "memory_utilization": inventory.memory_utilization, "agent_version": AGENT_VERSION,
        "devices": [
            {"kind": "gpu", "index": g.index, "model": g.model, "memory_bytes": g.memory_bytes, "uuid": g.uuid,
             "health": g.health, "utilization": g.utilization, "memory_used_bytes": g.memory_used_bytes}
            for g in inventory.gpus
        ],
    }


def heartbeat_body(inventory: Inventory) -> dict[str, Any]:
    return {
        "hostname": inventory.hostname, "cpu_utilization": inventory.cpu_utilization,
        "memory_utilization": inventory.memory_utilization,
        "devices": [
            {"kind": "gpu", "index": g.index, "health": g.health, "utilization": g.utilization,
             "memory_used_bytes": g.memory_used_bytes}
            for g in inventory.gpus
        ],
    }


# --- talking to the control plane -------------------------------------------------------------

class Unreachable(Exception):
    """A network error, a timeout, 429 or 5xx: worth retrying later."""


class Refused(Exception):
    """The control plane refused the token or the report: retrying the same request cannot help."""


class NotRegistered(Exception):
    """The control plane does not know this host or one of its devices: register again."""


class Backoff:
    """Exponential backoff with full jitter: the n-th delay is uniform in [0, min(cap, base * 2**n)]."""

    def __init__(self, *, base_s: float = 1.0, cap_s: float = 60.0, rng: random.Random | None = None):
        self.base_s, self.cap_s = base_s, cap_s
        self.rng = rng or random.Random()
        self.attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self.cap_s, self.base_s * 2 ** self.attempt)
        self.attempt += 1
        return self.rng.uniform(0, ceiling)

    def reset(self) -> None:
        self.attempt = 0


class ControlPlane:
    def __init__(self, client: httpx.Client):
        self.client = client

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self.client.post(path, json=body)
        except httpx.TransportError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code == 429 or response.status_code >= 500:
            raise Unreachable(f"HTTP {response.status_code} from {path}")
        if response.status_code in (404, 409) and path == HEARTBEAT_PATH:
            raise NotRegistered(_message(response))
        if response.status_code >= 400:
            raise Refused(f"HTTP {response.status_code} from {path}: {_message(response)}")
        return response.json()

    def register(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post(REGISTER_PATH, body)

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post(HEARTBEAT_PATH, body)


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json().get("message", response.text))
    except ValueError:
        return response.text[:500]


@dataclass
class Agent:
    plane: ControlPlane
    collect: Callable[[], Inventory]
    pool: str = "default"
    labels: dict[str, str] = field(default_factory=dict)
    interval_s: float = 10.0
    backoff: Backoff = field(default_factory=Backoff)
    sleep: Callable[[float], None] = time.sleep
    registered: bool = False

    def report(self) -> dict[str, Any]:
        """Register (first time, or when the control plane forgot this host), else heartbeat."""
        inventory = self.collect()
        if not self.registered:
            answer = self.plane.register(register_body(inventory, pool=self.pool, labels=self.labels))
            self.registered = True
            return answer
        try:
            return self.plane.heartbeat(heartbeat_body(inventory))
        except NotRegistered as exc:
            logger.info("control plane asks to register again: %s", exc)
            self.registered = False
            return self.report()

    def run(self, *, once: bool = False, max_reports: int | None = None) -> int:
        """Report until stopped; with `once`, report once (retrying network errors a few times)."""
        attempts = reports = 0
        while True:
            attempts += 1
            try:
                answer = self.report()
            except Unreachable as exc:
                if once and attempts >= ONCE_ATTEMPTS:
                    logger.error("control plane unreachable after %d attempts: %s", attempts, exc)
                    return EXIT_UNREACHABLE
                delay = self.backoff.next_delay()
                logger.warning("control plane unreachable (%s); retrying in %.1f s", exc, delay)
                self.sleep(delay)
                continue
            except Refused as exc:
                logger.error("%s", exc)
                return EXIT_REFUSED
            self.backoff.reset()
            reports += 1
            logger.debug("reported: %s", answer)
            if once or (max_reports is not None and reports >= max_reports):
                return EXIT_OK
            self.sleep(self.interval_s)


# --- command line -----------------------------------------------------------------------------

def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.agent", description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="control plane URL, e.g. https://forgeboard.example")
    parser.add_argument("--token-file", required=True, type=Path, help="file holding the agent token fba_...")
    parser.add_argument("--interval", type=_positive, default=10.0, help="seconds between heartbeats")
    parser.add_argument("--pool", default="default", help="node pool this host belongs to")
    parser.add_argument("--label", type=_label, action="append", default=[], help="KEY=VALUE, repeatable")
    parser.add_argument("--hostname", help="report under this name instead of the machine's hostname")
    parser.add_argument("--once", action="store_true", help="report once and exit")
    return parser


def read_token(path: Path) -> str:
    token = path.read_text(encoding="utf-8").strip()
    if not token.startswith("fba_"):
        raise ValueError(f"{path}: does not hold an agent token (fba_...)")
    return token


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request every few seconds is noise
    args = build_parser().parse_args(argv)
    try:
        token = read_token(args.token_file)
    except (OSError, ValueError) as exc:
        print(f"agent token: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    nvml = load_nvml()
    headers = {"Authorization": f"Bearer {token}", "User-Agent": f"forgeboard-agent/{AGENT_VERSION}"}
    try:
        with httpx.Client(base_url=args.server, headers=headers, timeout=10.0) as client:
            agent = Agent(plane=ControlPlane(client), collect=Collector(nvml=nvml, hostname=args.hostname).collect,
                          pool=args.pool, labels=dict(args.label), interval_s=args.interval)
            return agent.run(once=args.once)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        if nvml is not None:
            nvml.nvmlShutdown()


if __name__ == "__main__":
    sys.exit(main())
