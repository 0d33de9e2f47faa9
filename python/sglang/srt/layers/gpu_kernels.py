"""Optional sgl_kernel ops for the torch layers: the layers dispatch to these on GPUs and keep their torch code as the
CPU path and the reference."""

from __future__ import annotations

import functools
import importlib


@functools.lru_cache(maxsize=None)
def sgl_kernel_op(module: str, name: str):
    """`sgl_kernel.<module>.<name>`, or None where Triton / sgl_kernel is not installed (looked up once)."""
    try:
        return getattr(importlib.import_module(f"sgl_kernel.{module}"), name)
    except ImportError:
        return None
