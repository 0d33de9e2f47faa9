"""DeepseekV4AttnBackendBase: the DeepSeek-V4 attention backend, written once over a table of cache ops.

Both backends build the same metadata (metadata.py) and run the same per-layer steps on the same pools; they differ
only in `DSV4AttnOps`, the six functions that touch the cache rows: sgl_kernel's Triton kernels (TritonAttnBackend)
or their torch references of the same signatures (TorchAttnBackend, the oracle; the kernels are tested against the
same functions). Per layer: window-KV store and sparse attention over window + compressed entries with the sink
(`forward`), the compressor's pool + norm + RoPE [+ Hadamard] + quantize + store (`forward_compressor`), the
lightning indexer's logits and top-k (`forward_indexer`). Prefill indexer logits are views of one pooled workspace,
processed in row chunks (one call when they fit).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sglang.srt.configs.deepseek_v4 import CSA_RATIO
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.dsv4.decode_metadata import build_decode_metadata, ratio_spec
from sglang.srt.layers.attention.dsv4.logits_workspace import IndexerLogitsWorkspace, logits_budget_bytes
from sglang.srt.layers.attention.dsv4.metadata import (
    DSV4Metadata, RatioMetadata, build_compress_plan, build_entry_slots, build_window_slots)
from sglang.srt.model_executor.forward_batch_info import ForwardMode


@dataclass(frozen=True)
class DSV4AttnOps:
    """The cache ops of a backend; signatures of sgl_kernel's dsv4_store_kv, dsv4_sparse_attention, dsv4_compress,
    dsv4_update_ring, dsv4_index_logits, dsv4_topk_slots and dsv4_compress_staged (compress + ring updates)."""

    store_kv: Callable
    sparse_attention: Callable
    compress: Callable
    update_ring: Callable
    index_logits: Callable
    topk_slots: Callable
    compress_staged: Callable


class DeepseekV4AttnBackendBase(AttentionBackend):
    def __init__(self, config, pool, allocator, page_size: int, num_draft_tokens: int = 0,
                 logits_workspace: Optional[IndexerLogitsWorkspace] = None) -> None:
        """`logits_workspace`: the process's pooled indexer-logits block, to share it (default: a new one)."""
        self.config, self.pool, self.allocator = config, pool, allocator
        self.page_size = page_size
        self.num_draft_tokens = num_draft_tokens
        self.ops = self.load_ops()
        kv_format = pool.kv_format
        if kv_format.kernel_format == "fp8_kv" and kv_format.fp8_rope_dim <= 0:
            raise ValueError(f"kv_format {kv_format}: the fp8_kv kernels need a rope part (rope_dim > 0)")
        self.fp8_rope_dim = kv_format.fp8_rope_dim
        self.logits_workspace = logits_workspace or IndexerLogitsWorkspace(
            logits_budget_bytes(pool.index_format.kernel_format), pool.device)

    @staticmethod
    @abstractmethod
    def load_ops() -> DSV4AttnOps:
        """The backend's cache ops."""

    # ---- metadata ------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        """The metadata of every layer. A capacity-static batch (the CUDA-graph path: DECODE, a speculative verify and
        draft-extend) derives it on the device at fixed shapes (decode_metadata.py: one launch on GPUs); any other
        batch sizes it from the host lists (metadata.py)."""
        fb = forward_batch
        # the MTP layer attends to its window only: a draft forward needs no compressed-entry metadata
        needed = () if fb.forward_mode == ForwardMode.DRAFT_EXTEND else self.config.distinct_ratios
        specs = []
        for ratio in needed:
            state = self._any_state(ratio)
            # boundary: the prefix cache's boundary rows (CSA, cache on)
            specs.append(ratio_spec(ratio, ratio == CSA_RATIO, self.num_draft_tokens, state.buf.shape[0],
                                    boundary=state.boundary is not None))
        if fb.capacity_static:
            fb.attn_metadata = build_decode_metadata(fb, self.config.sliding_window, self.allocator.full_to_swa,
                                                     self.page_size, specs)
            return
        window_slots = build_window_slots(fb, self.config.sliding_window, self.allocator.full_to_swa)
        ratios = {}
        for spec in specs:
            plan = build_compress_plan(fb, spec.ratio, spec.overlap, self.page_size, self.num_draft_tokens,
                                       spec.num_ring_rows, spec.boundary)
            ratios[spec.ratio] = RatioMetadata(
                ratio=spec.ratio, entry_slots=build_entry_slots(fb, spec.ratio, self.page_size), plan=plan,
                row_visible=torch.div(fb.positions + 1, spec.ratio, rounding_mode="floor"),
                window_offset=torch.remainder(fb.positions, spec.ratio))
        out_swa_loc = self.allocator.full_to_swa[fb.out_cache_loc]
        fb.attn_metadata = DSV4Metadata(window_slots=window_slots, out_swa_loc=out_swa_loc, ratios=ratios)

    def _any_state(self, ratio: int):
        for state in self.pool.attn_state.values():
            if state.ratio == ratio:
                return state
        raise KeyError(f"no compressed layer with ratio {ratio}")

    # ---- attention -----------------------------------------------------------------------------
    def forward(self, layer, q: torch.Tensor, kv: torch.Tensor, forward_batch,
                topk_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        md: DSV4Metadata = forward_batch.attn_metadata
        window = self.pool.window_kv[layer.layer_id]
        self.ops.store_kv(window, md.out_swa_loc, kv, fp8_rope_dim=self.fp8_rope_dim)
        extra = extra_slots = row_map = extra_len = None
        if layer.ratio > 0:
            extra = self.pool.compressed_kv[layer.layer_id]
            if topk_slots is not None:  # CSA: the indexer's choice per row
                extra_slots = topk_slots
            else:  # HCA: each request's entry list, the row sees its first row_visible entries
                rm: RatioMetadata = md.ratios[layer.ratio]
                extra_slots, row_map, extra_len = rm.entry_slots, forward_batch.row_req, rm.row_visible
        return self.ops.sparse_attention(q, window, md.window_slots, extra, extra_slots, row_map, extra_len,
                                         layer.attn_sink, layer.softmax_scale, fp8_rope_dim=self.fp8_rope_dim)

    # ---- compressor ----------------------------------------------------------------------------
    def forward_compressor(self, compressor, fresh: torch.Tensor, forward_batch, compute_dtype: torch.dtype) -> None:
        plan = forward_batch.attn_metadata.ratios[compressor.ratio].plan
        state = self.pool.compressor_state(compressor.layer_id, compressor.is_indexer)
        if compressor.is_indexer:
            cache, fmt = self.pool.index_k[compressor.layer_id], self.pool.index_format
        else:
            cache, fmt = self.pool.compressed_kv[compressor.layer_id], self.pool.kv_format
        args = dict(ratio=plan.ratio, overlap=plan.overlap, head_dim=compressor.head_dim,
                    norm_weight=compressor.norm.weight, eps=compressor.norm.eps, positions=plan.entry_positions,
                    inv_freq=compressor.rotary.inv_freq, rope_dim=compressor.rotary.rope_dim, out_cache=cache,
                    out_slots=plan.entry_slots, out_format=fmt.kernel_format,
                    # quantized index keys are stored Hadamard-rotated (queries too, in forward_indexer)
                    hadamard=compressor.is_indexer and self.pool.index_keys_rotated, compute_dtype=compute_dtype)
        boundary = plan.boundary_dst is not None and plan.boundary_dst.numel() > 0
        if _ring_writes_unread(plan, forward_batch):  # one launch: pool, store, ring (and boundary) writes
            self.ops.compress_staged(state.buf, fresh, plan.source_rows, ring_dst=plan.ring_dst,
                                     ring_src=plan.ring_src, boundary=state.boundary if boundary else None,
                                     boundary_dst=plan.boundary_dst, boundary_src=plan.boundary_src, **args)
            return
        if plan.num_new:
            self.ops.compress(state.buf, fresh, plan.source_rows, **args)
        self.ops.update_ring(state.buf, plan.ring_dst, fresh, plan.ring_src)  # after the pool has read the ring
        if boundary:
            self.ops.update_ring(state.boundary, plan.boundary_dst, fresh, plan.boundary_src)

    # ---- indexer -------------------------------------------------------------------------------
    def forward_indexer(self, indexer, q: torch.Tensor, weights: torch.Tensor, forward_batch) -> torch.Tensor:
        rm: RatioMetadata = forward_batch.attn_metadata.ratios[indexer.ratio]
        row_req = forward_batch.row_req
        num_rows, e_max = q.shape[0], rm.entry_slots.shape[1]
        if e_max == 0:
            return torch.full((num_rows, indexer.index_topk), -1, dtype=torch.int64, device=q.device)
        if self.pool.index_keys_rotated:
            q = indexer.rotate(q)
        if forward_batch.capacity_static:  # a plain allocation (under CUDA graphs, in the graph pool)
            logits = torch.empty(num_rows, e_max, dtype=torch.float32, device=q.device)
            return self._select(indexer, q, weights, rm.entry_slots, row_req, rm.row_visible, logits)
        step = self.logits_workspace.logits_rows_per_chunk(e_max)
        if step >= num_rows:  # the common case: the whole batch in one pass, no slicing
            logits = self.logits_workspace.view(num_rows, e_max)
            return self._select(indexer, q, weights, rm.entry_slots, row_req, rm.row_visible, logits)
        out = torch.empty(num_rows, indexer.index_topk, dtype=torch.int64, device=q.device)
        for lo in range(0, num_rows, step):  # each chunk's top-k is done before the block is reused
            hi = min(lo + step, num_rows)
            out[lo:hi] = self._select(indexer, q[lo:hi], weights[lo:hi], rm.entry_slots, row_req[lo:hi],
                                      rm.row_visible[lo:hi], self.logits_workspace.view(hi - lo, e_max))
        return out

    def _select(self, indexer, q, weights, entry_slots, row_req, row_visible, logits) -> torch.Tensor:
        """Index logits of the rows into `logits`, then their top-k as physical slots. Both see only each row's
        visible entries: a decode graph's entry lists span the context capacity (262,144 CSA entries at 1M tokens),
        whose invisible rest is neither written nor read."""
        self.ops.index_logits(q, weights, self.pool.index_k[indexer.layer_id], self.pool.index_format.kernel_format,
                              entry_slots, row_req, row_visible, logits, fill_invisible=False)
        return self.ops.topk_slots(logits, entry_slots, row_req, indexer.index_topk, visible=row_visible)


def _ring_writes_unread(plan, forward_batch) -> bool:
    """Whether no staging-ring row this forward writes is one its pool reads, so both can run in one launch: a
    capacity-static forward (decode_metadata.py: R rows per request at consecutive positions c .. c+R-1) writes
    ring slots of positions [c, c+R) and reads, per request, positions [c+1-S, c) (S = 2m CSA, m HCA): distinct
    modulo the ring when ring >= S - 1 + R. Any other plan writes and reads in two launches, in that order."""
    if not forward_batch.capacity_static:
        return False
    rows_per_req = forward_batch.positions.shape[0] // max(1, forward_batch.req_pool_indices.shape[0])
    span = 2 * plan.ratio if plan.overlap else plan.ratio
    return plan.ring >= span - 1 + rows_per_req
