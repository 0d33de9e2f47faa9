"""Pooled, fixed-size indexer logits: prefill in row chunks that fit the block gives elementwise the same top-k
as one pass; the block is allocated once per process and reused; decode keeps a plain allocation."""

from __future__ import annotations

import functools

import pytest
import torch

from oracle import engine, random_ids
from sglang.srt.layers.attention.dsv4.logits_workspace import IndexerLogitsWorkspace, logits_budget_bytes
from sglang.srt.environ import envs


@functools.lru_cache(maxsize=None)
def eng():
    # the same prompt runs several times and every run's indexer choices are compared: no prefix reuse
    return engine("tiny", chunked_prefill_size=-1, disable_radix_cache=True)


def run_recording(e, ids, budget_bytes=None, pooled=True) -> tuple:
    backend = e.model_runner.attn_backend
    saved = backend.logits_workspace
    if budget_bytes is not None:
        backend.logits_workspace = IndexerLogitsWorkspace(budget_bytes, saved.device, pooled=pooled)
    chosen = []
    original = backend.forward_indexer

    def record(indexer, q, weights, forward_batch):
        out = original(indexer, q, weights, forward_batch)
        chosen.append(out.clone())
        return out

    backend.forward_indexer = record
    try:
        out = e.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
                         return_logprob=True, logprob_start_len=0)
    finally:
        backend.forward_indexer = original
        used = backend.logits_workspace
        backend.logits_workspace = saved
    return chosen, out, used


def test_many_chunks_equal_one_pass():
    e = eng()
    ids = random_ids(200, seed=9)
    one, out_one, ws_one = run_recording(e, ids)
    width = 200 // 4
    many, out_many, ws_many = run_recording(e, ids, budget_bytes=4 * width * 3)  # 3 rows per chunk
    assert ws_many.logits_rows_per_chunk(width) == 3 and ws_one.logits_rows_per_chunk(width) >= 200
    assert len(one) == len(many) > 0
    assert all(torch.equal(a, b) for a, b in zip(one, many))
    assert out_one["output_ids"] == out_many["output_ids"]
    assert out_one["meta_info"]["input_token_logprobs"] == out_many["meta_info"]["input_token_logprobs"]
    assert ws_many.num_allocations == 1  # one block, reused by every layer, chunk and forward
    unpooled, _, ws_off = run_recording(e, ids, budget_bytes=4 * width * 3, pooled=False)
    assert all(torch.equal(a, b) for a, b in zip(one, unpooled)) and ws_off.num_allocations == 0
    e.model_runner.token_allocator.check_all_free()


def test_workspace_views_and_budgets():
    ws = IndexerLogitsWorkspace(4096, "cpu")
    assert ws.logits_rows_per_chunk(100) == 10 and ws.logits_rows_per_chunk(5000) == 1
    assert ws.logits_rows_per_chunk(20) == 48  # 51 fit: multiples of 16 keep chunk starts 16-byte aligned
    a = ws.view(10, 100)
    b = ws.view(3, 50)
    assert a.data_ptr() == b.data_ptr() and ws.num_allocations == 1
    wide = IndexerLogitsWorkspace(4096, "cpu")
    assert wide.view(1, 5000).shape == (1, 5000)  # one row always fits
    with envs.SGLANG_DSV4_FP4_LOGITS_BUDGET_MB.override(7), envs.SGLANG_DSV4_INDEXER_LOGITS_BUDGET_MB.override(3):
        assert logits_budget_bytes("fp4_index") == 7 << 20 and logits_budget_bytes("fp8_index") == 3 << 20
        assert logits_budget_bytes("dense_float32") == 3 << 20


def test_quantized_index_keys_select_like_exact_keys():
    """FP8 and FP4 index keys (Hadamard-rotated on both sides) pick nearly the same entries as exact keys; a
    rotation applied on one side only would make the choice close to random."""
    ids = random_ids(240, seed=4)
    exact, _, _ = run_recording(eng(), ids)
    for index in ("fp8", "fp4"):
        kwargs = {"kv_cache_dtype": "fp8_e4m3"} if index == "fp8" else {"enable_deepseek_v4_fp4_indexer": True}
        quant_eng = engine("tiny", chunked_prefill_size=-1, **kwargs)
        assert quant_eng.model_runner.token_to_kv_pool.index_keys_rotated
        quant, _, _ = run_recording(quant_eng, ids)
        overlaps = []
        for a, b in zip(exact[:1], quant[:1]):  # the first CSA layer of the prefill: same inputs up to FP8 noise
            for ra, rb in zip(a.tolist(), b.tolist()):
                sa, sb = {x for x in ra if x >= 0}, {x for x in rb if x >= 0}
                if sa:
                    overlaps.append(len(sa & sb) / len(sa))
        mean = sum(overlaps) / len(overlaps)
        assert mean > 0.8, (index, mean)


def test_pooled_block_is_never_created_during_graph_capture(monkeypatch):
    ws = IndexerLogitsWorkspace(1 << 12, "cpu", pooled=True)
    monkeypatch.setattr(IndexerLogitsWorkspace, "device_is_capturing", lambda self: True)
    with pytest.raises(RuntimeError, match="outside CUDA graph capture"):
        ws.view(2, 8)
    assert ws.num_allocations == 0
    monkeypatch.setattr(IndexerLogitsWorkspace, "device_is_capturing", lambda self: False)
    assert ws.view(2, 8).shape == (2, 8) and ws.num_allocations == 1
    monkeypatch.setattr(IndexerLogitsWorkspace, "device_is_capturing", lambda self: True)
    assert ws.view(4, 8).shape == (4, 8) and ws.num_allocations == 1  # reuse of the existing block is fine
