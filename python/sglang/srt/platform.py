"""The only place that asks what the hardware is (DESIGN section 6).

Every other module calls these probes when it needs the answer (never copies a value at import time), so a
test can simulate another platform: either `with simulate_platform("hip", gfx="gfx950", aiter=False):` (or
`simulate_platform("cuda", capability=(8, 0))`, an A100) or monkeypatching `is_hip` / `is_cuda` / `gfx_arch` /
`aiter_available` / `cuda_capability` on this module (callers look them up as
`platform.is_hip()`). Optional libraries (aiter, triton) are probed with `find_spec`, never imported here.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SimulatedPlatform:
    """A platform the process pretends to run on (tests only). Tensors stay on the CPU, which stands in for
    the simulated GPU's memory (see `is_device_tensor`)."""

    kind: str  # "cuda" | "hip"
    gfx: Optional[str] = None  # "gfx950" (MI355X), "gfx942" (MI300X) when kind == "hip"
    aiter: bool = False  # whether `aiter` counts as installed
    capability: Optional[tuple] = None  # NVIDIA compute capability (major, minor) when kind == "cuda"

    def __post_init__(self):
        if self.kind not in ("cuda", "hip"):
            raise ValueError(f"simulated platform must be 'cuda' or 'hip', got {self.kind!r}")


_simulated: Optional[SimulatedPlatform] = None


@contextmanager
def simulate_platform(kind: str, gfx: Optional[str] = None, aiter: bool = False, capability: tuple = (9, 0)):
    """Pretend to run on `kind` inside the block (tests: ROCm paths on a machine without an AMD GPU; an NVIDIA GPU
    of compute capability `capability`, Hopper unless told)."""
    global _simulated
    saved = _simulated
    _simulated = SimulatedPlatform(kind, gfx if kind == "hip" else None, aiter,
                                   tuple(capability) if kind == "cuda" else None)
    try:
        yield _simulated
    finally:
        _simulated = saved


def simulated() -> Optional[SimulatedPlatform]:
    return _simulated


def is_cuda() -> bool:
    if _simulated is not None:
        return _simulated.kind == "cuda"
    return torch.version.cuda is not None and torch.cuda.is_available()


def is_hip() -> bool:
    if _simulated is not None:
        return _simulated.kind == "hip"
    # ROCm torch reports its GPUs through torch.cuda; torch.version.hip tells the two apart (checked first:
    # it is free, so CUDA and CPU builds answer without touching the driver).
    return getattr(torch.version, "hip", None) is not None and torch.cuda.is_available()


def is_cpu() -> bool:
    return not is_cuda() and not is_hip()


def platform_name() -> str:
    """'rocm', 'cuda' or 'cpu' (of the machine; the device a model runs on is ServerArgs.device)."""
    return "rocm" if is_hip() else "cuda" if is_cuda() else "cpu"


KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"


def gfx_from_kfd(nodes_dir: str = KFD_NODES) -> Optional[str]:
    """The first GPU's architecture from the ROCm kernel driver's topology, without a GPU context:
    gfx_target_version = major*10000 + minor*100 + stepping (90500 -> gfx950, 90402 -> gfx942, 90010 ->
    gfx90a); CPU nodes report 0. (Encoding read from the driver's sysfs format; not checked on hardware here.)"""
    try:
        nodes = sorted(os.listdir(nodes_dir), key=lambda n: int(n) if n.isdigit() else -1)
    except OSError:
        return None
    for node in nodes:
        try:
            with open(os.path.join(nodes_dir, node, "properties")) as f:
                props = dict(line.split(None, 1) for line in f if len(line.split(None, 1)) == 2)
            version = int(props.get("gfx_target_version", "0"))
        except (OSError, ValueError):
            continue
        if version:
            return f"gfx{version // 10000}{(version // 100) % 100:x}{version % 100:x}"
    return None


@functools.lru_cache(maxsize=None)
def _probe_gfx() -> Optional[str]:
    if torch.cuda.is_initialized():
        # gcnArchName carries target features after the name ("gfx942:sramecc+:xnack-"); the name is enough.
        return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    # Asking torch would create a GPU context in this process (the HTTP process of launch_server never
    # needs one, and it would cost GPU memory on device 0): read the driver's topology instead.
    return gfx_from_kfd()


def gfx_arch() -> Optional[str]:
    """AMD GPU architecture of device 0 ("gfx950" MI355X, "gfx942" MI300X), None off ROCm."""
    if _simulated is not None:
        return _simulated.gfx
    return _probe_gfx() if is_hip() else None


def cuda_capability(device: Optional[torch.device] = None) -> Optional[tuple]:
    """NVIDIA compute capability (major, minor) of `device` (default: the current GPU): (9, 0) Hopper, (8, 0) A100;
    None off NVIDIA GPUs (ROCm, CPU)."""
    if _simulated is not None:
        return _simulated.capability
    if not is_cuda():
        return None
    return _capability(torch.cuda.current_device() if device is None or device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


def aiter_available() -> bool:
    """Whether `aiter` (AMD's kernel library) can be imported; it is not imported here."""
    if _simulated is not None:
        return _simulated.aiter
    return has_library("aiter")


def is_device_tensor(t: torch.Tensor) -> bool:
    """Whether `t` lives on the GPU (ROCm's GPUs are torch 'cuda' devices). Under simulation the CPU stands in
    for the GPU, so the simulated platform's device code paths run on CPU tensors."""
    return t.device.type == "cuda" or (_simulated is not None and t.device.type == "cpu")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=None)
def _find_spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without __spec__
        return False


def has_library(name: str) -> bool:
    """Whether an optional library (aiter, triton, ...) can be imported, without importing it."""
    if name in sys.modules:  # imported already (or blocked: sys.modules[name] = None makes imports fail)
        return sys.modules[name] is not None
    return _find_spec(name)


def memory_budget_bytes(device: str) -> tuple:
    """(free, total) bytes of the device; on CPU, MemAvailable / MemTotal from /proc/meminfo."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except OSError:
        return 8 << 30, 16 << 30
    return info.get("MemAvailable", 8 << 30), info.get("MemTotal", 16 << 30)
