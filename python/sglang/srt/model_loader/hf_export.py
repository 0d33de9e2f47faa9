"""Export a native checkpoint in the form HF transformers' `save_pretrained` writes, for the oracle.

The weights are dequantized through `iter_checkpoint`; the config uses HF's modern keys
(`layer_types` + `compress_rates`, `mlp_layer_types`, flat YaRN `rope_parameters`) because HF's legacy
`compress_ratios` path only accepts the ratios 0/4/128 (docs/dsv4-configs.md 2.2). `qk_rope_head_dim`
is kept: HF would otherwise derive it from a rounded `partial_rotary_factor` (96 * 0.3333333333 -> 31).
"""

from __future__ import annotations

import json
import os

import torch

from sglang.srt.configs.deepseek_v4 import CSA, HCA, ConfigError, DeepseekV4Config
from sglang.srt.model_loader.loader import iter_checkpoint, load_config
from sglang.srt.model_loader.name_mapping import to_hf_saved
from sglang.srt.model_loader.weight_utils import save_sharded

# Native-only keys HF must not see (folded into the modern fields below, or meaningless after dequant).
_NATIVE_ONLY = ("compress_ratios", "num_hash_layers", "rope_scaling", "quantization_config", "expert_dtype",
                "torch_dtype")


def hf_config_dict(config: DeepseekV4Config, dtype: torch.dtype = torch.float32) -> dict:
    """The HF-form config.json of `config` (raises ConfigError when HF cannot express it)."""
    hca_ratios = sorted({config.compress_ratio(i) for i in config.hca_layers})
    if len(hca_ratios) > 1:
        raise ConfigError(f"config field 'compress_ratios' uses several HCA ratios {hca_ratios}; HF's "
                          f"'compress_rates' holds one ratio per layer type")
    out = {k: v for k, v in config.to_native_dict().items() if k not in _NATIVE_ONLY}
    out["layer_types"] = list(config.layer_types)
    out["compress_rates"] = {CSA: 4, HCA: hca_ratios[0] if hca_ratios else 128}
    out["mlp_layer_types"] = list(config.mlp_layer_types)
    out["qk_rope_head_dim"] = config.qk_rope_head_dim
    if config.rope_scaling is not None:
        s = config.rope_scaling
        out["rope_parameters"] = {"rope_type": "yarn", "factor": s.factor,
                                  "original_max_position_embeddings": s.original_max_position_embeddings,
                                  "beta_fast": s.beta_fast, "beta_slow": s.beta_slow}
    out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def export_hf_checkpoint(native_dir: str, out_dir: str, dtype: torch.dtype = torch.float32,
                         num_shards: int = 1) -> str:
    """Write config.json + safetensors under HF's saved names (MTP kept under native `mtp.*` names).

    `DeepseekV4ForCausalLM.from_pretrained(out_dir)` then finds no missing, unexpected or mismatched keys.
    """
    config = load_config(native_dir)
    hf_config = hf_config_dict(config, dtype)
    tensors = {}
    for part in ("main", "mtp"):
        for name, t in iter_checkpoint(native_dir, config, dtype=dtype, part=part):
            tensors[to_hf_saved(name) or name] = t
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
        f.write("\n")
    save_sharded(out_dir, tensors, num_shards)
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        src = os.path.join(native_dir, fname)
        if os.path.exists(src):
            with open(src, "rb") as fi, open(os.path.join(out_dir, fname), "wb") as fo:
                fo.write(fi.read())
    return out_dir
