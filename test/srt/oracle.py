"""Test helpers: tiny configs, cached random checkpoints, the HF transformers oracle, and engine drivers."""

from __future__ import annotations

import atexit
import copy
import functools
import os
import shutil
import tempfile
from typing import Optional

import torch

from sglang.srt.model_loader.tiny_checkpoint import TINY_CONFIG, make_tiny_checkpoint

# docs/dsv4-configs.md 2.1 (SWA, CSA, HCA ratio 8, CSA; hash + scored MoE; MTP), unquantized.
TINY = {k: v for k, v in TINY_CONFIG.items() if k not in ("quantization_config", "expert_dtype")}
# The real HCA ratio 128 (sequences over 300 tokens compress several HCA windows).
TINY_HCA128 = {**TINY, "compress_ratios": [0, 4, 128, 4, 0]}
# Pro-like: no window-only layer (HCA, HCA, CSA, HCA, CSA), index_topk far below the visible entries.
TINY_PRO_LIKE = {**TINY, "num_hidden_layers": 5, "compress_ratios": [8, 8, 4, 8, 4, 0], "index_topk": 3,
                 "index_n_heads": 32}
ORACLE_CONFIGS = {"tiny": TINY, "hca128": TINY_HCA128, "pro_like": TINY_PRO_LIKE}
# Smallest page each config allows (a multiple of the window and of every ratio).
PAGE_SIZES = {"tiny": 16, "hca128": 128, "pro_like": 16}

# Checkpoints of one test process (up to ~300 MB), removed when it exits.
CHECKPOINT_ROOT = tempfile.mkdtemp(prefix="sglang-test-ckpt-")
atexit.register(shutil.rmtree, CHECKPOINT_ROOT, ignore_errors=True)
# Device of the engine under test: cpu in CI; `SGLANG_TEST_DEVICE=cuda` runs the same suite on a GPU (the HF
# oracle stays on the CPU in fp32).
DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
# Attention backend of the engine under test (None: the platform's best, torch on CPU, triton on a GPU).
ATTENTION_BACKEND = os.environ.get("SGLANG_TEST_ATTENTION_BACKEND")


@functools.lru_cache(maxsize=None)
def checkpoint(name: str, quantize: bool = False) -> str:
    """A float32 (or hub-quantized) random checkpoint for ORACLE_CONFIGS[name], made once per session."""
    path = os.path.join(CHECKPOINT_ROOT, f"{name}-{'q' if quantize else 'f32'}")
    config = copy.deepcopy(ORACLE_CONFIGS[name])
    if quantize:
        config.update(quantization_config=TINY_CONFIG["quantization_config"], expert_dtype="fp4")
    make_tiny_checkpoint(path, config, seed=0, quantize=quantize, dtype="float32")
    return path


@functools.lru_cache(maxsize=None)
def hf_model(name: str, quantize: bool = False):
    """HF transformers DeepseekV4ForCausalLM on the same (dequantized) weights, fp32, eval mode."""
    from transformers import DeepseekV4ForCausalLM

    from sglang.srt.model_loader.hf_export import export_hf_checkpoint

    out = checkpoint(name, quantize) + "-hf"
    if not os.path.exists(out):
        export_hf_checkpoint(checkpoint(name, quantize), out, dtype=torch.float32)
    model, info = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def random_ids(n: int, seed: int, vocab: int = 512) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def hf_prompt_logprobs(model, ids: list) -> list:
    """logprob of ids[i] given ids[:i], for i = 1..n-1, from one full HF forward."""
    logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


@torch.no_grad()
def hf_greedy(model, ids: list, n: int) -> tuple:
    """n greedy tokens through HF's own cache, and each chosen token's logprob."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1].float()
    tokens, logprobs = [], []
    for _ in range(n):
        lp = torch.log_softmax(logits, dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(lp[tok].item())
        logits = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1].float()
    return tokens, logprobs


def engine(name: str, quantize: bool = False, **kwargs):
    import sglang

    args = dict(model_path=checkpoint(name, quantize), device=DEVICE, dtype="float32", page_size=PAGE_SIZES[name],
                log_level="warning", max_running_requests=8, max_total_tokens=8192,
                attention_backend=ATTENTION_BACKEND)
    args.update(kwargs)
    return sglang.Engine(**args)


def max_abs_diff(a: list, b: list) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


@functools.lru_cache(maxsize=None)
def hf_reference(name: str, ids: tuple, new_tokens: int, quantize: bool = False) -> tuple:
    """(ids, HF prompt logprobs, HF greedy tokens, their logprobs)."""
    model = hf_model(name, quantize)
    tokens, token_lps = hf_greedy(model, list(ids), new_tokens)
    return list(ids), hf_prompt_logprobs(model, list(ids)), tokens, token_lps


def greedy_run(eng, ids: list, new_tokens: int) -> dict:
    return eng.generate(input_ids=list(ids), return_logprob=True, logprob_start_len=0,
                        sampling_params={"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})


def assert_matches_hf(out: dict, ref: tuple, tol: float = 1e-4, decode_tol: Optional[float] = None) -> None:
    """Prompt logprobs within `tol`, output logprobs within `decode_tol` (default `tol`), greedy tokens identical;
    pools all free afterwards is checked by the caller."""
    ids, prompt_lps, tokens, token_lps = ref
    got_prompt = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
    assert got_prompt[0] is None and len(got_prompt) == len(ids)
    assert max_abs_diff(got_prompt[1:], prompt_lps) <= tol
    assert out["output_ids"] == tokens
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert max_abs_diff(got, token_lps) <= (tol if decode_tol is None else decode_tol)
