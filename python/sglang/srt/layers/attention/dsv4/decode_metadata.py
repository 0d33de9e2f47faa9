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
The torch code is sgl_kernel's dsv4_decode_metadata_ref (the CPU path); on GPUs sgl_kernel's dsv4_decode_metadata
writes every tensor of all ratios in one launch (the reference took ~80 small launches for two ratios).
"""

from __future__ import annotations

from typing import Sequence

import torch
from sgl_kernel.dsv4_decode_metadata_ref import (  # noqa: F401  (DUMP_ENTRY_SLOT, static_seq_lens: re-exported)
    DUMP_ENTRY_SLOT, DecodeRatioMetadata, DecodeRatioSpec, decode_entry_slots_ref, decode_ratio_ref,
    dsv4_decode_metadata_ref, static_seq_lens)

from sglang.srt import platform as plat
from sglang.srt.layers.attention.dsv4.metadata import CompressPlan, DSV4Metadata, RatioMetadata
from sglang.srt.layers.gpu_kernels import sgl_kernel_op
from sglang.srt.mem_cache.deepseek_v4_pool import ring_size

decode_entry_slots = decode_entry_slots_ref  # [B, capacity] entry slots of each request (-1 past its entries)


def _fused_kernel():
    """sgl_kernel's one-launch decode metadata, or None where Triton / sgl_kernel is not installed."""
    return sgl_kernel_op("dsv4_decode_metadata", "dsv4_decode_metadata")


def ratio_spec(ratio: int, overlap: bool, num_draft_tokens: int, num_ring_rows: int,
               boundary: bool = False) -> DecodeRatioSpec:
    return DecodeRatioSpec(ratio=ratio, overlap=overlap, ring=ring_size(ratio, overlap, num_draft_tokens),
                           num_ring_rows=num_ring_rows, boundary=boundary)


def _plan(rm: DecodeRatioMetadata, spec: DecodeRatioSpec) -> CompressPlan:
    return CompressPlan(ratio=spec.ratio, overlap=spec.overlap, ring=spec.ring, num_new=rm.new_entry_slots.shape[0],
                        entry_slots=rm.new_entry_slots, entry_positions=rm.entry_positions,
                        source_rows=rm.source_rows, ring_dst=rm.ring_dst, ring_src=rm.ring_src,
                        boundary_dst=rm.boundary_dst, boundary_src=rm.boundary_src)


def decode_compress_plan(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, positions: torch.Tensor,
                         ratio: int, overlap: bool, page_size: int, num_draft_tokens: int,
                         num_ring_rows: int, boundary: bool = False) -> CompressPlan:
    """The plan of T = B * R rows (R per request, at consecutive positions), T candidate entries (see the module
    docstring), by the torch reference."""
    spec = ratio_spec(ratio, overlap, num_draft_tokens, num_ring_rows, boundary)
    num_rows, num_reqs = positions.shape[0], req_pool_indices.shape[0]
    if num_rows % num_reqs or num_rows // num_reqs > spec.ring:
        raise ValueError(f"{num_rows} static rows for {num_reqs} requests (ring of {spec.ring} rows)")
    return _plan(decode_ratio_ref(req_to_token, req_pool_indices, positions, spec, page_size), spec)


def build_decode_metadata(forward_batch, window: int, full_to_swa: torch.Tensor, page_size: int,
                          specs: Sequence[DecodeRatioSpec]) -> DSV4Metadata:
    """Every layer's metadata of a capacity-static batch from its static inputs: one sgl_kernel launch where the
    tensors are on a GPU, the torch reference elsewhere."""
    fb = forward_batch
    fused = _fused_kernel() if plat.is_device_tensor(fb.positions) else None
    md = (fused or dsv4_decode_metadata_ref)(fb.positions, fb.req_pool_indices, fb.out_cache_loc,
                                             fb.req_to_token_pool.req_to_token, full_to_swa, window, page_size, specs)
    ratios = {spec.ratio: RatioMetadata(ratio=spec.ratio, entry_slots=rm.entry_slots, row_visible=rm.row_visible,
                                        plan=_plan(rm, spec), window_offset=rm.window_offset)
              for spec, rm in zip(specs, md.ratios)}
    return DSV4Metadata(window_slots=md.window_slots, out_swa_loc=md.out_swa_loc, ratios=ratios)
