"""Torch reference of the decode attention metadata (no Triton, no engine imports): the engine's CPU path and what
dsv4_decode_metadata.py's one-launch kernel is tested against.

A capacity-static step (what a CUDA graph replays) has T = B * R rows, R per request, request-major, at consecutive
positions c_b .. c_b + R - 1. From the static inputs (positions [T], req_pool_indices [B], out_cache_loc [T]) and the
pools' page table req_to_token [P, L] (int32) and window map full_to_swa (int64) it derives, all int64:
- window_slots [T, W]: the window slots of positions p - W + 1 .. p (-1 before position 0), out_swa_loc [T];
- per compress ratio m (ring rows, staging rows per request; S = 2m source rows with overlap, else m):
  entry_slots [B, L // m] (-1 past floor(seq_len / m), seq_len = the request's last position + 1),
  row_visible [T] = (p + 1) // m, window_offset [T] = p % m, and the compression plan of T candidate entries: row t
  completes window w = (p + 1) / m - 1 when (p + 1) % m == 0; its sources are this forward's fresh rows from c_b on
  and staging-ring rows before (-1 before position 0); a row completing nothing pools its own fresh row into the
  dump entry (slot DUMP_ENTRY_SLOT). ring_dst = req * ring + p % ring; with `boundary`, boundary_dst: rows in the
  last m positions of a page go to the request's boundary rows (two halves by page parity), the rest to request
  0's. ring_src (and boundary_src) are the rows 0 .. T - 1.
Work per row is bounded by the window and the span S; the entry lists are sized by the page table's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

DUMP_ENTRY_SLOT = 0  # compressed / index-key slot written by rows that complete no entry (reserved page 0)


@dataclass(frozen=True)
class DecodeRatioSpec:
    """One compress ratio's constants: `ring` staging rows per request, `num_ring_rows` rows of the whole ring (the
    fresh rows follow them), `boundary`: the prefix cache's boundary rows are written (CSA, cache on)."""

    ratio: int
    overlap: bool
    ring: int
    num_ring_rows: int
    boundary: bool = False


@dataclass
class DecodeRatioMetadata:
    ratio: int
    entry_slots: torch.Tensor  # [B, L // m]
    row_visible: torch.Tensor  # [T]
    window_offset: torch.Tensor  # [T]
    new_entry_slots: torch.Tensor  # [T] the plan's compressed-pool slot per row (the dump slot if none completed)
    entry_positions: torch.Tensor  # [T] RoPE position w * m of each row's entry
    source_rows: torch.Tensor  # [T, S] rows of cat(ring, fresh), -1 = empty
    ring_dst: torch.Tensor  # [T]
    ring_src: torch.Tensor  # [T]
    boundary_dst: Optional[torch.Tensor] = None  # [T] with `boundary`
    boundary_src: Optional[torch.Tensor] = None


@dataclass
class DecodeMetadata:
    window_slots: torch.Tensor  # [T, W]
    out_swa_loc: torch.Tensor  # [T]
    ratios: list  # DecodeRatioMetadata per spec, in spec order


def check_decode_metadata_args(positions: torch.Tensor, req_pool_indices: torch.Tensor, out_cache_loc: torch.Tensor,
                               req_to_token: torch.Tensor, specs: Sequence[DecodeRatioSpec]) -> int:
    """Rows per request R (host shapes only); raises when the rows are not R per request or R exceeds a ring."""
    num_rows, num_reqs = positions.shape[0], req_pool_indices.shape[0]
    per_req = num_rows // max(num_reqs, 1)
    if num_reqs == 0 or per_req * num_reqs != num_rows or out_cache_loc.shape != positions.shape:
        raise ValueError(f"{num_rows} static rows ({tuple(out_cache_loc.shape)} out slots) for {num_reqs} requests")
    for spec in specs:
        if per_req > spec.ring:
            raise ValueError(f"{num_rows} static rows for {num_reqs} requests (ring of {spec.ring} rows)")
    if req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token must be a row-major 2-D table, got {tuple(req_to_token.shape)}")
    return per_req


def entry_slots_of(first_full: torch.Tensor, w: torch.Tensor, ratio: int, page_size: int) -> torch.Tensor:
    """Compressed-pool slot of entry w of ratio m, whose window starts at full slot `first_full` (the slot of token
    w*m): entry w shares that token's page, page_size / m entries per page (broadcasts)."""
    per_page = page_size // ratio
    return (first_full // page_size) * per_page + w % per_page


def window_slots_ref(req_to_token: torch.Tensor, full_to_swa: torch.Tensor, row_reqs: torch.Tensor,
                     positions: torch.Tensor, window: int) -> torch.Tensor:
    """[T, W] window slots of positions p - W + 1 .. p of each row's request slot `row_reqs` [T] (-1 before 0)."""
    pos = positions[:, None] - (window - 1) + torch.arange(window, device=positions.device)[None, :]
    full = req_to_token[row_reqs[:, None], pos.clamp(min=0)].to(torch.int64)  # [T, W]
    return torch.where(pos >= 0, full_to_swa[full], torch.full_like(full, -1))


def decode_entry_slots_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           ratio: int, page_size: int, capacity: int) -> torch.Tensor:
    """[B, capacity] compressed-pool slot of entry w of each request, -1 for w >= seq_len // ratio."""
    w = torch.arange(capacity, device=seq_lens.device)
    full = req_to_token[req_pool_indices[:, None], (w * ratio)[None, :]].to(torch.int64)
    slots = entry_slots_of(full, w[None, :], ratio, page_size)
    valid = w[None, :] < torch.div(seq_lens, ratio, rounding_mode="floor")[:, None]
    return torch.where(valid, slots, torch.full_like(slots, -1))


