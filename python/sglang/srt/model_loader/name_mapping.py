"""Tensor names: every accepted spelling -> the native (hub) name, and native -> HF `save_pretrained` name.

Accepted spellings (docs/dsv4-architecture.md 8.3):
  (a) native hub names: `embed.weight`, `layers.3.attn.wq_a.weight`, `layers.3.attn.wq_a.scale`, `mtp.0.e_proj.weight`;
  (b) what HF transformers' `save_pretrained` writes: native names under `model.` with a few reversed renames
      (`model.embed_tokens.weight`, `model.hc_head.hc_fn`, `model.layers.N.attn.norm.weight` = kv_norm, `head.weight`);
  (c) HF module (state_dict) names: `model.layers.N.self_attn.q_a_proj.weight`, `...weight_scale_inv`,
      `lm_head.weight`, and fused experts `mlp.experts.gate_up_proj` [E, 2I, D] / `mlp.experts.down_proj` [E, D, I].
Names that match no rule pass through unchanged; the loader rejects them if they are not in the spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import torch

# Top-level tensors: accepted spelling (after stripping `model.`) -> native name.
_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

# Inside `layers.N.` / `mtp.J.`: HF spelling -> native spelling. A `.weight_scale_inv` companion follows
# its `.weight` entry and becomes `.scale`. Native names are not in the table and pass through.
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "attn.norm.weight": "attn.kv_norm.weight",  # (b): save_pretrained reverses HF's `.norm.` -> `.kv_norm.`
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
# HF fused experts: one tensor per layer for all experts; expanded by `FusedExperts.parts`.
_FUSED = {"mlp.experts.gate_up_proj": "gate_up", "mlp.experts.down_proj": "down"}
_SCALE_INV = ".weight_scale_inv"

_BLOCK_RE = re.compile(r"^((?:layers|mtp)\.\d+)\.(.+)$")


@dataclass(frozen=True)
class FusedExperts:
    """An HF fused expert tensor: `gate_up` [E, 2I, D] (w1 rows, then w3 rows) or `down` [E, D, I]."""

    block: str  # e.g. "layers.3"
    which: str  # "gate_up" | "down"

    def parts(self, shape: tuple) -> list:
        """(native name, index into the fused tensor) for every expert slice it holds."""
        out = []
        for e in range(shape[0]):
            base = f"{self.block}.ffn.experts.{e}"
            if self.which == "down":
                out.append((f"{base}.w2.weight", (e,)))
            else:
                half = shape[1] // 2
                out.append((f"{base}.w1.weight", (e, slice(0, half))))
                out.append((f"{base}.w3.weight", (e, slice(half, 2 * half))))
        return out


def to_native(name: str) -> Union[str, FusedExperts]:
    """The native name of any accepted spelling, or a `FusedExperts` for an HF fused expert tensor."""
    stripped = name[len("model."):] if name.startswith("model.") else name
    if stripped in _TOP_LEVEL:
        return _TOP_LEVEL[stripped]
    m = _BLOCK_RE.match(stripped)
    if m is None:
        return stripped
    block, rest = m.groups()
    if rest in _FUSED:
        return FusedExperts(block, _FUSED[rest])
    if rest.endswith(_SCALE_INV):  # HF's FP8 scale spelling: rename as the weight, then swap the leaf
        weight = rest[: -len(_SCALE_INV)] + ".weight"
        return f"{block}.{_BLOCK.get(weight, weight)[: -len('weight')]}scale"
    return f"{block}.{_BLOCK.get(rest, rest)}"


def native_items(name: str, tensor: torch.Tensor) -> list:
    """[(native name, tensor)] for one stored tensor; fused HF experts expand to per-expert slices."""
    native = to_native(name)
    if isinstance(native, FusedExperts):
        return [(n, tensor[idx]) for n, idx in native.parts(tuple(tensor.shape))]
    return [(native, tensor)]


# ---- native -> HF save_pretrained names (form (b)) ----------------------------------------------
_HF_SAVED_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "head.weight",
                 "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
                 "hc_head_scale": "model.hc_head.hc_scale"}
_KV_NORM_RE = re.compile(r"^(layers\.\d+)\.attn\.kv_norm\.weight$")


def to_hf_saved(native: str) -> Optional[str]:
    """The name HF's `save_pretrained` writes for a native tensor; None for `mtp.*` (HF has no MTP)."""
    if native.startswith("mtp."):
        return None
    if native in _HF_SAVED_TOP:
        return _HF_SAVED_TOP[native]
    m = _KV_NORM_RE.match(native)
    if m:
        return f"model.{m.group(1)}.attn.norm.weight"
    return "model." + native
