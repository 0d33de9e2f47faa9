"""DeepseekV4Config: one object for the native hub `config.json` and the form HF transformers writes.

Native (hub) keys: `compress_ratios` (per layer, MTP entries trailing), `num_hash_layers`, `qk_rope_head_dim`,
`rope_theta` + `compress_rope_theta` + `rope_scaling` (YaRN, compressed layers only), `quantization_config`,
`expert_dtype`, `num_nextn_predict_layers`.
HF keys: `layer_types` + `compress_rates`, `mlp_layer_types`, `rope_parameters` ({"main", "compress"} or a flat
YaRN dict), `partial_rotary_factor`.

Every field the model needs is required: a missing or inconsistent one raises `ConfigError` naming it.
See docs/dsv4-architecture.md section 2 for the meaning of each field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
CSA_RATIO = 4  # the compression ratio of CSA layers (overlapping windows, lightning indexer); HCA uses any other
MLP_TYPES = ("hash_moe", "moe")


class ConfigError(ValueError):
    """A config.json field is missing, mistyped or inconsistent; the message names the field."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation (no attention-magnitude factor: arch section 5.3)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` of the hub checkpoint: FP8 e4m3 with ue8m0 block scales."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    scale_fmt: str = "ue8m0"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple = (128, 128)


