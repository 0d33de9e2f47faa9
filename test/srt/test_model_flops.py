"""The model FLOPs of a prefill (sglang.srt.utils.model_flops) against a count written token by token from the
architecture's rules (dsv4-architecture.md 5.4-5.6: what a query at position t sees), on configs of odd sizes, and on
Flash's widths against the figures worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.utils.model_flops import PrefillFlops, expert_flops_per_token, linear_flops_per_token, prefill_flops

FLASH_12L = "benchmark/configs/flash-12l256e.config.json"


def odd_config() -> DeepseekV4Config:
    """Odd widths, window 5, ratios 4 and 8 (HCA), a top-k the visible entries outgrow."""
    raw = {"vocab_size": 101, "hidden_size": 24, "num_hidden_layers": 4, "num_attention_heads": 6,
           "num_key_value_heads": 1, "head_dim": 20, "qk_rope_head_dim": 8, "q_lora_rank": 12, "o_groups": 3,
           "o_lora_rank": 10, "sliding_window": 5, "compress_ratios": [0, 4, 8, 4, 0], "compress_rope_theta": 1e5,
           "rope_theta": 1e4, "max_position_embeddings": 4096, "index_n_heads": 3, "index_head_dim": 16,
           "index_topk": 3, "n_routed_experts": 7, "n_shared_experts": 1, "num_experts_per_tok": 3,
           "moe_intermediate_size": 14, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
           "norm_topk_prob": True, "num_hash_layers": 1, "swiglu_limit": 10.0, "hc_mult": 3,
           "hc_sinkhorn_iters": 5, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1}
    return DeepseekV4Config.from_dict(raw)


def token_by_token(cfg: DeepseekV4Config, prompt_len: int, prefix_len: int) -> tuple:
    """(attention FLOPs, indexer FLOPs) summed position by position from the visibility rules."""
    attention = indexer = 0
    for t in range(prefix_len, prompt_len):
        for layer in range(cfg.num_hidden_layers):
            keys = len(range(max(0, t - cfg.sliding_window + 1), t + 1))  # the window, itself included
            ratio = cfg.compress_ratio(layer)
            visible = [w for w in range(t + 1) if ratio and w < (t + 1) // ratio]  # entry w complete at or before t
            if cfg.is_hca(layer):
                keys += len(visible)
            elif cfg.is_csa(layer):
                keys += min(cfg.index_topk, len(visible))
                indexer += 2 * cfg.index_n_heads * cfg.index_head_dim * len(visible)
            attention += 2 * 2 * cfg.num_attention_heads * cfg.head_dim * keys
    return attention, indexer


@pytest.mark.parametrize("prompt_len, prefix_len", [(1, 0), (3, 0), (37, 0), (37, 11), (64, 63), (90, 17)])
def test_attention_and_indexer_match_a_token_by_token_count(prompt_len, prefix_len):
    cfg = odd_config()
    assert (cfg.is_csa(1), cfg.is_hca(2), cfg.is_csa(3)) == (True, True, True)
    f = prefill_flops(cfg, prompt_len, prefix_len)
    assert (f.attention, f.indexer) == token_by_token(cfg, prompt_len, prefix_len)
    n = prompt_len - prefix_len
    assert f.tokens == n and f.lm_head == 2 * cfg.hidden_size * cfg.vocab_size
    assert f.linear == n * sum(linear_flops_per_token(cfg, i) for i in range(cfg.num_hidden_layers))
    assert f.experts == n * cfg.num_hidden_layers * 2 * 3 * 3 * 24 * 14  # top-3, w1 / w3 / w2 of 24 x 14


def test_linear_flops_per_layer_type():
    cfg = odd_config()
    d, h, dh, rq, g, ro = 24, 6, 20, 12, 3, 10
    common = d * rq + rq * h * dh + d * dh + h * dh * ro + g * ro * d + d * 7 + 3 * d * 14 + 2 * 15 * 3 * d
    assert linear_flops_per_token(cfg, 0) == 2 * common  # sliding window only
    assert linear_flops_per_token(cfg, 2) == 2 * (common + 2 * d * dh)  # HCA: compressor wkv + wgate, c = 1
    indexer = rq * 3 * 16 + d * 3 + 2 * d * 2 * 16
    assert linear_flops_per_token(cfg, 1) == 2 * (common + 2 * d * 2 * dh + indexer)  # CSA: c = 2, the indexer


def test_chunks_add_up_and_batches_scale():
    cfg = odd_config()
    whole = prefill_flops(cfg, 90)
    parts = prefill_flops(cfg, 40) + prefill_flops(cfg, 90, prefix_len=40)
    for name in ("tokens", "linear", "experts", "attention", "indexer"):
        assert getattr(parts, name) == getattr(whole, name), name
    assert parts.lm_head == 2 * whole.lm_head  # the head runs once a chunk here, the prompt's last row
    four = prefill_flops(cfg, 90, batch=4)
    assert dataclasses.astuple(four) == tuple(4 * v for v in dataclasses.astuple(whole))
    assert four.per_token == whole.per_token
    assert prefill_flops(cfg, 9, 9) == PrefillFlops(0, 0.0, 0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("bad", [dict(prompt_len=4, prefix_len=5), dict(prompt_len=4, prefix_len=-1),
                                 dict(prompt_len=4, batch=-1)])
def test_bad_lengths_are_refused(bad):
    with pytest.raises(ValueError, match="prefix_len"):
        prefill_flops(odd_config(), **bad)


def test_flash_widths_by_hand():
    """flash-12l256e: 2 SWA layers, 5 CSA, 5 HCA (the config's compress_ratios), Flash's widths."""
    cfg = DeepseekV4Config.from_json_file(FLASH_12L)
    attn = 4096 * 1024 + 1024 * 32768 + 4096 * 512 + 32768 * 1024 + 8 * 1024 * 4096  # wq_a, wq_b, wkv, wo_a, wo_b
    ffn = 4096 * 256 + 3 * 4096 * 2048 + 2 * 24 * 4 * 4096  # router, shared expert, both sub-layers' mHC mixes
    csa = 2 * 4096 * 1024 + 1024 * 64 * 128 + 4096 * 64 + 2 * 4096 * 256  # compressor, indexer wq_b, weights, its own
    hca = 2 * 4096 * 512
    assert [linear_flops_per_token(cfg, i) for i in (0, 2, 3)] == [2 * (attn + ffn), 2 * (attn + ffn + csa),
                                                                   2 * (attn + ffn + hca)]
    assert expert_flops_per_token(cfg) == 2 * 6 * 3 * 4096 * 2048
    f = prefill_flops(cfg, 1024, batch=8)
    assert 7.3e9 < f.per_token < 7.4e9  # the ~7.2 GFLOP a token the prefill figures are measured by
    # A 131,072-token prompt: the indexer's scores grow with the square of the length, the rest linearly.
    long, short = prefill_flops(cfg, 131072), prefill_flops(cfg, 8192)
    assert long.linear == 16 * short.linear and long.indexer > 200 * short.indexer
