"""The devices a plan can be made for: peak figures from the vendors' data sheets, and how fast the links between them
are. A plan on a device never measured uses these with the default efficiencies of `calibration.Calibration`; a run
measured on a device kind replaces the efficiencies (not the peaks) with what it achieved.

Peaks are dense bf16 tensor-core FLOP/s (the data sheets' sparse figures halved), HBM bandwidth, and per-direction
link bandwidth: NVLink within a host (the data sheets' totals are both directions), one 400 Gb/s (A100: 200 Gb/s)
InfiniBand NIC per GPU between hosts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GB = 1e9
TERA = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # FLOP/s of one device
    memory_bandwidth: float  # bytes/s of one device's memory
    memory_bytes: float
    devices_per_host: int
    intra_host_bandwidth: float  # bytes/s one device sends to another on its host
    inter_host_bandwidth: float  # bytes/s one device sends to a device on another host
    link_latency_s: float  # a message's fixed cost (alpha of the latency-bandwidth model)
    description: str
    shared: bool = False  # every proc of a placement shares one host's devices (this machine's cores), busy or not


DEVICES: dict[str, DeviceSpec] = {spec.name: spec for spec in (
    DeviceSpec("a100", peak_flops=312 * TERA, memory_bandwidth=2039 * GB, memory_bytes=80 * GB, devices_per_host=8,
               intra_host_bandwidth=300 * GB, inter_host_bandwidth=25 * GB, link_latency_s=10e-6,
               description="NVIDIA A100 SXM 80GB: 312 TFLOP/s bf16, 2.0 TB/s HBM2e, NVLink 3 600 GB/s, HDR 200 Gb/s"),
    DeviceSpec("h100", peak_flops=989 * TERA, memory_bandwidth=3350 * GB, memory_bytes=80 * GB, devices_per_host=8,
               intra_host_bandwidth=450 * GB, inter_host_bandwidth=50 * GB, link_latency_s=8e-6,
               description="NVIDIA H100 SXM: 989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 4 900 GB/s, NDR 400 Gb/s"),
    DeviceSpec("h200", peak_flops=989 * TERA, memory_bandwidth=4800 * GB, memory_bytes=141 * GB, devices_per_host=8,
               intra_host_bandwidth=450 * GB, inter_host_bandwidth=50 * GB, link_latency_s=8e-6,
               description="NVIDIA H200 SXM: 989 TFLOP/s bf16, 4.8 TB/s HBM3e, NVLink 4 900 GB/s, NDR 400 Gb/s"),
    DeviceSpec("b200", peak_flops=2250 * TERA, memory_bandwidth=8000 * GB, memory_bytes=180 * GB, devices_per_host=8,
               intra_host_bandwidth=900 * GB, inter_host_bandwidth=50 * GB, link_latency_s=8e-6,
               description="NVIDIA B200: 2.25 PFLOP/s bf16, 8 TB/s HBM3e, NVLink 5 1.8 TB/s, NDR 400 Gb/s"),
)}


DEVICE_NAMES = (*DEVICES, "cpu")  # what a plan can be made for


def cpu_device(*, cores: int | None = None) -> DeviceSpec:
    """This machine's cores as devices: one core a device (a proc's `trainer.threads_per_process` cores), gloo over
    loopback as every link. Its peaks are nominal: a CPU plan is only as good as the run it was calibrated on."""
    return DeviceSpec("cpu", peak_flops=50e9, memory_bandwidth=10 * GB, memory_bytes=float(os.sysconf("SC_PAGE_SIZE")
                      * os.sysconf("SC_PHYS_PAGES")), devices_per_host=cores or os.cpu_count() or 1,
                      intra_host_bandwidth=2 * GB, inter_host_bandwidth=2 * GB, link_latency_s=100e-6,
                      description="this machine's CPU cores, one core a device", shared=True)


def device(name: str) -> DeviceSpec:
    if name == "cpu":
        return cpu_device()
    if name not in DEVICES:
        raise KeyError(f"unknown device {name!r}; known: {', '.join(DEVICE_NAMES)}")
    return DEVICES[name]