def static_seq_lens(positions: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """[B] tokens each request holds after the forward: its last row's position + 1."""
    return positions.view(num_reqs, -1)[:, -1] + 1


def decode_ratio_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, positions: torch.Tensor,
                     spec: DecodeRatioSpec, page_size: int) -> DecodeRatioMetadata:
    """One ratio's part of dsv4_decode_metadata_ref (see the module docstring)."""
    ratio, overlap, ring = spec.ratio, spec.overlap, spec.ring
    span = 2 * ratio if overlap else ratio
    device = positions.device
    num_rows, num_reqs = positions.shape[0], req_pool_indices.shape[0]
    per_req = num_rows // num_reqs
    offsets = torch.arange(span, device=device) - (ratio if overlap else 0)
    rows = torch.arange(num_rows, device=device)
    row_req = torch.div(rows, per_req, rounding_mode="floor")
    req = req_pool_indices[row_req]
    first_row = row_req * per_req
    first_pos = positions[first_row]  # c_b: the request's first row in this forward
    done = torch.remainder(positions + 1, ratio) == 0
    w = (torch.div(positions + 1, ratio, rounding_mode="floor") - 1).clamp(min=0)
    p = w[:, None] * ratio + offsets[None, :]  # [T, S] source positions of the entry row t completes
    fresh = spec.num_ring_rows + first_row[:, None] + (p - first_pos[:, None])
    from_ring = req[:, None] * ring + torch.remainder(p, ring)
    source = torch.where(p < 0, -1, torch.where(p >= first_pos[:, None], fresh, from_ring))
    own = (spec.num_ring_rows + rows)[:, None].expand_as(p)
    source = torch.where(done[:, None], source, own)  # nothing completed: pool the own fresh row into the dump entry
    first_full = req_to_token[req, w * ratio].to(torch.int64)
    new_slots = torch.where(done, entry_slots_of(first_full, w, ratio, page_size),
                            torch.full_like(first_full, DUMP_ENTRY_SLOT))
    boundary_dst = None
    if spec.boundary:  # rows in the last m positions of a page: the request's boundary rows; the rest: request 0's
        at_end = torch.remainder(positions, page_size) >= page_size - ratio
        half = torch.remainder(torch.div(positions, page_size, rounding_mode="floor"), 2)  # page parity
        boundary_dst = (torch.where(at_end, req, 0) * 2 + half) * ratio + torch.remainder(positions, ratio)
    entries = decode_entry_slots_ref(req_to_token, req_pool_indices, static_seq_lens(positions, num_reqs), ratio,
                                     page_size, capacity=req_to_token.shape[1] // ratio)
    return DecodeRatioMetadata(
        ratio=ratio, entry_slots=entries, row_visible=torch.div(positions + 1, ratio, rounding_mode="floor"),
        window_offset=torch.remainder(positions, ratio), new_entry_slots=new_slots, entry_positions=w * ratio,
        source_rows=source, ring_dst=req * ring + torch.remainder(positions, ring), ring_src=rows,
        boundary_dst=boundary_dst, boundary_src=rows if spec.boundary else None)


def dsv4_decode_metadata_ref(positions: torch.Tensor, req_pool_indices: torch.Tensor, out_cache_loc: torch.Tensor,
                             req_to_token: torch.Tensor, full_to_swa: torch.Tensor, window: int, page_size: int,
                             specs: Sequence[DecodeRatioSpec]) -> DecodeMetadata:
    """Every decode metadata tensor of a capacity-static step (module docstring)."""
    per_req = check_decode_metadata_args(positions, req_pool_indices, out_cache_loc, req_to_token, specs)
    row_req = torch.div(torch.arange(positions.shape[0], device=positions.device), per_req, rounding_mode="floor")
    window_slots = window_slots_ref(req_to_token, full_to_swa, req_pool_indices[row_req], positions, window)
    ratios = [decode_ratio_ref(req_to_token, req_pool_indices, positions, spec, page_size) for spec in specs]
    return DecodeMetadata(window_slots=window_slots, out_swa_loc=full_to_swa[out_cache_loc], ratios=ratios)


def write_slots_ref(req_to_token: torch.Tensor, full_to_swa: torch.Tensor, rows: torch.Tensor,
                    positions: torch.Tensor, full: torch.Tensor, swa: torch.Tensor) -> None:
    """req_to_token[rows, positions] = full and full_to_swa[full] = swa (in place)."""
    req_to_token[rows, positions] = full.to(torch.int32)
    full_to_swa[full] = swa
