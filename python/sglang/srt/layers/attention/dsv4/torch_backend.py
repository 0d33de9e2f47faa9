"""TorchAttnBackend: the reference DeepSeek-V4 attention backend, in plain torch (CPU and GPU, no Triton needed).

It is the oracle for every faster backend: the shared backend (backend_base.py) running sgl_kernel's torch
references, the functions the Triton kernels are tested against. They gather keys by slot and compute in fp32,
query rows in blocks so memory stays bounded for long prefills.
"""

from __future__ import annotations

from sgl_kernel.dsv4_attention_ref import (
    dsv4_compress_ref, dsv4_compress_staged_ref, dsv4_index_logits_ref, dsv4_sparse_attention_ref, dsv4_store_kv_ref,
    dsv4_topk_slots_ref, dsv4_update_ring_ref)

from sglang.srt.layers.attention.dsv4.backend_base import DeepseekV4AttnBackendBase, DSV4AttnOps

REFERENCE_OPS = DSV4AttnOps(store_kv=dsv4_store_kv_ref, sparse_attention=dsv4_sparse_attention_ref,
                            compress=dsv4_compress_ref, update_ring=dsv4_update_ring_ref,
                            compress_staged=dsv4_compress_staged_ref,
                            index_logits=dsv4_index_logits_ref, topk_slots=dsv4_topk_slots_ref)


class TorchAttnBackend(DeepseekV4AttnBackendBase):
    name = "torch"

    @staticmethod
    def load_ops() -> DSV4AttnOps:
        return REFERENCE_OPS
