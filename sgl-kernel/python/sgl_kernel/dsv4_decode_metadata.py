"""dsv4_decode_metadata: every attention-metadata tensor of a capacity-static decode step in one launch.

The same outputs as dsv4_decode_metadata_ref (its module docstring defines them): the window slots, each row's own
window slot, and per compress ratio the entry lists, visible counts, window offsets and compression plan. The torch
reference takes about 35 small launches per ratio plus a dozen for the window; under a CUDA graph each costs
~1.5-2 us even when it moves nothing.

Grid, one flat axis: programs 0 .. T - 1 are rows (the row's W window slots, its own window slot, and every ratio's
per-row values: the plan's S source rows computed, one page-table read for the entry slot); the programs after them
are (request, block of BLOCK_E entries) of each ratio's entry list, which read the page table only for the
request's floor(seq_len / m) entries and write -1 past them. Up to two ratios per launch (DeepSeek-V4 has CSA and
one HCA ratio); more ratios take more launches. All integer arithmetic, no atomics: deterministic, and equal to the
reference value for value.

dsv4_write_slots: the step's new rows into the page table and window map (req_to_token[rows, positions] = full,
full_to_swa[full] = swa), one launch instead of three.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_decode_metadata_ref import (
    DUMP_ENTRY_SLOT, DecodeMetadata, DecodeRatioMetadata, DecodeRatioSpec, check_decode_metadata_args,
    dsv4_decode_metadata_ref, write_slots_ref)

BLOCK_E = 1024  # entries per entry-list program
MAX_RATIOS = 2  # ratios one launch serves
_DUMP_C = tl.constexpr(DUMP_ENTRY_SLOT)


@triton.jit
def _ratio_row(t, p, req, first_row, first_pos, r2t_row, vis_ptr, woff_ptr, new_ptr, epos_ptr, src_ptr, ring_dst_ptr,
               bnd_ptr, ring, ring_rows, RATIO: tl.constexpr, OVERLAP: tl.constexpr, BOUNDARY: tl.constexpr,
               PAGE: tl.constexpr, BLOCK_S: tl.constexpr):
    """Row t's values of one ratio (int64 scalars p, req, first_row, first_pos; r2t_row: its page-table row)."""
    SPAN: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
    PER_PAGE: tl.constexpr = PAGE // RATIO
    tl.store(vis_ptr + t, (p + 1) // RATIO)
    tl.store(woff_ptr + t, p % RATIO)
    done = (p + 1) % RATIO == 0
    w = tl.maximum((p + 1) // RATIO - 1, 0)
    s = tl.arange(0, BLOCK_S)
    src_pos = w * RATIO + s - (RATIO if OVERLAP else 0)
    fresh = ring_rows + first_row + (src_pos - first_pos)
    from_ring = req * ring + src_pos % ring  # src_pos >= 0 wherever it is kept
    source = tl.where(src_pos < 0, -1, tl.where(src_pos >= first_pos, fresh, from_ring))
    source = tl.where(done, source, ring_rows + t)  # nothing completed: the own fresh row, into the dump entry
    tl.store(src_ptr + t * SPAN + s, source, mask=s < SPAN)
    first_full = tl.load(r2t_row + w * RATIO).to(tl.int64)
    slot = (first_full // PAGE) * PER_PAGE + w % PER_PAGE
    tl.store(new_ptr + t, tl.where(done, slot, _DUMP_C))
    tl.store(epos_ptr + t, w * RATIO)
    tl.store(ring_dst_ptr + t, req * ring + p % ring)
    if BOUNDARY:  # the last m positions of a page: the request's boundary rows (page parity halves), else request 0's
        at_end = p % PAGE >= PAGE - RATIO
        half = (p // PAGE) % 2
        tl.store(bnd_ptr + t, (tl.where(at_end, req, 0) * 2 + half) * RATIO + p % RATIO)


@triton.jit
def _entry_block(b, blk, pos_ptr, req_idx_ptr, r2t_ptr, stride_r2t, out_ptr, capacity, PER_REQ: tl.constexpr,
                 RATIO: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Entries blk * BLOCK .. of request b's list: slots below floor(seq_len / m), -1 from there to `capacity`."""
    PER_PAGE: tl.constexpr = PAGE // RATIO
    req = tl.load(req_idx_ptr + b).to(tl.int64)
    count = (tl.load(pos_ptr + b * PER_REQ + PER_REQ - 1).to(tl.int64) + 1) // RATIO
    e = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = e < count
    full = tl.load(r2t_ptr + req * stride_r2t + e * RATIO, mask=valid, other=0).to(tl.int64)
    slot = (full // PAGE) * PER_PAGE + e % PER_PAGE
    tl.store(out_ptr + b * capacity + e, tl.where(valid, slot, -1), mask=e < capacity)


@triton.jit
def _dsv4_decode_metadata_kernel(
        pos_ptr, req_idx_ptr, out_loc_ptr, r2t_ptr, stride_r2t, f2s_ptr, win_ptr, out_swa_ptr, rows_ptr, T,
        a_ent_ptr, a_vis_ptr, a_woff_ptr, a_new_ptr, a_epos_ptr, a_src_ptr, a_ring_dst_ptr, a_bnd_ptr, a_ring,
        a_ring_rows, a_cap, a_blocks,
        b_ent_ptr, b_vis_ptr, b_woff_ptr, b_new_ptr, b_epos_ptr, b_src_ptr, b_ring_dst_ptr, b_bnd_ptr, b_ring,
        b_ring_rows, b_cap, b_blocks,
        PER_REQ: tl.constexpr, PAGE: tl.constexpr, WINDOW: tl.constexpr, BLOCK_W: tl.constexpr, ROWS: tl.constexpr,
        RATIO_A: tl.constexpr, OVERLAP_A: tl.constexpr, BOUNDARY_A: tl.constexpr, BLOCK_SA: tl.constexpr,
        RATIO_B: tl.constexpr, OVERLAP_B: tl.constexpr, BOUNDARY_B: tl.constexpr, BLOCK_SB: tl.constexpr,
        BLOCK_ENT: tl.constexpr):
    """Programs 0 .. T - 1: rows; then ratio A's entry blocks (a_blocks per request), then ratio B's. ROWS: this
    launch writes the window part (the first launch of a step); RATIO_* = 0: no such ratio."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < T:
        t = pid
        p = tl.load(pos_ptr + t).to(tl.int64)
        first_row = (t // PER_REQ) * PER_REQ
        first_pos = tl.load(pos_ptr + first_row).to(tl.int64)
        req = tl.load(req_idx_ptr + t // PER_REQ).to(tl.int64)
        r2t_row = r2t_ptr + req * stride_r2t
        if ROWS:
            j = tl.arange(0, BLOCK_W)
            wp = p - (WINDOW - 1) + j
            ok = (j < WINDOW) & (wp >= 0)
            full = tl.load(r2t_row + tl.maximum(wp, 0), mask=ok, other=0).to(tl.int64)
            swa = tl.load(f2s_ptr + full, mask=ok, other=-1).to(tl.int64)
            tl.store(win_ptr + t * WINDOW + j, tl.where(ok, swa, -1), mask=j < WINDOW)
            tl.store(out_swa_ptr + t, tl.load(f2s_ptr + tl.load(out_loc_ptr + t).to(tl.int64)).to(tl.int64))
            tl.store(rows_ptr + t, t)
        if RATIO_A > 0:
            _ratio_row(t, p, req, first_row, first_pos, r2t_row, a_vis_ptr, a_woff_ptr, a_new_ptr, a_epos_ptr,
                       a_src_ptr, a_ring_dst_ptr, a_bnd_ptr, a_ring, a_ring_rows, RATIO_A, OVERLAP_A, BOUNDARY_A,
                       PAGE, BLOCK_SA)
        if RATIO_B > 0:
            _ratio_row(t, p, req, first_row, first_pos, r2t_row, b_vis_ptr, b_woff_ptr, b_new_ptr, b_epos_ptr,
                       b_src_ptr, b_ring_dst_ptr, b_bnd_ptr, b_ring, b_ring_rows, RATIO_B, OVERLAP_B, BOUNDARY_B,
                       PAGE, BLOCK_SB)
    else:
        q = pid - T
        num_reqs = T // PER_REQ
        if q < num_reqs * a_blocks:
            if RATIO_A > 0:
                _entry_block(q // a_blocks, q % a_blocks, pos_ptr, req_idx_ptr, r2t_ptr, stride_r2t, a_ent_ptr, a_cap,
                             PER_REQ, RATIO_A, PAGE, BLOCK_ENT)
        else:
            if RATIO_B > 0:
                q = q - num_reqs * a_blocks
                _entry_block(q // b_blocks, q % b_blocks, pos_ptr, req_idx_ptr, r2t_ptr, stride_r2t, b_ent_ptr,
                             b_cap, PER_REQ, RATIO_B, PAGE, BLOCK_ENT)


def _ratio_outputs(spec: DecodeRatioSpec, num_rows: int, num_reqs: int, capacity: int, rows: torch.Tensor,
                   device) -> DecodeRatioMetadata:
    span = 2 * spec.ratio if spec.overlap else spec.ratio
    new = lambda *shape: torch.empty(*shape, dtype=torch.int64, device=device)  # noqa: E731
    return DecodeRatioMetadata(
        ratio=spec.ratio, entry_slots=new(num_reqs, capacity), row_visible=new(num_rows), window_offset=new(num_rows),
        new_entry_slots=new(num_rows), entry_positions=new(num_rows), source_rows=new(num_rows, span),
        ring_dst=new(num_rows), ring_src=rows, boundary_dst=new(num_rows) if spec.boundary else None,
        boundary_src=rows if spec.boundary else None)


def _ratio_args(out, spec, placeholder: torch.Tensor) -> tuple:
    """A ratio's kernel arguments and constexprs (ratio 0, any live tensor as never-read pointers, where absent)."""
    if out is None:
        return (placeholder,) * 8 + (0, 0, 0, 0), (0, False, False, 1)
    capacity = out.entry_slots.shape[1]
    bnd = out.boundary_dst if out.boundary_dst is not None else out.ring_dst
    ptrs = (out.entry_slots, out.row_visible, out.window_offset, out.new_entry_slots, out.entry_positions,
            out.source_rows, out.ring_dst, bnd)
    return ptrs + (spec.ring, spec.num_ring_rows, capacity, triton.cdiv(capacity, BLOCK_E)), (
        spec.ratio, spec.overlap, spec.boundary, triton.next_power_of_2(out.source_rows.shape[1]))


def dsv4_decode_metadata(positions: torch.Tensor, req_pool_indices: torch.Tensor, out_cache_loc: torch.Tensor,
                         req_to_token: torch.Tensor, full_to_swa: torch.Tensor, window: int, page_size: int,
                         specs: Sequence[DecodeRatioSpec]) -> DecodeMetadata:
    """dsv4_decode_metadata_ref in ceil(len(specs) / 2) launches (one for DeepSeek-V4; one for the window alone when
    `specs` is empty). No host reads: graph-capturable."""
    per_req = check_decode_metadata_args(positions, req_pool_indices, out_cache_loc, req_to_token, specs)
    positions, req_pool_indices, out_cache_loc = (x.contiguous() for x in (positions, req_pool_indices, out_cache_loc))
    num_rows, num_reqs = positions.shape[0], req_pool_indices.shape[0]
    device = positions.device
    rows = torch.empty(num_rows, dtype=torch.int64, device=device)
    window_slots = torch.empty(num_rows, window, dtype=torch.int64, device=device)
    out_swa_loc = torch.empty(num_rows, dtype=torch.int64, device=device)
    outs = [_ratio_outputs(s, num_rows, num_reqs, req_to_token.shape[1] // s.ratio, rows, device) for s in specs]
    for n in range(max(1, triton.cdiv(len(specs), MAX_RATIOS))):
        pair = [(outs[i], specs[i]) for i in range(n * MAX_RATIOS, min((n + 1) * MAX_RATIOS, len(specs)))]
        (a_args, a_const), (b_args, b_const) = (_ratio_args(*x, rows) for x in (pair + [(None, None)] * 2)[:2])
        grid = (num_rows + num_reqs * (a_args[-1] + b_args[-1]),)
        _dsv4_decode_metadata_kernel[grid](
            positions, req_pool_indices, out_cache_loc, req_to_token, req_to_token.stride(0), full_to_swa,
            window_slots, out_swa_loc, rows, num_rows, *a_args, *b_args,
            PER_REQ=per_req, PAGE=page_size, WINDOW=window, BLOCK_W=triton.next_power_of_2(window), ROWS=n == 0,
            RATIO_A=a_const[0], OVERLAP_A=a_const[1], BOUNDARY_A=a_const[2], BLOCK_SA=a_const[3],
            RATIO_B=b_const[0], OVERLAP_B=b_const[1], BOUNDARY_B=b_const[2], BLOCK_SB=b_const[3],
            BLOCK_ENT=BLOCK_E, num_warps=4)
    return DecodeMetadata(window_slots=window_slots, out_swa_loc=out_swa_loc, ratios=outs)


@triton.jit
def _dsv4_write_slots_kernel(r2t_ptr, stride_r2t, f2s_ptr, rows_ptr, pos_ptr, full_ptr, swa_ptr, N,
                             BLOCK: tl.constexpr):
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    row = tl.load(rows_ptr + n, mask=ok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + n, mask=ok, other=0).to(tl.int64)
    full = tl.load(full_ptr + n, mask=ok, other=0).to(tl.int64)
    tl.store(r2t_ptr + row * stride_r2t + pos, full.to(tl.int32), mask=ok)
    tl.store(f2s_ptr + full, tl.load(swa_ptr + n, mask=ok, other=-1).to(tl.int64), mask=ok)


def dsv4_write_slots(req_to_token: torch.Tensor, full_to_swa: torch.Tensor, rows: torch.Tensor,
                     positions: torch.Tensor, full: torch.Tensor, swa: torch.Tensor) -> None:
    """write_slots_ref in one launch. Rows writing one place must write one value (the padded rows do: request 0,
    position 0, full slot 0, window slot -1), so the order of the writes never matters."""
    if req_to_token.stride(1) != 1 or req_to_token.dtype != torch.int32 or full_to_swa.dtype != torch.int64:
        raise ValueError("req_to_token: row-major int32; full_to_swa: int64")
    num = rows.shape[0]
    if num == 0:
        return
    rows, positions, full, swa = (x.contiguous() for x in (rows, positions, full, swa))
    block = min(1024, triton.next_power_of_2(num))
    _dsv4_write_slots_kernel[(triton.cdiv(num, block),)](req_to_token, req_to_token.stride(0), full_to_swa, rows,
                                                         positions, full, swa, num, BLOCK=block)


__all__ = ["dsv4_decode_metadata", "dsv4_decode_metadata_ref", "dsv4_write_slots", "write_slots_ref"]
