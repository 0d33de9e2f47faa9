"""The tensors a DeepSeek-V4 checkpoint must hold, by native name, with logical shapes and kinds.

Shapes follow docs/dsv4-architecture.md 8.2; a compressor has c = 2 output halves when overlapping
(CSA, ratio 4) and c = 1 otherwise (HCA). MTP blocks (`mtp.J.`) are sliding-window-only with a
score-routed MoE (`gate.bias`, no `tid2eid`, no compressor or indexer).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from sglang.srt.configs.deepseek_v4 import CSA_RATIO, DeepseekV4Config

PARTS = ("main", "mtp")


class TensorKind(str, Enum):
    LINEAR = "fp8-capable linear"  # F8_E4M3 + E8M0 `.scale` 128x128 blocks, or a plain float
    EXPERT = "routed expert"  # packed FP4 I8/U8 + `.scale` per 32, FP8 + block `.scale`, or a plain float
    FLOAT = "float"  # bf16 / f16 / f32, loaded in the model dtype
    FP32 = "fp32-kept"  # any float storage, always loaded as float32 (hc_*, attn_sink, ape, gate.bias)
    INDEX = "integer table"  # int64 / int32, loaded as int64 (tid2eid)

    @property
    def quantizable(self) -> bool:
        return self in (TensorKind.LINEAR, TensorKind.EXPERT)


@dataclass(frozen=True)
class TensorSpec:
    """Logical (dequantized) shape and storage kind of one native tensor."""

    shape: tuple
    kind: TensorKind

    def describe(self) -> str:
        return f"shape {list(self.shape)}, {self.kind.value}"


def _lin(*shape) -> TensorSpec:
    return TensorSpec(tuple(shape), TensorKind.LINEAR)


def _flt(*shape) -> TensorSpec:
    return TensorSpec(tuple(shape), TensorKind.FLOAT)


def _f32(*shape) -> TensorSpec:
    return TensorSpec(tuple(shape), TensorKind.FP32)


def _hc(cfg: DeepseekV4Config, prefix: str, which: str) -> dict:
    n_in = cfg.hc_mult * cfg.hidden_size
    return {f"{prefix}hc_{which}_fn": _f32(cfg.hc_mix_dim, n_in), f"{prefix}hc_{which}_base": _f32(cfg.hc_mix_dim),
            f"{prefix}hc_{which}_scale": _f32(3)}


def _compressor(cfg: DeepseekV4Config, prefix: str, d: int, ratio: int, csa: bool) -> dict:
    c = 2 if csa else 1  # CSA's overlapping windows carry two halves
    D = cfg.hidden_size
    return {f"{prefix}wkv.weight": _flt(c * d, D), f"{prefix}wgate.weight": _flt(c * d, D),
            f"{prefix}ape": _f32(ratio, c * d), f"{prefix}norm.weight": _flt(d)}


def _attention(cfg: DeepseekV4Config, p: str, ratio: int, csa: bool) -> dict:
    D, H, Dh, Rq = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, Ro = cfg.o_groups, cfg.o_lora_rank
    out = {
        f"{p}wq_a.weight": _lin(Rq, D), f"{p}q_norm.weight": _flt(Rq), f"{p}wq_b.weight": _lin(H * Dh, Rq),
        f"{p}wkv.weight": _lin(Dh, D), f"{p}kv_norm.weight": _flt(Dh),
        f"{p}wo_a.weight": _lin(G * Ro, H * Dh // G), f"{p}wo_b.weight": _lin(D, G * Ro),
        f"{p}attn_sink": _f32(H),
    }
    if ratio > 0:
        out.update(_compressor(cfg, f"{p}compressor.", Dh, ratio, csa))
    if csa:
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        out[f"{p}indexer.wq_b.weight"] = _lin(nI * dI, Rq)
        out[f"{p}indexer.weights_proj.weight"] = _flt(nI, D)
        out.update(_compressor(cfg, f"{p}indexer.compressor.", dI, CSA_RATIO, True))
    return out


def _moe(cfg: DeepseekV4Config, p: str, hash_routed: bool) -> dict:
    D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    out = {f"{p}gate.weight": _flt(E, D)}
    if hash_routed:
        out[f"{p}gate.tid2eid"] = TensorSpec((cfg.vocab_size, cfg.num_experts_per_tok), TensorKind.INDEX)
    else:
        out[f"{p}gate.bias"] = _f32(E)
    for e in range(E):
        for w, shape in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
            out[f"{p}experts.{e}.{w}.weight"] = TensorSpec(shape, TensorKind.EXPERT)
    out.update({f"{p}shared_experts.w1.weight": _lin(I, D), f"{p}shared_experts.w2.weight": _lin(D, I),
                f"{p}shared_experts.w3.weight": _lin(I, D)})
    return out


def _block(cfg: DeepseekV4Config, p: str, ratio: int, csa: bool, hash_routed: bool) -> dict:
    D = cfg.hidden_size
    out = {f"{p}attn_norm.weight": _flt(D), f"{p}ffn_norm.weight": _flt(D)}
    out.update(_hc(cfg, p, "attn"))
    out.update(_hc(cfg, p, "ffn"))
    out.update(_attention(cfg, f"{p}attn.", ratio, csa))
    out.update(_moe(cfg, f"{p}ffn.", hash_routed))
    return out


def _hc_head(cfg: DeepseekV4Config, p: str) -> dict:
    n = cfg.hc_mult
    return {f"{p}hc_head_fn": _f32(n, n * cfg.hidden_size), f"{p}hc_head_base": _f32(n), f"{p}hc_head_scale": _f32(1)}


def expected_tensors(config: DeepseekV4Config, part: str = "main") -> dict:
    """Native name -> `TensorSpec` for `part` "main" (everything but `mtp.*`) or "mtp" (`mtp.J.*`)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    cfg, D, V = config, config.hidden_size, config.vocab_size
    out: dict = {}
    if part == "main":
        out["embed.weight"] = _flt(V, D)
        for i in range(cfg.num_hidden_layers):
            out.update(_block(cfg, f"layers.{i}.", cfg.compress_ratio(i), cfg.is_csa(i), cfg.is_hash_layer(i)))
        out["norm.weight"] = _flt(D)
        out["head.weight"] = _flt(V, D)
        out.update(_hc_head(cfg, ""))
        return out
    for j in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{j}."
        out.update({f"{p}e_proj.weight": _lin(D, D), f"{p}h_proj.weight": _lin(D, D),
                    f"{p}enorm.weight": _flt(D), f"{p}hnorm.weight": _flt(D)})
        out.update(_block(cfg, p, 0, csa=False, hash_routed=False))
        out[f"{p}norm.weight"] = _flt(D)
        out.update(_hc_head(cfg, p))
    return out


def part_of(native_name: str) -> str:
    """Which part a native name belongs to."""
    return "mtp" if native_name.startswith("mtp.") else "main"
