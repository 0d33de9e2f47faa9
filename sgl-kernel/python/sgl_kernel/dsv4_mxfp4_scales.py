"""Where the fused MXFP4 MoE reads its scale bytes (dsv4_moe): the checkpoint's row-major [E, R, G] (one ue8m0
byte per 32 inputs, G groups per row) or the K-chunked storage the experts module keeps on the GPU.

A decode program streams BLOCK_N weight rows through 256-input K tiles, so each step needs 8 scale bytes of every row.
Row-major, those 8 bytes sit G bytes apart from the next row's: one partly used 32-byte sector per row and step, a
quarter as many extra requests as the codes themselves. Chunked, [E, G/8, R, 8] (8 groups = 256 inputs per chunk),
one step's scale bytes of consecutive rows are contiguous. On an H200 that made the decode gate-up 8-11% faster at 1,
8 and 32 tokens (RESULTS.md, "MoE decode: the scale bytes' loads, found by counters and stage timings; chunked scale
storage", 2026-12-04); the codes keep the checkpoint's layout.

Kernels take either layout (`scale_layout`): the byte of group g of row r is at r * G + g row-major and at
r * 8 + (g // 8) * R * 8 + g % 8 chunked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8  # scale bytes (32-input groups) per chunk: one 256-input K tile of the decode kernels
_CHUNK = tl.constexpr(CHUNK)


def chunked(scale: torch.Tensor) -> torch.Tensor:
    """Row-major scale bytes [E, R, G] -> the same bytes in chunked storage, seen as [E, R, G/8, 8] (a view of a
    contiguous [E, G/8, R, 8]). G must be a multiple of CHUNK."""
    e, r, g = scale.shape
    if g % CHUNK:
        raise ValueError(f"chunked scales need a multiple of {CHUNK} groups per row, got {g}")
    return scale.reshape(e, r, g // CHUNK, CHUNK).permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def chunked_empty(experts: int, rows: int, groups: int, device=None) -> torch.Tensor:
    """Uninitialized chunked storage [E, G/8, R, 8] uint8 (`as_rows` gives the [E, R, G/8, 8] view to fill)."""
    if groups % CHUNK:
        raise ValueError(f"chunked scales need a multiple of {CHUNK} groups per row, got {groups}")
    return torch.empty(experts, groups // CHUNK, rows, CHUNK, dtype=torch.uint8, device=device)


def as_rows(storage: torch.Tensor) -> torch.Tensor:
    """Chunked storage [E, G/8, R, 8] -> its [E, R, G/8, 8] view."""
    return storage.permute(0, 2, 1, 3)


def scale_layout(scale: torch.Tensor) -> tuple:
    """(expert stride, major stride, chunked) of scale bytes given as row-major [E, R, G] (unit stride over groups;
    major: the row stride) or as a chunked [E, R, G/8, 8] view (rows 8 bytes apart; major: the chunk stride). The
    kernels take `chunked` as a constexpr: the stride they know (8 within a chunk, 1 within a row) lets the compiler
    load one row's bytes of a K step as one vector."""
    if scale.dim() == 4 and scale.shape[3] == CHUNK and scale.stride(3) == 1 and scale.stride(1) == CHUNK:
        return scale.stride(0), scale.stride(2), True
    if scale.dim() == 3 and scale.stride(2) == 1:
        return scale.stride(0), scale.stride(1), False
    raise ValueError(f"MXFP4 scales must be [E, R, G] with unit stride over groups or chunked [E, R, G/{CHUNK}, "
                     f"{CHUNK}] (rows {CHUNK} bytes apart), got shape {tuple(scale.shape)} stride {scale.stride()}")


def scale_groups(scale: torch.Tensor) -> tuple:
    """(E, R, G) of scale bytes in either layout."""
    return tuple(scale.shape[:2]) + (scale.shape[2] * (scale.shape[3] if scale.dim() == 4 else 1),)


@triton.jit
def scale_offsets(rows, gi, stride_s, CHUNKED: tl.constexpr):
    """Offsets [N, G] of the scale bytes of rows `rows` [N] and groups `gi` [G] from the expert's first byte
    (stride_s: scale_layout's major stride)."""
    if CHUNKED:  # static branches, one return (Triton checks that returns agree in type)
        off = rows[:, None] * _CHUNK + ((gi // _CHUNK) * stride_s + gi % _CHUNK)[None, :]
    else:
        off = rows[:, None] * stride_s + gi[None, :]
    return off