@dataclass
class DeepseekV4Config:
    """DeepSeek-V4 hyper-parameters (names follow the hub config.json; letters as in the architecture doc).

    Shapes: hidden_size D, num_attention_heads H, head_dim Dh (K = V, one shared head),
    qk_rope_head_dim Dr (trailing rotary dims), q_lora_rank Rq, o_groups G, o_lora_rank Ro,
    sliding_window W, index_n_heads/index_head_dim/index_topk (nI, dI, kI),
    n_routed_experts E, num_experts_per_tok k, moe_intermediate_size I, hc_mult n_hc.
    Per-layer: `layer_types[i]` in LAYER_TYPES and `compress_ratios[i]` (0 for sliding; entries past
    `num_hidden_layers` belong to the MTP modules), `mlp_layer_types[i]` in MLP_TYPES.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: list
    compress_ratios: list  # main layers then MTP layers (always 0 = sliding for MTP)
    mlp_layer_types: list
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: Optional[YarnScaling]
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_nextn_predict_layers: int
    num_key_value_heads: int = 1
    topk_method: str = "noaux_tc"
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: Any = 1
    torch_dtype: str = "bfloat16"
    expert_dtype: Optional[str] = None
    quantization_config: Optional[QuantConfig] = None
    architectures: list = field(default_factory=lambda: ["DeepseekV4ForCausalLM"])

    def __post_init__(self) -> None:
        self._validate()

    # ---- derived dims -------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_mix_dim(self) -> int:
        """Rows of hc_*_fn: pre (n_hc) + post (n_hc) + comb (n_hc^2)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def num_hash_layers(self) -> int:
        return sum(1 for t in self.mlp_layer_types if t == "hash_moe")

    @property
    def eos_token_ids(self) -> list:
        ids = self.eos_token_id
        return [ids] if isinstance(ids, int) else list(ids or [])

    def compress_ratio(self, layer_id: int) -> int:
        """0 for sliding-only layers and MTP layers; 4 (CSA) or the HCA ratio otherwise."""
        return self.compress_ratios[layer_id]

    def is_csa(self, layer_id: int) -> bool:
        """Compressed sparse attention: ratio-4 overlapping compressor plus the lightning indexer."""
        return layer_id < self.num_hidden_layers and self.layer_types[layer_id] == CSA

    def is_hca(self, layer_id: int) -> bool:
        """Heavily compressed attention: non-overlapping windows, every visible entry attended (no indexer)."""
        return layer_id < self.num_hidden_layers and self.layer_types[layer_id] == HCA

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hidden_layers and self.mlp_layer_types[layer_id] == "hash_moe"

    @property
    def csa_layers(self) -> list:
        return [i for i in range(self.num_hidden_layers) if self.is_csa(i)]

    @property
    def hca_layers(self) -> list:
        return [i for i in range(self.num_hidden_layers) if self.is_hca(i)]

    @property
    def distinct_ratios(self) -> list:
        return sorted({r for r in self.compress_ratios if r > 0})

    # ---- validation ---------------------------------------------------------------------------
    def _validate(self) -> None:
        n = self.num_hidden_layers
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                    "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
                    "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")
        if self.num_key_value_heads != 1:
            raise ConfigError("config field 'num_key_value_heads' must be 1 (shared K=V head), "
                              f"got {self.num_key_value_heads}")
        if not (0 < self.qk_rope_head_dim <= self.head_dim) or self.qk_rope_head_dim % 2:
            raise ConfigError(f"config field 'qk_rope_head_dim' must be even and in (0, head_dim={self.head_dim}], "
                              f"got {self.qk_rope_head_dim}")
        if not (0 < self.qk_rope_head_dim <= self.index_head_dim):
            raise ConfigError(f"config field 'index_head_dim' ({self.index_head_dim}) must hold the "
                              f"{self.qk_rope_head_dim} rotary dims")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"config field 'o_groups' ({self.o_groups}) must divide num_attention_heads "
                              f"({self.num_attention_heads})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"config field 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds "
                              f"n_routed_experts ({self.n_routed_experts})")
        if self.n_shared_experts != 1:
            raise ConfigError(f"config field 'n_shared_experts' must be 1, got {self.n_shared_experts}")
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"config field 'scoring_func' must be 'sqrtsoftplus', got {self.scoring_func!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"config field 'hidden_act' must be 'silu', got {self.hidden_act!r}")
        if len(self.layer_types) != n:
            raise ConfigError(f"config field 'layer_types' has {len(self.layer_types)} entries, "
                              f"expected num_hidden_layers={n}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"config field 'layer_types' has unknown entries {bad}; allowed {LAYER_TYPES}")
        if len(self.mlp_layer_types) != n:
            raise ConfigError(f"config field 'mlp_layer_types' has {len(self.mlp_layer_types)} entries, "
                              f"expected num_hidden_layers={n}")
        bad = [t for t in self.mlp_layer_types if t not in MLP_TYPES]
        if bad:
            raise ConfigError(f"config field 'mlp_layer_types' has unknown entries {bad}; allowed {MLP_TYPES}")
        n_hash = self.num_hash_layers
        if self.mlp_layer_types != ["hash_moe"] * n_hash + ["moe"] * (n - n_hash):
            raise ConfigError(f"config field 'mlp_layer_types' must be hash_moe layers first, then moe "
                              f"(num_hash_layers), got {self.mlp_layer_types}")
        if len(self.compress_ratios) != n + self.num_nextn_predict_layers:
            raise ConfigError(f"config field 'compress_ratios' has {len(self.compress_ratios)} entries, expected "
                              f"num_hidden_layers + num_nextn_predict_layers = {n + self.num_nextn_predict_layers}")
        for i, (t, r) in enumerate(zip(self.layer_types, self.compress_ratios)):
            if (t == SLIDING and r != 0) or (t == CSA and r != CSA_RATIO) or (t == HCA and (r <= 0 or r == CSA_RATIO)):
                raise ConfigError(f"config field 'compress_ratios' entry {i} ({r}) does not match layer type {t!r}")
        for i in range(n, len(self.compress_ratios)):
            if self.compress_ratios[i] != 0:
                raise ConfigError(f"config field 'compress_ratios' entry {i} belongs to an MTP layer and must be 0, "
                                  f"got {self.compress_ratios[i]}")
        if self.rope_scaling is not None and self.rope_scaling.factor <= 0:
            raise ConfigError(f"config field 'rope_scaling.factor' must be positive, got {self.rope_scaling.factor}")

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "DeepseekV4Config":
        return _parse(dict(raw))

    @classmethod
    def from_json_file(cls, path: str) -> "DeepseekV4Config":
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config.json not found at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config.json at {path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "DeepseekV4Config":
        return cls.from_json_file(os.path.join(model_dir, "config.json"))

    def to_native_dict(self) -> dict:
        """The hub (native) form of this config, as written by scripts/make_tiny_checkpoint.py."""
        out = {
            "architectures": list(self.architectures), "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank, "sliding_window": self.sliding_window,
            "compress_ratios": list(self.compress_ratios), "compress_rope_theta": self.compress_rope_theta,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size, "scoring_func": self.scoring_func,
            "topk_method": self.topk_method, "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor, "num_hash_layers": self.num_hash_layers,
            "swiglu_limit": self.swiglu_limit, "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps, "rms_norm_eps": self.rms_norm_eps,
            "num_nextn_predict_layers": self.num_nextn_predict_layers, "hidden_act": self.hidden_act,
            "attention_bias": False, "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "torch_dtype": self.torch_dtype,
        }
        if self.rope_scaling is not None:
            s = self.rope_scaling
            out["rope_scaling"] = {"type": "yarn", "factor": s.factor,
                                   "original_max_position_embeddings": s.original_max_position_embeddings,
                                   "beta_fast": s.beta_fast, "beta_slow": s.beta_slow}
        if self.expert_dtype is not None:
            out["expert_dtype"] = self.expert_dtype
        if self.quantization_config is not None:
            q = self.quantization_config
            out["quantization_config"] = {"activation_scheme": q.activation_scheme, "fmt": q.fmt,
                                          "quant_method": q.quant_method, "scale_fmt": q.scale_fmt,
                                          "weight_block_size": list(q.weight_block_size)}
        return out


# ---------------------------------------------------------------------------------------------
# Parsing: native and HF forms into one set of fields.
# ---------------------------------------------------------------------------------------------
_MISSING = object()


def _req(raw: dict, name: str, kind=int):
    value = raw.get(name, _MISSING)
    if value is _MISSING or value is None:
        raise ConfigError(f"config field '{name}' is missing")
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"config field '{name}' must be {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _opt(raw: dict, name: str, default, kind=None):
    if raw.get(name) is None:
        return default
    return _req(raw, name, kind or type(default))


def _parse_yarn(d: dict, where: str) -> Optional[YarnScaling]:
    if not isinstance(d, dict):
        raise ConfigError(f"config field '{where}' must be an object, got {d!r}")
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "yarn":
        raise ConfigError(f"config field '{where}.type' must be 'yarn' or 'default', got {rope_type!r}")
    if d.get("attention_factor", 1.0) != 1.0:
        raise ConfigError(f"config field '{where}.attention_factor' must be 1.0 (DeepSeek-V4 uses no YaRN mscale)")
    try:
        return YarnScaling(factor=float(d["factor"]),
                           original_max_position_embeddings=int(d["original_max_position_embeddings"]),
                           beta_fast=float(d.get("beta_fast", 32)), beta_slow=float(d.get("beta_slow", 1)))
    except KeyError as e:
        raise ConfigError(f"config field '{where}.{e.args[0]}' is missing") from None


def _parse_rope(raw: dict) -> tuple:
    """Returns (rope_theta, compress_rope_theta, yarn) from native or HF keys."""
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise ConfigError("config field 'rope_parameters.main.rope_type' must be 'default' (no YaRN on "
                              "sliding-window layers)")
        theta = _req(main, "rope_theta", float) if "rope_theta" in main else _req(raw, "rope_theta", float)
        ctheta = _req(comp, "rope_theta", float) if "rope_theta" in comp else _req(raw, "compress_rope_theta", float)
        return theta, ctheta, _parse_yarn(comp, "rope_parameters.compress")
    theta = _req(raw, "rope_theta", float)
    ctheta = _req(raw, "compress_rope_theta", float)
    if isinstance(rp, dict):
        return theta, ctheta, _parse_yarn(rp, "rope_parameters")
    scaling = raw.get("rope_scaling")
    return theta, ctheta, (None if scaling is None else _parse_yarn(scaling, "rope_scaling"))


def _parse_layers(raw: dict, n: int, n_mtp: int) -> tuple:
    """Returns (layer_types, compress_ratios incl. MTP entries, mlp_layer_types)."""
    if raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
            raise ConfigError(f"config field 'compress_ratios' must be a list of integers, got {ratios!r}")
        if len(ratios) < n:
            raise ConfigError(f"config field 'compress_ratios' has {len(ratios)} entries, expected at least "
                              f"num_hidden_layers={n}")
        # Official rule: ratio 4 = overlapping compressor + indexer (CSA); any other non-zero ratio = HCA.
        types = [SLIDING if r == 0 else CSA if r == CSA_RATIO else HCA for r in ratios[:n]]
        ratios = list(ratios) + [0] * max(0, n + n_mtp - len(ratios))
        ratios = ratios[: n + n_mtp]
    elif raw.get("layer_types") is not None:
        types = raw["layer_types"]
        if not isinstance(types, list):
            raise ConfigError(f"config field 'layer_types' must be a list, got {types!r}")
        types = list(types[:n]) if len(types) >= n else list(types)
        rates = raw.get("compress_rates") or {CSA: CSA_RATIO, HCA: 128}
        if not isinstance(rates, dict):
            raise ConfigError(f"config field 'compress_rates' must be an object, got {rates!r}")
        ratios = []
        for t in types:
            if t == SLIDING:
                ratios.append(0)
            elif t in (CSA, HCA):
                if t not in rates or not isinstance(rates[t], int) or rates[t] <= 0:
                    raise ConfigError(f"config field 'compress_rates.{t}' is missing or not a positive integer")
                ratios.append(rates[t])
            else:
                ratios.append(-1)  # rejected by validation with the field named
        if rates.get(CSA, CSA_RATIO) != CSA_RATIO:
            raise ConfigError(f"config field 'compress_rates.{CSA}' must be {CSA_RATIO}, got {rates.get(CSA)}")
        ratios += [0] * n_mtp
    else:
        raise ConfigError("config field 'compress_ratios' (native) or 'layer_types' (HF) is missing")

    if raw.get("compress_ratios") is not None and raw.get("layer_types") is not None:
        hf_types, _, _ = _parse_layers({k: v for k, v in raw.items() if k != "compress_ratios"}, n, n_mtp)
        if hf_types != types:
            raise ConfigError(f"config fields 'compress_ratios' and 'layer_types' disagree: {types} vs {hf_types}")
    if raw.get("mlp_layer_types") is not None:
        mlp = raw["mlp_layer_types"]
        if not isinstance(mlp, list):
            raise ConfigError(f"config field 'mlp_layer_types' must be a list, got {mlp!r}")
        mlp = list(mlp[:n]) if len(mlp) >= n else list(mlp)  # HF keeps the first num_hidden_layers
    else:
        n_hash = _req(raw, "num_hash_layers", int)
        if not 0 <= n_hash <= n:
            raise ConfigError(f"config field 'num_hash_layers' must be in [0, {n}], got {n_hash}")
        mlp = ["hash_moe"] * n_hash + ["moe"] * (n - n_hash)
    return types, ratios, mlp


def _parse_rope_dim(raw: dict, head_dim: int) -> int:
    if raw.get("qk_rope_head_dim") is not None:
        return _req(raw, "qk_rope_head_dim", int)
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        raise ConfigError("config field 'qk_rope_head_dim' (or HF 'partial_rotary_factor') is missing")
    # HF derives int(head_dim * factor); round to dodge JSON-rounded factors (0.3333333333 * 96 = 31.99...).
    return int(round(head_dim * float(factor)))


def _parse_quant(raw: dict) -> Optional[QuantConfig]:
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"config field 'quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"config field 'quantization_config.quant_method' must be 'fp8', got {method!r}")
    block = tuple(q.get("weight_block_size") or (128, 128))
    if len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise ConfigError(f"config field 'quantization_config.weight_block_size' must be two positive ints, "
                          f"got {q.get('weight_block_size')!r}")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"config field 'quantization_config.fmt' must be 'e4m3', got {fmt!r}")
    return QuantConfig(quant_method=method, fmt=fmt, scale_fmt=q.get("scale_fmt", "ue8m0"),
                       activation_scheme=q.get("activation_scheme", "dynamic"), weight_block_size=block)


def _parse(raw: dict) -> DeepseekV4Config:
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"config field 'model_type' must be 'deepseek_v4', got {model_type!r}")
    n = _req(raw, "num_hidden_layers", int)
    n_mtp = _opt(raw, "num_nextn_predict_layers", 0, int)
    head_dim = _req(raw, "head_dim", int)
    types, ratios, mlp = _parse_layers(raw, n, n_mtp)
    theta, ctheta, yarn = _parse_rope(raw)
    experts = raw.get("n_routed_experts", raw.get("num_local_experts"))
    inter = raw.get("moe_intermediate_size", raw.get("intermediate_size"))
    expert_dtype = raw.get("expert_dtype")
    if expert_dtype is None and isinstance(raw.get("quantization_config"), dict):
        expert_dtype = raw["quantization_config"].get("expert_dtype")
    if expert_dtype not in (None, "fp4", "fp8", "bf16", "bfloat16"):
        raise ConfigError(f"config field 'expert_dtype' must be 'fp4', 'fp8' or 'bf16', got {expert_dtype!r}")
    return DeepseekV4Config(
        vocab_size=_req(raw, "vocab_size"), hidden_size=_req(raw, "hidden_size"), num_hidden_layers=n,
        num_attention_heads=_req(raw, "num_attention_heads"), head_dim=head_dim,
        qk_rope_head_dim=_parse_rope_dim(raw, head_dim), q_lora_rank=_req(raw, "q_lora_rank"),
        o_groups=_req(raw, "o_groups"), o_lora_rank=_req(raw, "o_lora_rank"),
        sliding_window=_req(raw, "sliding_window"), layer_types=types, compress_ratios=ratios,
        mlp_layer_types=mlp, rope_theta=theta, compress_rope_theta=ctheta, rope_scaling=yarn,
        max_position_embeddings=_req(raw, "max_position_embeddings"), index_n_heads=_req(raw, "index_n_heads"),
        index_head_dim=_req(raw, "index_head_dim"), index_topk=_req(raw, "index_topk"),
        n_routed_experts=_req({"n_routed_experts": experts}, "n_routed_experts"),
        n_shared_experts=_opt(raw, "n_shared_experts", 1, int),
        num_experts_per_tok=_req(raw, "num_experts_per_tok"),
        moe_intermediate_size=_req({"moe_intermediate_size": inter}, "moe_intermediate_size"),
        scoring_func=_opt(raw, "scoring_func", "sqrtsoftplus", str),
        routed_scaling_factor=_req(raw, "routed_scaling_factor", float),
        norm_topk_prob=_opt(raw, "norm_topk_prob", True, bool), swiglu_limit=_req(raw, "swiglu_limit", float),
        hc_mult=_req(raw, "hc_mult"), hc_sinkhorn_iters=_req(raw, "hc_sinkhorn_iters"),
        hc_eps=_req(raw, "hc_eps", float), rms_norm_eps=_req(raw, "rms_norm_eps", float),
        num_nextn_predict_layers=n_mtp, num_key_value_heads=_opt(raw, "num_key_value_heads", 1, int),
        topk_method=_opt(raw, "topk_method", "noaux_tc", str), hidden_act=_opt(raw, "hidden_act", "silu", str),
        tie_word_embeddings=_opt(raw, "tie_word_embeddings", False, bool),
        bos_token_id=raw.get("bos_token_id", 0), eos_token_id=raw.get("eos_token_id", 1),
        torch_dtype=str(raw.get("torch_dtype", raw.get("dtype", "bfloat16"))),
        expert_dtype=expert_dtype, quantization_config=_parse_quant(raw),
        architectures=list(raw.get("architectures") or ["DeepseekV4ForCausalLM"]),
    )


def yarn_ramp_bounds(dim: int, theta: float, yarn: YarnScaling) -> tuple:
    """(lo, hi) frequency-index bounds of the YaRN ramp (arch section 5.3)."""

    def corr(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (2 * math.pi * rotations)) / (2 * math.log(theta))

    lo = max(math.floor(corr(yarn.beta_fast)), 0)
    hi = min(math.ceil(corr(yarn.beta_slow)), dim - 1)
    return lo, hi
