"""Whether the running forward is recorded into (or warms up for) a CUDA graph.

Some kernels are chosen differently for graph replays than for eager launches (layers/quantization/fp8.py: eager
calls pay host time that replays do not). The graph runner marks each batch size's warm-up runs and its capture with
`graph_capture_region()`, so the warm-up compiles and initialises exactly the kernels the capture records (Triton
compilation or a first cuBLAS call inside a capture can fail). One scheduler thread per process runs forwards, so a
module-level depth suffices.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_depth = 0


@contextmanager
def graph_capture_region():
    """Inside: forwards are graph warm-ups or captures (nestable)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def in_graph_capture() -> bool:
    """Inside graph_capture_region(), or while the current CUDA stream is being captured."""
    return _depth > 0 or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
