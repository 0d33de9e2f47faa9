"""Metadata with capacity-static shapes, derived on the device: what a CUDA graph replays (DESIGN section 5).

The general builders (metadata.py) size their tensors from host lists (entries per request, windows completed by
the step). A captured step cannot: its shapes are fixed at capture and it reads only device tensors, the static
inputs (positions, req_pool_indices, out_cache_loc) and the pools' page table and window map. Rows are R per request,
request-major, at consecutive positions c_b .. c_b + R - 1 (R = 1: DECODE and a draft step; R = k + 1: a speculative
verify and its draft-extend). Every shape depends on the row count T = B * R (B padded to a captured batch size) and
the context capacity:
- window slots [T, W] and each row's own window slot: as in the general path (already device-only);
- entry lists [B, E_cap], E_cap = context capacity // m, -1 past each request's floor(seq_len / m) entries;
- a compression plan of T candidate entries: row t (position p) completes window w = (p + 1) / m - 1 when
  (p + 1) % m == 0; its sources are this forward's fresh rows from c_b on and staging-ring rows before. A row that
  completes nothing pools its own fresh row into the dump entry (compressed slot 0, in the reserved page 0, never
  read), so the compress op runs unconditionally at a fixed size;
- every row writes its fresh (content, gate) row to the staging ring at r * ring + p % ring (R <= ring: distinct).
Padded rows use the reserved request slot 0 at position 0 with out slot 0: no window keys (page 0 maps to no window
slot), nothing stored (window slot -1), no entries, their ring rows are request 0's. The general plan and this one
agree on every real entry (test_static_decode.py checks it).
"""

from __future__ import annotations

import torch

from sglang.srt.layers.attention.dsv4.metadata import CompressPlan, entry_slots_of
from sglang.srt.mem_cache.deepseek_v4_pool import ring_size

DUMP_ENTRY_SLOT = 0  # compressed / index-key slot written by rows that complete no entry (reserved page 0)


def decode_entry_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
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


def decode_compress_plan(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, positions: torch.Tensor,
                         ratio: int, overlap: bool, page_size: int, num_draft_tokens: int,
                         num_ring_rows: int, boundary: bool = False) -> CompressPlan:
    """The plan of T = B * R rows (R per request, at consecutive positions), T candidate entries (see the module
    docstring)."""
    ring = ring_size(ratio, overlap, num_draft_tokens)
    span = 2 * ratio if overlap else ratio
    device = positions.device
    num_rows, num_reqs = positions.shape[0], req_pool_indices.shape[0]
    per_req = num_rows // num_reqs
    if per_req * num_reqs != num_rows or per_req > ring:
        raise ValueError(f"{num_rows} static rows for {num_reqs} requests (ring of {ring} rows)")
    offsets = torch.arange(span, device=device) - (ratio if overlap else 0)
    rows = torch.arange(num_rows, device=device)
    row_req = torch.div(rows, per_req, rounding_mode="floor")
    req = req_pool_indices[row_req]
    first_row = row_req * per_req
    first_pos = positions[first_row]  # c_b: the request's first row in this forward
    done = torch.remainder(positions + 1, ratio) == 0
    w = (torch.div(positions + 1, ratio, rounding_mode="floor") - 1).clamp(min=0)
    p = w[:, None] * ratio + offsets[None, :]  # [T, S] source positions of the entry row t completes
    fresh = num_ring_rows + first_row[:, None] + (p - first_pos[:, None])
    from_ring = req[:, None] * ring + torch.remainder(p, ring)
    source = torch.where(p < 0, -1, torch.where(p >= first_pos[:, None], fresh, from_ring))
    own = (num_ring_rows + rows)[:, None].expand_as(p)
    source = torch.where(done[:, None], source, own)  # nothing completed: pool the own fresh row into the dump entry
    first_full = req_to_token[req, w * ratio].to(torch.int64)
    entry_slots = torch.where(done, entry_slots_of(first_full, w, ratio, page_size),
                              torch.full_like(first_full, DUMP_ENTRY_SLOT))
    boundary_dst = None
    if boundary:  # rows in the last m positions of a page: the request's boundary rows; the rest: request 0's (dump)
        at_end = torch.remainder(positions, page_size) >= page_size - ratio
        half = torch.remainder(torch.div(positions, page_size, rounding_mode="floor"), 2)  # page parity
        boundary_dst = (torch.where(at_end, req, 0) * 2 + half) * ratio + torch.remainder(positions, ratio)
    return CompressPlan(ratio=ratio, overlap=overlap, ring=ring, num_new=num_rows,
                        entry_slots=entry_slots, entry_positions=w * ratio, source_rows=source,
                        ring_dst=req * ring + torch.remainder(positions, ring), ring_src=rows,
                        boundary_dst=boundary_dst, boundary_src=rows if boundary else None)
