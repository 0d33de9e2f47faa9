"""The only place that asks what the hardware is (DESIGN section 6)."""

from __future__ import annotations

import functools
import importlib.util

import torch


def is_cuda() -> bool:
    return torch.cuda.is_available() and torch.version.cuda is not None


def is_hip() -> bool:
    return torch.cuda.is_available() and getattr(torch.version, "hip", None) is not None


def is_cpu() -> bool:
    return not torch.cuda.is_available()


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


@functools.lru_cache(maxsize=None)
def has_library(name: str) -> bool:
    """Whether an optional library (aiter, triton, ...) can be imported, without importing it."""
    return importlib.util.find_spec(name) is not None


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
