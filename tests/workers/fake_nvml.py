"""A stand-in for the `pynvml` module, answering with recorded values (recorded/nvml_8xh200.json)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

RECORDED = Path(__file__).parent / "recorded" / "nvml_8xh200.json"


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    pass


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801 - pynvml's name
    pass


class FakeNvml:
    """Only the calls the agent makes, with pynvml's names, argument order and return shapes."""

    NVMLError = NVMLError
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, gpus: list[dict[str, Any]] | None = None, *, names_as_bytes: bool = False):
        self.gpus = gpus if gpus is not None else json.loads(RECORDED.read_text())["gpus"]
        self.names_as_bytes = names_as_bytes
        self.lost: set[int] = set()
        self.no_remapping = False

    def _gpu(self, handle: int) -> dict[str, Any]:
        if handle in self.lost:
            raise NVMLError_GpuIsLost("GPU is lost")
        return self.gpus[handle]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index in self.lost:
            raise NVMLError_GpuIsLost("GPU is lost")
        return index

    def nvmlDeviceGetName(self, handle: int) -> str | bytes:
        name = self._gpu(handle)["name"]
        return name.encode() if self.names_as_bytes else name

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        uuid = self._gpu(handle)["uuid"]
        return uuid.encode() if self.names_as_bytes else uuid

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        gpu = self._gpu(handle)
        return SimpleNamespace(total=gpu["memory_total"], used=gpu["memory_used"], free=gpu["memory_free"])

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        gpu = self._gpu(handle)
        return SimpleNamespace(gpu=gpu["utilization_gpu"], memory=gpu["utilization_memory"])

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        assert (error_type, counter_type) == (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC)
        return self._gpu(handle)["ecc_uncorrected_volatile"]

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, bool, bool]:
        if self.no_remapping:
            raise NVMLError_NotSupported("Not Supported")
        return tuple(self._gpu(handle)["remapped_rows"])
