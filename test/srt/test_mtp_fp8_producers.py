"""The MTP draft layer's input norms quantize for its FP8 projections, as the decoder layers' norms do
(test_fp8_producers.py): where h_proj and e_proj take a W8A8 path, hnorm and enorm write their rows quantized
(quantization/fp8.Fp8Activation) and neither projection quantizes its own input, so a speculative cycle's draft steps
launch no activation quantization of hidden-wide rows. Simulated on CPU as there (FP8 weights kept, FP8 MMA declared
present, the Triton kernels interpreted, fp16). The function must not change: greedy speculative tokens and logprobs
equal bit for bit with the producers off."""

from __future__ import annotations

import oracle
from oracle import engine, random_ids
from test_fp8_producers import WHOLE_BLOCKS, _counting, w8a8_on_cpu  # noqa: F401 (a fixture)

# One decoder layer (HCA) before the MTP layer: the draft layer's norms and projections are what is checked, the
# decoder layers only feed it hidden rows, and each takes as much interpreted time as the draft layer
ONE_LAYER = {**WHOLE_BLOCKS, "num_hidden_layers": 1, "compress_ratios": [8, 0]}


def test_mtp_norms_quantize_for_its_projections(w8a8_on_cpu, monkeypatch):  # noqa: F811
    import sgl_kernel.dsv4_fp8_gemm as gemm
    import sgl_kernel.dsv4_rmsnorm as rmsnorm
    import sglang.srt.models.deepseek_v4 as dsv4

    act_quant = _counting(monkeypatch, gemm, "dsv4_fp8_act_quant")
    norm_weights = []
    real_norm = rmsnorm.dsv4_rms_norm_fp8
    monkeypatch.setattr(rmsnorm, "dsv4_rms_norm_fp8",
                        lambda x, weight, *a, **k: norm_weights.append(weight) or real_norm(x, weight, *a, **k))
    monkeypatch.setitem(oracle.ORACLE_CONFIGS, "whole_blocks_1", ONE_LAYER)
    monkeypatch.setitem(oracle.PAGE_SIZES, "whole_blocks_1", oracle.PAGE_SIZES["tiny"])
    eng = engine("whole_blocks_1", quantize=True, disable_cuda_graph=True, dtype="float16",
                 speculative_algorithm="EAGLE", speculative_num_steps=1)
    mtp = eng.model_runner.draft_model.mtp[0]
    hidden = eng.model_runner.model.config.hidden_size
    ids = random_ids(16, seed=5)

    def run():
        out = eng.generate(input_ids=ids, return_logprob=True,
                           sampling_params={"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
        return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]

    fused = run()
    mtp_norms = [w for w in norm_weights if w is mtp.hnorm.weight or w is mtp.enorm.weight]
    assert {id(w) for w in mtp_norms} == {id(mtp.hnorm.weight), id(mtp.enorm.weight)}
    assert len(mtp_norms) == 4  # the prefill's draft extend and one cycle's
    assert not [s for s in act_quant if s[1] == hidden]  # no linear of hidden-wide input quantizes its own rows
    monkeypatch.setattr(dsv4, "w8a8_input_path", lambda linear, x: None)  # producers off: the linears quantize
    norm_weights.clear(), act_quant.clear()
    plain = run()
    assert not norm_weights and [s for s in act_quant if s[1] == hidden]
    assert fused == plain  # bit for bit
    eng.model_runner.token_allocator.check_all_free()
