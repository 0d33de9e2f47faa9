"""TritonAttnBackend: the DeepSeek-V4 attention backend on sgl-kernel's Triton kernels (NVIDIA and AMD).

Same metadata and pools as the torch reference (it subclasses it); the per-layer work runs in fused kernels:
window-KV store (FP8 pack), sparse attention over window + compressed entries with the sink, the fused
compressor (pool + norm + RoPE [+ Hadamard] + quantize + store), and the lightning indexer's logits and top-k.
Prefill indexer logits are views of the pooled workspace, processed in row chunks (one call when they fit).
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.attention.dsv4.metadata import DSV4Metadata, RatioMetadata
from sglang.srt.layers.attention.dsv4.torch_backend import TorchAttnBackend
from sglang.srt.mem_cache.kv_formats import Fp4IndexKeyFormat, Fp8IndexKeyFormat, Fp8KVFormat


def _kv_rope_dim(fmt) -> int:
    """fp8_rope_dim argument of the kernels: >0 for the FP8 main-KV layout, 0 for a dense cache."""
    return fmt.dim - fmt.nope_dim if isinstance(fmt, Fp8KVFormat) else 0


def _index_kind(fmt) -> str:
    return "fp4" if isinstance(fmt, Fp4IndexKeyFormat) else "fp8" if isinstance(fmt, Fp8IndexKeyFormat) else "dense"


class TritonAttnBackend(TorchAttnBackend):
    name = "triton"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fp8_rope_dim = _kv_rope_dim(self.pool.kv_format)
        self.index_kind = _index_kind(self.pool.index_format)

    # ---- attention -----------------------------------------------------------------------------
    def forward(self, layer, q: torch.Tensor, kv: torch.Tensor, fb,
                topk_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        from sgl_kernel.dsv4_sparse_attention import dsv4_sparse_attention
        from sgl_kernel.dsv4_store_kv import dsv4_store_kv

        md: DSV4Metadata = fb.attn_metadata
        window = self.pool.window_kv[layer.layer_id]
        dsv4_store_kv(window, md.out_swa_loc, kv, fp8_rope_dim=self.fp8_rope_dim)
        extra = row_map = extra_len = None
        extra_slots = None
        if layer.ratio > 0:
            extra = self.pool.compressed_kv[layer.layer_id]
            if topk_slots is not None:  # CSA: the indexer's choice per row
                extra_slots = topk_slots
            else:  # HCA: each request's entry list, the row sees its first row_visible entries
                rm: RatioMetadata = md.ratios[layer.ratio]
                extra_slots, row_map, extra_len = rm.entry_slots, fb.row_req, rm.row_visible
        return dsv4_sparse_attention(q, window, md.window_slots, extra, extra_slots, row_map, extra_len,
                                     layer.attn_sink, layer.softmax_scale, fp8_rope_dim=self.fp8_rope_dim)

    # ---- compressor ----------------------------------------------------------------------------
    def forward_compressor(self, compressor, kv: torch.Tensor, gate: torch.Tensor, fb) -> None:
        from sgl_kernel.dsv4_compress import dsv4_compress, dsv4_update_ring

        plan = fb.attn_metadata.ratios[compressor.ratio].plan
        state = self.pool.compressor_state(compressor.layer_id, compressor.is_indexer)
        fresh = torch.stack((kv, gate), dim=1)
        if plan.num_new:
            if compressor.is_indexer:
                cache, fmt = self.pool.index_k[compressor.layer_id], {"dense": "dense", "fp8": "fp8_index",
                                                                      "fp4": "fp4_index"}[self.index_kind]
            else:
                cache, fmt = self.pool.compressed_kv[compressor.layer_id], "fp8_kv" if self.fp8_rope_dim else "dense"
            dsv4_compress(state.buf, fresh, plan.source_rows, ratio=plan.ratio, overlap=plan.overlap,
                          head_dim=compressor.head_dim, norm_weight=compressor.norm.weight, eps=compressor.norm.eps,
                          positions=plan.entry_positions, inv_freq=compressor.rotary.inv_freq,
                          rope_dim=compressor.rotary.rope_dim, out_cache=cache, out_slots=plan.entry_slots,
                          out_format=fmt, hadamard=compressor.is_indexer and self.pool.index_keys_rotated,
                          compute_dtype=compressor.wkv.weight.dtype)
        dsv4_update_ring(state.buf, plan.ring_dst, fresh, plan.ring_src)

    # ---- indexer -------------------------------------------------------------------------------
    def forward_indexer(self, indexer, q: torch.Tensor, weights: torch.Tensor, fb) -> torch.Tensor:
        from sgl_kernel.dsv4_index_logits import dsv4_index_logits
        from sgl_kernel.dsv4_topk import dsv4_topk_slots

        rm: RatioMetadata = fb.attn_metadata.ratios[indexer.ratio]
        num_rows, e_max = q.shape[0], rm.entry_slots.shape[1]
        if e_max == 0:
            return torch.full((num_rows, indexer.index_topk), -1, dtype=torch.int64, device=q.device)
        if self.pool.index_keys_rotated:
            q = indexer.rotate(q)
        keys = self.pool.index_k[indexer.layer_id]  # hoisted: every chunk reads the same cache
        if fb.forward_mode.is_decode():
            logits = torch.empty(num_rows, e_max, dtype=torch.float32, device=q.device)
            dsv4_index_logits(q, weights, keys, self.index_kind, rm.entry_slots, fb.row_req, rm.row_visible, logits)
            return dsv4_topk_slots(logits, rm.entry_slots, fb.row_req, indexer.index_topk)
        step = self.logits_workspace.logits_rows_per_chunk(e_max)
        if step >= num_rows:  # the common case: the whole batch in one pass, no slicing
            logits = self.logits_workspace.view(num_rows, e_max)
            dsv4_index_logits(q, weights, keys, self.index_kind, rm.entry_slots, fb.row_req, rm.row_visible, logits)
            return dsv4_topk_slots(logits, rm.entry_slots, fb.row_req, indexer.index_topk)
        out = torch.empty(num_rows, indexer.index_topk, dtype=torch.int64, device=q.device)
        for lo in range(0, num_rows, step):
            hi = min(lo + step, num_rows)
            logits = self.logits_workspace.view(hi - lo, e_max)
            dsv4_index_logits(q[lo:hi], weights[lo:hi], keys, self.index_kind, rm.entry_slots, fb.row_req[lo:hi],
                              rm.row_visible[lo:hi], logits)
            out[lo:hi] = dsv4_topk_slots(logits, rm.entry_slots, fb.row_req[lo:hi], indexer.index_topk)
        return out
