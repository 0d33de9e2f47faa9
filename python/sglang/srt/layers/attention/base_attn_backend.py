"""The attention-backend contract (DESIGN section 5).

A backend owns everything that touches the DeepSeek-V4 pools during a forward: window-KV stores, the
compressors' staging rings and compressed entries, indexer keys and top-k, and the sparse attention itself.
`init_forward_metadata` runs once per forward and prepares what every layer reads; the per-layer calls then
only index into it. The model supplies weights and math that does not depend on the cache layout. CUDA graphs need
no hooks here: a capacity-static batch (ForwardBatch.capacity_static) asks init_forward_metadata for metadata derived
on the device at fixed shapes, so the same call is captured and replayed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    name = "base"

    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Build forward_batch.attn_metadata for all layers of this forward."""

    @abstractmethod
    def forward(self, layer, q: torch.Tensor, kv: torch.Tensor, forward_batch: "ForwardBatch",
                topk_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Store the rows' window KV and attend: q [T, H, Dh], kv [T, Dh] -> o [T, H, Dh].

        Keys (= values) are the row's window plus, for HCA layers, every visible compressed entry, or, for
        CSA layers, the compressed slots `topk_slots` [T, K] chosen by the indexer (-1 = none). One softmax
        over their union, with the per-head sink logit `layer.attn_sink` only in the denominator.
        """

    @abstractmethod
    def forward_compressor(self, compressor, fresh: torch.Tensor, forward_batch: "ForwardBatch",
                           compute_dtype: torch.dtype) -> None:
        """Pool every window completed by this forward's rows into compressed entries, post-process them
        (the compressor's RMSNorm and RoPE; Hadamard for quantized index keys) and store them, then stash the rows
        later windows still need. fresh [T, 2, c*d] fp32: each row's content, then its gate with `ape` already
        added; compute_dtype: the model's dtype, which the post-processing rounds to."""

    @abstractmethod
    def forward_indexer(self, indexer, q: torch.Tensor, weights: torch.Tensor,
                        forward_batch: "ForwardBatch") -> torch.Tensor:
        """Lightning-indexer top-k: q [T, nI, dI] (RoPE applied), weights [T, nI] (scaled) ->
        physical compressed-entry slots [T, index_topk], -1 padded."""
