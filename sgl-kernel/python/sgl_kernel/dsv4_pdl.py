"""Programmatic dependent launch (PDL; NVIDIA sm90 and later) for chains of small decode kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still running: its programs
occupy free SMs and wait (`griddepcontrol.wait`) until that kernel has finished and its writes are visible. The
launch, the programs' dispatch and their first instructions then overlap the predecessor's last wave instead of
following it. A kernel lets its successor be scheduled once every one of its programs has executed
`griddepcontrol.launch_dependents` (or exited).

`pdl_enter(PDL)` does both at a kernel's start: wait for the predecessor, then release the successor. Waiting first
keeps the rule simple: nothing a kernel reads can be stale, and when a successor starts, every kernel before this one
has finished. Releasing right after lets the successor's programs fill SMs as this kernel's last wave drains. Both are
no-ops in a kernel launched without PDL. The decode MoE chains its launches this way (dsv4_moe: align,
gate-up, SwiGLU over K splits, down, combine); PDL=False compiles to the kernels without it (ROCm, the CPU
interpreter, GPUs before sm90).

A profile of PDL launches charges each kernel from the moment it is scheduled, its wait for the predecessor included,
so a kernel's time there is mostly its neighbour's. `SGLANG_DSV4_PDL=0` launches every kernel without PDL: a profile
then gives each kernel its own time (what a per-kernel table should be read from), and the step's time with and
without it is what PDL saves.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton 3.3+ on NVIDIA builds
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older or non-NVIDIA Triton: pdl_supported says False
    gdc_launch_dependents = gdc_wait = None


def pdl_supported(device: torch.device) -> bool:
    """PDL launches: an NVIDIA GPU of sm90 or later, a Triton with griddepcontrol, not the interpreter."""
    if device.type != "cuda" or torch.version.hip is not None or gdc_wait is None or interpreting():
        return False
    if os.environ.get("SGLANG_DSV4_PDL", "1") == "0":  # profiling: each kernel's own time (module docstring)
        return False
    return _sm90_or_later(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _sm90_or_later(index: int) -> bool:  # once per device: the MoE asks on every call
    return torch.cuda.get_device_capability(index) >= (9, 0)


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1): kernels there take Triton's own ops, never
    inline PTX or launch options a GPU launcher has."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pdl_launch(pdl: bool) -> dict:
    """The launch keyword for a PDL kernel (none otherwise: the interpreter and older launchers take no such key)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """At a kernel's start: wait for the previous kernel's writes, then let the next kernel be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

