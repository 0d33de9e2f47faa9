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


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Return `x @ H_d^T` with `H_d` the Sylvester Hadamard matrix of size d = x.shape[-1]
    scaled by d^-1/2 (orthonormal, symmetric, self-inverse).

    Any leading shape; computed in fp32 and cast back to `x.dtype` (floating inputs).
    """
    d = x.shape[-1]
    if d <= 0 or d & (d - 1):
        raise ValueError(f"hadamard_rotate: last dim must be a power of two, got {d}")
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    lead = x.shape[:-1]
    y = x.reshape(-1, d).to(torch.float32)
    n = y.shape[0]
    h = 1
    while h < d:
        # Sylvester step: pairs (i, i + h) within each 2h-block -> (a + b, a - b).
        y = y.view(n, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(*lead, d) * (d ** -0.5)
    return y.to(out_dtype)
