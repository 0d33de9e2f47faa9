"""The tiny DeepSeek-V4 being trained: HF transformers' DeepseekV4ForCausalLM (train mode, it backpropagates) for
the main model, a small torch module for the MTP layer, and the export to the native hub format.

The MTP layer computes what the engine's MTP block does (python/sglang/srt/models/deepseek_v4_nextn.py): for row
p, e = enorm(Embed(x_{p+1})), h_j = hnorm(Hs_p[j]) with Hs_p the main model's streams before its HC head,
S_j = h_proj(h_j) + e_proj(e), one sliding-window score-routed decoder block (HF's own block), its HC head, norm
and the shared LM head; its logits at row p predict x_{p+2}. Both start from the engine's deterministic random
checkpoint (model_loader/tiny_checkpoint.py), so every tensor starts at a scale the engine is tested with.
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
from torch import nn

from tokenizer import save_tokenizer

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config as NativeConfig
from sglang.srt.model_loader.checkpoint_spec import expected_tensors
from sglang.srt.model_loader.hf_export import export_hf_checkpoint
from sglang.srt.model_loader.name_mapping import native_items
from sglang.srt.model_loader.tiny_checkpoint import TINY_CONFIG, make_tiny_checkpoint

# Every layer kind on the data's lengths (prompts of 40-500 tokens): a window-only layer, CSA with its indexer
# (index_topk 8, below the 10-120 compressed entries a few-shot prompt has), HCA (ratio 8), a second CSA; two hash-
# routed layers, then score-routed ones; mHC with 4 streams; one MTP layer. The window (64) holds a whole question
# and its worked answer, so the arithmetic does not have to travel through the compressed entries.
MODEL_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
    "sliding_window": 64, "compress_ratios": [0, 4, 8, 4, 0], "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": TINY_CONFIG["rope_scaling"], "max_position_embeddings": 1024,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "num_hash_layers": 2, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
PAGE_SIZE = 64  # the smallest page the config allows: a multiple of the window and of every ratio
QUANT = {"quantization_config": TINY_CONFIG["quantization_config"], "expert_dtype": "fp4"}


def model_config(vocab_size: int) -> dict:
    """The native config for a tokenizer of `vocab_size` ids (rounded up to a multiple of 64)."""
    return {**MODEL_CONFIG, "vocab_size": -(-vocab_size // 64) * 64}


class MTPLayer(nn.Module):
    """The MTP block as a trainable module; `native_state` names its tensors as the hub (`mtp.0.*`) does."""

    def __init__(self, hf_config) -> None:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4DecoderLayer,
                                                                          DeepseekV4HyperHead, DeepseekV4RMSNorm)

        super().__init__()
        cfg = copy.deepcopy(hf_config)
        cfg.num_hidden_layers, cfg.layer_types, cfg.mlp_layer_types = 1, ["sliding_attention"], ["moe"]
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = DeepseekV4RMSNorm(d, eps=eps)
        self.hnorm = DeepseekV4RMSNorm(d, eps=eps)
        self.block = DeepseekV4DecoderLayer(cfg, 0)
        self.hc_head = DeepseekV4HyperHead(cfg)
        self.norm = DeepseekV4RMSNorm(d, eps=eps)

    def forward(self, streams: torch.Tensor, next_embeds: torch.Tensor, input_ids: torch.Tensor, layer_kwargs: dict,
                head: nn.Module) -> torch.Tensor:
        """streams [B, T, n, D] = Hs_p, next_embeds [B, T, D] = Embed(x_{p+1}), input_ids [B, T] = x_{p+1};
        layer_kwargs: the main model's decoder-layer keywords (mask, positions, rotary tables) cut to T rows."""
        h = self.h_proj(self.hnorm(streams))
        s = h + self.e_proj(self.enorm(next_embeds)).unsqueeze(2)
        s = self.block(s, input_ids=input_ids, **layer_kwargs)
        return head(self.norm(self.hc_head(s)))

    def native_state(self) -> dict:
        renames = {f"hc_head.hc_{k}": f"hc_head_{k}" for k in ("fn", "base", "scale")}
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith("block."):
                out.update(native_items("mtp.0." + name[len("block."):], t))
            else:
                out["mtp.0." + renames.get(name, name)] = t
        return out

    def load_native(self, tensors: dict) -> None:
        """Copy the `mtp.0.*` tensors in (native_state's values are views of the parameters, fused experts too)."""
        with torch.no_grad():
            for name, t in self.native_state().items():
                t.copy_(tensors[name])


def native_state(model, mtp: MTPLayer, config: NativeConfig) -> dict:
    """Native name -> fp32 tensor (int64 tid2eid) for every main and MTP tensor of the hub format."""
    want = {**expected_tensors(config, "main"), **expected_tensors(config, "mtp")}
    out = {}
    for name, t in model.state_dict().items():
        for native, v in native_items(name, t):
            if native in want:
                out[native] = v.detach()
    out.update(mtp.native_state())
    missing = sorted(set(want) - set(out))
    if missing:
        raise RuntimeError(f"trained model lacks {len(missing)} checkpoint tensors, e.g. {missing[:3]}")
    return {k: (v if v.dtype == torch.int64 else v.float()).cpu().contiguous() for k, v in out.items() if k in want}


def build(config: dict, seed: int, device: str = "cpu"):
    """(HF model in fp32 train mode, MTPLayer) holding the engine's random checkpoint for `config` and `seed`."""
    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        native = make_tiny_checkpoint(os.path.join(tmp, "native"), config, seed=seed, dtype="float32")
        hf = export_hf_checkpoint(native, os.path.join(tmp, "hf"), dtype=torch.float32)
        # Eager attention takes the float mask the MTP rows reuse; eager experts run on any device and dtype (HF's
        # grouped_mm path depends on the torch build and the GPU), and 8 experts keep its loop cheap.
        model = DeepseekV4ForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager",
                                                      experts_implementation="eager")
        tensors = {}
        for f in sorted(os.listdir(native)):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(native, f)))
    mtp = MTPLayer(model.config)
    mtp.load_native(tensors)
    return model.to(device).train(), mtp.to(device).train()


def write_checkpoint(out_dir: str, config: dict, state: dict, quantize: bool, tokenizer) -> str:
    """The native hub format of the trained weights: bf16, or FP8 linears + MXFP4 experts (`quantize`)."""
    cfg = {**config, **QUANT} if quantize else config
    make_tiny_checkpoint(out_dir, cfg, quantize=quantize, dtype="bfloat16", edit=lambda name, value, draw: state[name])
    save_tokenizer(tokenizer, out_dir)  # replaces the DeepSeek tokenizer the writer copies
    return out_dir
