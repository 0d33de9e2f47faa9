"""The model FLOPs of a prefill, and the matmul rate they are measured against.

A prefill at a useful size is compute-bound, so its figure of merit is the FLOPs the model's math needs per second
over the device's bf16 matmul rate measured in the same run (a large square bf16 matmul). The FLOPs counted are the
model's, 2 per multiply-add, whatever a kernel spends beyond them (padding, recomputation, a dense fallback):

- linear: every decoder layer's projections per token: wq_a, wq_b, wkv, wo_a (grouped: H*Dh -> G*Ro in G blocks),
  wo_b; the compressor's wkv + wgate (c*d outputs each: CSA c = 2, d = Dh; HCA c = 1); on CSA layers the indexer's
  wq_b, weights_proj and its own ratio-4 compressor (c = 2, d = dI); the router's gate GEMV (hash layers still score
  their fixed experts); the shared experts (w1, w3, w2); the mHC mixes (fn [M, n*D] on both sub-layers).
- experts: the routed experts, num_experts_per_tok a token (w1, w3, w2).
- attention: q.k and p.v over a token's keys, every head: its window (min(t + 1, W) tokens, itself included), on HCA
  layers every visible compressed entry (floor((t + 1) / m)), on CSA layers min(kI, visible entries) selected ones.
- indexer: on CSA layers the scores of every visible compressed entry, nI heads of dI dims (the sum over positions
  grows with the square of the prompt: the one term that does).
- lm_head: one row a request (the prompt's last token; prompt logprobs would add the others).

Left out: norms, RoPE, softmaxes, the compressors' pooling and the Sinkhorn (a few flops a value, no matmul), and
the MTP layers (a speculative server prefills them too: one more SWA layer each). Per rank: tensor and expert
parallelism split these FLOPs; the figures are the whole model's.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config

CSA_RATIO = 4  # the overlapping compressor's and the indexer's window (dsv4-architecture.md 5.4)


@dataclasses.dataclass(frozen=True)
class PrefillFlops:
    """A prefill's model FLOPs by kind (see the module docstring)."""

    tokens: int
    linear: float
    experts: float
    attention: float
    indexer: float
    lm_head: float

    @property
    def total(self) -> float:
        return self.linear + self.experts + self.attention + self.indexer + self.lm_head

    @property
    def per_token(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0

    def __add__(self, other: "PrefillFlops") -> "PrefillFlops":
        return PrefillFlops(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))


def linear_flops_per_token(cfg: DeepseekV4Config, layer_id: int) -> float:
    """Every dense projection of one decoder layer, for one token (FLOPs)."""
    d, h, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    rq, g, ro = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    macs = d * rq + rq * h * dh + d * dh + (h * dh) * ro + g * ro * d  # wq_a, wq_b, wkv, wo_a (G blocks), wo_b
    if cfg.is_csa(layer_id):
        n_i, d_i = cfg.index_n_heads, cfg.index_head_dim
        macs += 2 * (d * 2 * dh)  # the compressor's wkv and wgate, c = 2
        macs += rq * n_i * d_i + d * n_i + 2 * (d * 2 * d_i)  # indexer wq_b, weights_proj, its compressor
    elif cfg.is_hca(layer_id):
        macs += 2 * (d * dh)  # c = 1
    macs += d * cfg.n_routed_experts  # the router's gate
    macs += cfg.n_shared_experts * 3 * d * cfg.moe_intermediate_size
    macs += 2 * cfg.hc_mix_dim * cfg.hc_mult * d  # the mHC mixes of the attention and FFN sub-layers
    return 2.0 * macs


def expert_flops_per_token(cfg: DeepseekV4Config) -> float:
    return 2.0 * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def _sum_min(lo: int, hi: int, cap: int, step: int = 1) -> int:
    """sum over t in [lo, hi) of min(floor((t + 1) / step), cap): exact, on tensors of the positions."""
    t = torch.arange(lo + 1, hi + 1, dtype=torch.int64)
    return int(torch.clamp(torch.div(t, step, rounding_mode="floor"), max=cap).sum())


def layer_keys(cfg: DeepseekV4Config, layer_id: int, start: int, end: int) -> tuple:
    """(keys attended, compressed entries the indexer scores) summed over the positions [start, end) of one layer."""
    window = _sum_min(start, end, cfg.sliding_window)
    ratio = cfg.compress_ratio(layer_id)
    if cfg.is_csa(layer_id):
        visible = _sum_min(start, end, end, ratio)
        return window + _sum_min(start, end, cfg.index_topk, ratio), visible
    if cfg.is_hca(layer_id):
        return window + _sum_min(start, end, end, ratio), 0
    return window, 0


def prefill_flops(cfg: DeepseekV4Config, prompt_len: int, prefix_len: int = 0, batch: int = 1) -> PrefillFlops:
    """The model FLOPs of prefilling `batch` prompts of `prompt_len` tokens whose first `prefix_len` are cached
    (positions [prefix_len, prompt_len) computed; attention reads the cached ones), the LM head once a prompt."""
    if not 0 <= prefix_len <= prompt_len or batch < 0:
        raise ValueError(f"need 0 <= prefix_len ({prefix_len}) <= prompt_len ({prompt_len}) and batch >= 0")
    n = prompt_len - prefix_len
    per_key = 4.0 * cfg.num_attention_heads * cfg.head_dim  # q.k and p.v, every head
    per_score = 2.0 * cfg.index_n_heads * cfg.index_head_dim
    linear = attention = indexer = 0.0
    for layer_id in range(cfg.num_hidden_layers):
        linear += n * linear_flops_per_token(cfg, layer_id)
        keys, scored = layer_keys(cfg, layer_id, prefix_len, prompt_len)
        attention += per_key * keys
        indexer += per_score * scored
    lm_head = 2.0 * cfg.hidden_size * cfg.vocab_size if n else 0.0
    one = PrefillFlops(n, linear, n * expert_flops_per_token(cfg) * cfg.num_hidden_layers, attention, indexer,
                       lm_head)
    return PrefillFlops(*(getattr(one, f.name) * batch for f in dataclasses.fields(one)))


def matmul_rate_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> Optional[float]:
    """The bf16 [n, n] x [n, n] matmul rate of a GPU in TFLOP/s (median of `iters`, CUDA events, after two
    warm-ups): the limit a compute-bound prefill is measured against. None off a GPU (a CPU's BLAS rate is no
    prefill's limit here)."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    times = []
    for i in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del a, b
    return 2.0 * n ** 3 / times[len(times) // 2] / 1e12
