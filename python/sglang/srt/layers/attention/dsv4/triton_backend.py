"""TritonAttnBackend: the DeepSeek-V4 attention backend on sgl-kernel's Triton kernels (NVIDIA and AMD).

The shared backend (backend_base.py) running the fused kernels: window-KV store (FP8 pack), sparse attention over
window + compressed entries with the sink, the fused compressor (pool + norm + RoPE [+ Hadamard] + quantize +
store), and the lightning indexer's logits and top-k. Same metadata, pools and steps as the torch reference.
"""

from __future__ import annotations

import functools

from sglang.srt.layers.attention.dsv4.backend_base import DeepseekV4AttnBackendBase, DSV4AttnOps


@functools.lru_cache(maxsize=None)
def _kernel_ops() -> DSV4AttnOps:
    # Imported on first use: the kernels need Triton, which the rest of the engine does not.
    from sgl_kernel.dsv4_compress import dsv4_compress, dsv4_compress_staged, dsv4_update_ring
    from sgl_kernel.dsv4_index_logits import dsv4_index_logits
    from sgl_kernel.dsv4_sparse_attention import dsv4_sparse_attention
    from sgl_kernel.dsv4_store_kv import dsv4_store_kv
    from sgl_kernel.dsv4_topk import dsv4_topk_slots

    return DSV4AttnOps(store_kv=dsv4_store_kv, sparse_attention=dsv4_sparse_attention, compress=dsv4_compress,
                       update_ring=dsv4_update_ring, index_logits=dsv4_index_logits, topk_slots=dsv4_topk_slots,
                       compress_staged=dsv4_compress_staged)


class TritonAttnBackend(DeepseekV4AttnBackendBase):
    name = "triton"

    @staticmethod
    def load_ops() -> DSV4AttnOps:
        return _kernel_ops()
