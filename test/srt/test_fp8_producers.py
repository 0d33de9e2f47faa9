"""Producers that quantize for the FP8 linear reading their output (quantization/fp8.Fp8Activation): where an FP8
linear takes a W8A8 path, the engine's RMSNorm before wq_kv_a, before wq_b (joined with the indexer's) and before
the MoE (for the shared expert's joined w1 + w3), the inverse RoPE before wo_a and the shared expert's clamped SwiGLU
before its w2 write the rows quantized, and the linear skips its own activation quantization. On CPU the GPU's
choice is simulated: FP8 weights kept, FP8 MMA declared present, the Triton kernels interpreted, fp16 (the
interpreter's bf16 is unreliable), the norms, RoPE and SwiGLU by the GPU's kernels (sgl_kernel's, interpreted; the
torch paths round sin / cos, the mean and silu otherwise). The function must not change: logprobs equal bit for bit
with the producers off. The shared expert's output reaches the routed experts' last kernel, which adds it."""

from __future__ import annotations

import pytest

import oracle
from oracle import engine, random_ids

# head_dim 128: heads of whole 128-blocks, so wo_a's 2 groups of 256 inputs too (the tiny config's heads of 96 are not
# covered by the quantizing inverse RoPE, so its wo_a keeps quantizing its own input, as does any linear whose groups
# hold a partial block). Two layers, a CSA one (the joined wq_b + indexer wq_b) and an HCA one (wq_b alone, as on a
# window-only layer), one hash-routed and one routed by score: every producer's path, at half the interpreted work
WHOLE_BLOCKS = {**oracle.TINY, "head_dim": 128, "num_hidden_layers": 2, "compress_ratios": [4, 8, 0],
                "num_hash_layers": 1}


@pytest.fixture
def w8a8_on_cpu(monkeypatch):
    import sglang.srt.layers.quantization.fp8 as fp8
    import sglang.srt.model_loader.model_builder as model_builder

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(model_builder, "fp8_linears_supported", lambda device: True)
    monkeypatch.setattr(model_builder, "mxfp4_experts_supported", lambda device: True)
    monkeypatch.setattr(fp8, "fp8_mma_supported", lambda device: True)
    monkeypatch.setitem(oracle.ORACLE_CONFIGS, "whole_blocks", WHOLE_BLOCKS)
    # the GPU's norm and RoPE kernels on CPU tensors too (the unfused path's function on a GPU)
    from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm
    from sgl_kernel.dsv4_rope import dsv4_rope
    from sgl_kernel.dsv4_swiglu import dsv4_clamped_swiglu
    from sglang.srt.layers import norm, rotary
    from sglang.srt.layers.moe import experts

    monkeypatch.setattr(norm, "_fused", lambda x: dsv4_rms_norm if x.stride(-1) == 1 else None)
    # the SwiGLU's unquantized kernel where w2 quantizes (torch's CPU silu differs from the kernel's in last bits)
    monkeypatch.setattr(experts, "_fused", lambda x: dsv4_clamped_swiglu)
    monkeypatch.setattr(rotary.RotaryEmbedding, "apply",
                        lambda self, x, positions, inverse=False: dsv4_rope(x, positions, self.inv_freq, inverse))
    monkeypatch.setitem(oracle.PAGE_SIZES, "whole_blocks", oracle.PAGE_SIZES["tiny"])


def _counting(monkeypatch, module, name: str) -> list:
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


def test_producers_quantize_and_the_function_stays(w8a8_on_cpu, monkeypatch):
    import sgl_kernel.dsv4_fp8_gemm as gemm
    import sgl_kernel.dsv4_rmsnorm as rmsnorm
    import sgl_kernel.dsv4_rope as rope
    import sgl_kernel.dsv4_swiglu as swiglu
    import sglang.srt.layers.moe.experts as experts
    import sglang.srt.models.deepseek_v4 as dsv4

    act_quant = _counting(monkeypatch, gemm, "dsv4_fp8_act_quant")
    norms = _counting(monkeypatch, rmsnorm, "dsv4_rms_norm_fp8")
    ropes = _counting(monkeypatch, rope, "dsv4_rope_fp8")
    swiglus = _counting(monkeypatch, swiglu, "dsv4_clamped_swiglu_fp8")
    import sgl_kernel.dsv4_moe as moe

    adds = []  # the shared expert's output, handed to the routed experts' last kernel (no `routed + shared` launch)
    real_moe = moe.dsv4_moe_mxfp4
    monkeypatch.setattr(moe, "dsv4_moe_mxfp4", lambda *a, **k: adds.append(k.get("add") is not None)
                        or real_moe(*a, **k))
    eng = engine("whole_blocks", quantize=True, disable_cuda_graph=True, dtype="float16")
    config = eng.model_runner.model.config
    layers, csa = config.num_hidden_layers, sum(config.is_csa(i) for i in range(config.num_hidden_layers))
    # 16 tokens: whole CSA and HCA entries and one full window; the producers' counts do not depend on the length
    ids = random_ids(16, seed=5)

    def run():
        out = eng.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                           sampling_params={"temperature": 0, "max_new_tokens": 2, "ignore_eos": True})
        meta = out["meta_info"]  # the decode step's logprob too, not only its argmax
        return [lp for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]], out["output_ids"]

    fused = run()
    forwards = 2  # the prefill (16 rows <= 64: the W8A8 kernel) and a decode step (every later one is the same)
    # per layer and forward: attn_norm (wq_kv_a), q_norm (wq_b, joined with the indexer's on CSA layers) and ffn_norm
    # (the shared expert's joined w1 + w3, FP8 beside the kept experts) write FP8, the inverse RoPE writes wo_a's
    # rows, the shared expert's SwiGLU its w2's; only wo_b (fed by wo_a's GEMM) still quantizes its own input
    assert len(norms) == 3 * layers * forwards and len(ropes) == layers * forwards
    assert [s[1] for s in swiglus] == [config.moe_intermediate_size] * layers * forwards
    assert [s[1] for s in act_quant] == [config.o_groups * config.o_lora_rank] * layers * forwards
    assert adds and all(adds)
    assert csa  # the joined wq_b + indexer wq_b took the quantized rows too
    for module in (dsv4, experts):  # producers off: the linears quantize
        monkeypatch.setattr(module, "w8a8_input_path", lambda linear, x: None)
    norms.clear(), ropes.clear(), swiglus.clear(), act_quant.clear()
    plain = run()
    assert not norms and not ropes and not swiglus and len(act_quant) == 6 * layers * forwards
    assert fused == plain  # bit for bit: the same codes and multipliers reach the same GEMMs
    eng.model_runner.token_allocator.check_all_free()
