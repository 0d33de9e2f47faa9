"""The Triton attention backend on a GPU against the torch reference backend on the same GPU (skipped without CUDA;
run through the device tool). The whole oracle suite also runs with it: SGLANG_TEST_DEVICE=cuda
SGLANG_TEST_ATTENTION_BACKEND=triton python -m pytest test/srt."""

from __future__ import annotations

import pytest
import torch

from oracle import engine, greedy_run, hf_reference, assert_matches_hf, random_ids

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device tool)")]

NAMES = ["tiny", "hca128", "pro_like"]
LENS = {"tiny": 77, "hca128": 321, "pro_like": 101}


@pytest.mark.parametrize("name", NAMES)
def test_triton_fp32_matches_hf(name):
    """fp32 kernels use IEEE dots, so the Triton backend meets the CPU oracle's fp32 tolerance."""
    ref = hf_reference(name, tuple(random_ids(LENS[name], seed=1)), 64)
    eng = engine(name, device="cuda", dtype="float32", attention_backend="triton")
    assert type(eng.model_runner.attn_backend).__name__ == "TritonAttnBackend"
    assert_matches_hf(greedy_run(eng, ref[0], 64), ref)
    eng.model_runner.token_allocator.check_all_free()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "fp8_e4m3+fp4"])
def test_triton_bf16_matches_torch_backend(name, kv):
    """bf16 serving dtype, bf16 / FP8 KV, FP8 / FP4 index keys: the Triton backend gives the torch backend's greedy
    tokens on the same GPU and prompt logprobs within the stated bf16 tolerance."""
    ids = random_ids(LENS[name], seed=3)
    kwargs = dict(device="cuda", dtype="bfloat16", kv_cache_dtype=kv.split("+")[0],
                  enable_deepseek_v4_fp4_indexer=kv.endswith("fp4"))
    outs = {}
    for backend in ("torch", "triton"):
        eng = engine(name, attention_backend=backend, **kwargs)
        outs[backend] = greedy_run(eng, ids, 16)
        eng.model_runner.token_allocator.check_all_free()
    a, b = outs["torch"], outs["triton"]
    lp_a = [lp for lp, _, _ in a["meta_info"]["input_token_logprobs"][1:]]
    lp_b = [lp for lp, _, _ in b["meta_info"]["input_token_logprobs"][1:]]
    diffs = [abs(x - y) for x, y in zip(lp_a, lp_b)]
    agree = sum(x == y for x, y in zip(a["output_ids"], b["output_ids"]))
    print(f"{name} {kv}: prompt logprob |diff| mean {sum(diffs) / len(diffs):.4f} max {max(diffs):.4f}; "
          f"greedy agreement {agree}/16")
    assert sum(diffs) / len(diffs) < 0.02 and max(diffs) < 0.3
    assert a["output_ids"][:8] == b["output_ids"][:8]
