"""Per-forward metadata of the DeepSeek-V4 attention, built once for all layers (DESIGN section 5).

Letters: T rows (packed tokens), B requests, W window, m compress ratio, N new compressed entries,
E_max most entries any request holds after this forward, S source rows of one entry (2m CSA, m HCA).

- Window: row t of request r sees positions max(0, t-W+1)..t; `window_slots` [T, W] are their window-pool
  slots (-1 for positions < 0).
- Compressed entries of ratio m: request b's entry w lives at `entry_slots[b, w]` (-1 past its entries);
  row t sees entries w < floor((t+1)/m) (`row_visible`).
- Compression plan of ratio m: the windows completed by this forward. Entry w pools source positions
  [(w-1)m, (w+1)m) (CSA: A halves of window w-1, B halves of window w) or [wm, (w+1)m) (HCA). A source row
  is an index into cat(staging ring rows, this forward's fresh rows); -1 = empty (before position 0).
  Fresh rows among the last `ring` positions of each request are then written back to the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

import torch
from sgl_kernel.dsv4_decode_metadata_ref import entry_slots_of, window_slots_ref

from sglang.srt.mem_cache.deepseek_v4_pool import ring_size


@dataclass
class CompressPlan:
    ratio: int
    overlap: bool
    ring: int  # ring rows per request
    num_new: int  # N (host int)
    entry_slots: torch.Tensor  # [N] compressed-pool slot of each new entry
    entry_positions: torch.Tensor  # [N] RoPE position w*m of each new entry
    source_rows: torch.Tensor  # [N, S] rows of cat(ring, fresh), -1 = empty
    ring_dst: torch.Tensor  # [R] ring rows written after pooling
    ring_src: torch.Tensor  # [R] fresh rows written there
    # CSA with the prefix cache on: fresh rows among the last m positions of a page, written to the request's
    # boundary rows (the staging state a prefix cached at that page's end needs; mem_cache/radix_cache.py); else None
    boundary_dst: Optional[torch.Tensor] = None
    boundary_src: Optional[torch.Tensor] = None


@dataclass
class RatioMetadata:
    ratio: int
    entry_slots: torch.Tensor  # [B, E_max]
    row_visible: torch.Tensor  # [T]
    plan: CompressPlan
    # [T] each row's slot in its window, positions % m: the row of the compressors' position bias `ape` (one kernel
    # per step and ratio here, not one per compressor); None where no compressor runs
    window_offset: Optional[torch.Tensor] = None


@dataclass
class DSV4Metadata:
    window_slots: torch.Tensor  # [T, W]
    out_swa_loc: torch.Tensor  # [T] window slot of each row's own token
    ratios: dict  # ratio -> RatioMetadata


def build_window_slots(forward_batch, window: int, full_to_swa: torch.Tensor) -> torch.Tensor:
    req = forward_batch.req_pool_indices[forward_batch.row_req]  # [T]
    return window_slots_ref(forward_batch.req_to_token_pool.req_to_token, full_to_swa, req, forward_batch.positions,
                            window)


def build_entry_slots(forward_batch, ratio: int, page_size: int) -> torch.Tensor:
    """[B, E_max] compressed-pool slot of entry w of each request (-1 past its floor(seq_len/m) entries)."""
    counts = [n // ratio for n in forward_batch.seq_lens_cpu]
    e_max = max(counts, default=0)
    device = forward_batch.positions.device
    w = torch.arange(e_max, device=device)
    # The first position w*m of each window addresses its page: entry w shares the page of that token.
    req_to_token = forward_batch.req_to_token_pool.req_to_token
    full = req_to_token[forward_batch.req_pool_indices[:, None], (w * ratio)[None, :]].to(torch.int64)
    slots = entry_slots_of(full, w[None, :], ratio, page_size)
    if all(c == e_max for c in counts):  # nothing to pad (host-known): the gathered slots as they are
        return slots
    valid = w[None, :] < torch.tensor(counts).to(device, non_blocking=True)[:, None]
    return torch.where(valid, slots, torch.full_like(slots, -1))


def build_compress_plan(forward_batch, ratio: int, overlap: bool, page_size: int, num_draft_tokens: int,
                        num_ring_rows: int, boundary: bool = False) -> CompressPlan:
    """Host-side planning over requests, vectorised over the batch (sizes are data-dependent and known on the host:
    no device reads); the index tensors go to the device without a synchronisation."""
    ring = ring_size(ratio, overlap, num_draft_tokens)
    span = 2 * ratio if overlap else ratio
    offsets = torch.arange(span) - (ratio if overlap else 0)
    s = torch.tensor(forward_batch.extend_prefix_lens_cpu, dtype=torch.int64)  # tokens before this forward
    e = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int64)  # rows of this forward
    r = torch.tensor(forward_batch.req_pool_indices_cpu, dtype=torch.int64)
    n = s + e
    row0 = torch.cumsum(e, 0) - e  # first row of each request in this forward
    # Windows completed by this forward: w in [s // m, n // m) per request, flattened in request order.
    first_w = torch.div(s, ratio, rounding_mode="floor")
    num_w = torch.div(n, ratio, rounding_mode="floor") - first_w
    b = torch.repeat_interleave(torch.arange(len(e)), num_w)
    w = first_w[b] + torch.arange(len(b)) - (torch.cumsum(num_w, 0) - num_w)[b]
    p = w[:, None] * ratio + offsets[None, :]  # [N, S] source positions
    from_ring = r[b, None] * ring + p % ring
    fresh = num_ring_rows + row0[b, None] + (p - s[b, None])
    source_rows = torch.where(p < 0, -1, torch.where(p >= s[b, None], fresh, from_ring))
    # Fresh rows among each request's last `ring` positions go back to the ring: positions [max(s, n - ring), n).
    keep_from = torch.maximum(s, n - ring)
    kb = torch.repeat_interleave(torch.arange(len(e)), n - keep_from)
    keep = keep_from[kb] + torch.arange(len(kb)) - (torch.cumsum(n - keep_from, 0) - (n - keep_from))[kb]
    device = forward_batch.positions.device
    # non_blocking from pageable host memory: staged at once, no stream synchronisation
    source_rows, w, b = (x.to(device, non_blocking=True) for x in (source_rows, w, b))
    req_to_token = forward_batch.req_to_token_pool.req_to_token
    first_full = req_to_token[forward_batch.req_pool_indices[b], w * ratio].to(torch.int64)
    entry_slots = entry_slots_of(first_full, w, ratio, page_size)
    boundary_dst = boundary_src = None
    if boundary:  # positions of [s, n) in the last m of a page: [P - m, P) and [P + page - m, n) for P = n // page
        last = torch.div(n, page_size, rounding_mode="floor") * page_size
        lo = torch.stack((torch.maximum(s, last - ratio), torch.maximum(s, last + page_size - ratio)), 1).flatten()
        hi = torch.stack((torch.minimum(n, last), n), 1).flatten()
        lens = (hi - lo).clamp(min=0)
        bb = torch.repeat_interleave(torch.arange(len(lens)), lens)
        pos = lo[bb] + torch.arange(len(bb)) - (torch.cumsum(lens, 0) - lens)[bb]
        req = torch.div(bb, 2, rounding_mode="floor")
        half = torch.div(pos, page_size, rounding_mode="floor") % 2  # page parity (mem_cache CompressorState)
        boundary_dst = ((r[req] * 2 + half) * ratio + pos % ratio).to(device, non_blocking=True)
        boundary_src = (row0[req] + pos - s[req]).to(device, non_blocking=True)
    return CompressPlan(ratio=ratio, overlap=overlap, ring=ring, num_new=int(source_rows.shape[0]),
                        entry_slots=entry_slots, entry_positions=w * ratio, source_rows=source_rows,
                        ring_dst=(r[kb] * ring + keep % ring).to(device, non_blocking=True),
                        ring_src=(row0[kb] + keep - s[kb]).to(device, non_blocking=True),
                        boundary_dst=boundary_dst, boundary_src=boundary_src)
