"""Normalised Sylvester (Walsh-)Hadamard rotation used by the lightning indexer.

The indexer rotates both its queries and its keys by the same orthonormal matrix before
quantizing the keys to FP4 (docs/dsv4-architecture.md 5.5): the rotation spreads outliers
over the whole vector so the per-32 block scales fit the values better, and since
H is orthonormal the exact score q.k is unchanged.

We use the in-place butterfly (O(d log d)) rather than a dense matmul: it needs no cache,
and on GPUs a dense fp32 matmul may silently run in TF32.
"""

from __future__ import annotations

import torch
from sgl_kernel.dsv4_formats_ref import hadamard_ref


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Return `x @ H_d^T` with `H_d` the Sylvester Hadamard matrix of size d = x.shape[-1]
    scaled by d^-1/2 (orthonormal, symmetric, self-inverse).

    Any leading shape; computed in fp32 (sgl_kernel's `hadamard_ref`, the same butterflies the kernels and the
    index-key compression use) and cast back to `x.dtype` (floating inputs).
    """
    d = x.shape[-1]
    if d <= 0 or d & (d - 1):
        raise ValueError(f"hadamard_rotate: last dim must be a power of two, got {d}")
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    y = hadamard_ref(x.reshape(-1, d).to(torch.float32), torch.float32)
    return y.reshape(x.shape).to(out_dtype)
