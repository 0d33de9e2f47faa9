"""The attention's front on the GPU path: the query heads and the K=V vector each take one RMSNorm + RoPE launch
(dsv4_qk_norm_rope, interpreted here where the engine's CPU tensors stand in for the GPU's), reading the joined
projections' split views through their strides, and the fp32 engine stays within the HF oracle's 2e-5."""

from __future__ import annotations

from oracle import assert_matches_hf, engine, greedy_run, hf_reference, random_ids
from sgl_kernel.dsv4_qk_norm_rope import dsv4_qk_norm_rope
from sglang.srt.layers import rotary
from sglang.srt.models.deepseek_v4 import Attention


def test_front_is_one_launch_each_and_matches_hf(monkeypatch):
    calls = []

    def kernel(x, weight, eps, positions, inv_freq):
        calls.append((x.dim(), weight is not None, x.shape[0] > 1 and not x.is_contiguous()))
        return dsv4_qk_norm_rope(x, weight, eps, positions, inv_freq)

    monkeypatch.setattr(rotary, "_fused_norm_rope", lambda x: kernel)  # every tensor taken for a GPU's
    ref = hf_reference("tiny", tuple(random_ids(29, 5)), 4)
    eng = engine("tiny", chunked_prefill_size=-1)
    try:
        attentions = [m for m in eng.model_runner.model.modules() if isinstance(m, Attention)]
        out = greedy_run(eng, ref[0], 4)
    finally:
        eng.shutdown()
    assert_matches_hf(out, ref, tol=2e-5)
    per_forward = 2 * len(attentions)  # two launches per layer, nothing more
    assert len(calls) % per_forward == 0 and len(calls) >= 4 * per_forward, calls  # the prefill and each decode step
    assert sum(1 for c in calls if c[:2] == (3, False)) == len(calls) // 2  # query heads, unweighted
    assert sum(1 for c in calls if c[:2] == (2, True)) == len(calls) // 2  # the K=V vector, kv_norm's weight
    # the prompt's rows, split views read in place: every K=V vector (wq_a + wkv joined), the CSA layers' queries
    # (wq_b + the indexer's wq_b joined)
    prompt = calls[:per_forward]
    assert all(c[2] for c in prompt if c[0] == 2) and any(c[2] for c in prompt if c[0] == 3), prompt
