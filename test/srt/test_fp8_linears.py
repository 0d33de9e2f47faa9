"""FP8 linears kept FP8 (layers/quantization/fp8.py) on the engine path, run on CPU through the Triton interpreter
(the GPU path; on a real CPU run the checkpoint is dequantized at load): the hub-quantized tiny checkpoint's FP8
linears become Fp8BlockLinear modules (grouped wo_a included) holding e4m3 weights and fp32 block scales, weights
take fewer bytes, and outputs equal the dequantized engine's (W8A16: the activations are not rounded) through both
paths (the Triton kernel for few rows, dequantize + matmul for many). --quantization is detected and printed; an
explicit fp8 on a float checkpoint is refused."""

from __future__ import annotations

import pytest
import torch

from oracle import checkpoint, engine, random_ids


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    import sglang.srt.model_executor.model_runner as model_runner

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(model_runner, "fp8_linears_supported", lambda device: True)


def _prompt_logprobs(eng, ids):
    out = eng.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                       sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]], out["output_ids"]


def test_fp8_linears_stay_fp8_and_agree(fp8_on_cpu):
    from sglang.srt.layers.quantization.fp8 import Fp8BlockLinear
    from sglang.srt.model_loader.loader import fp8_linear_names, load_config

    path = checkpoint("tiny", quantize=True)
    config = load_config(path)
    ref = engine("tiny", quantize=True, quantization="none", disable_cuda_graph=True)
    eng = engine("tiny", quantize=True, disable_cuda_graph=True)
    assert eng.server_args.quantization == "fp8"
    model = eng.model_runner.model
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear)}
    assert len(fp8) == len(fp8_linear_names(path, config, "main")) > 0
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.dtype == torch.float32
               for m in fp8.values())
    assert fp8["layers.0.attn.wo_a"].groups == config.o_groups > 1
    assert not any(".shared_experts." in n for n in fp8)  # fused into the routed experts' grouped GEMM
    assert eng.model_runner.weight_bytes < ref.model_runner.weight_bytes
    for n in (40, 100):  # prefill of <= 64 rows: the Triton kernel; of more: dequantize + matmul; decode: the kernel
        ids = random_ids(n, seed=3)
        lp, tokens = _prompt_logprobs(eng, ids)
        ref_lp, ref_tokens = _prompt_logprobs(ref, ids)
        assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-4 and tokens == ref_tokens  # summation order only
    eng.model_runner.token_allocator.check_all_free()


def test_quantization_detected_and_refused():
    from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
    from sglang.srt.server_args import ServerArgs

    def resolved(quantize, **kw):
        return resolve_server_args(ServerArgs(model_path=checkpoint("tiny", quantize), device="cpu", page_size=16,
                                              **kw))

    assert resolved(True).quantization == "fp8"
    assert resolved(False).quantization == "none"
    assert resolved(True, quantization="none").quantization == "none"
    with pytest.raises(ValueError, match="no FP8 linears"):
        resolved(False, quantization="fp8")
    with pytest.raises(ValueError, match="--quantization must be one of"):
        resolved(True, quantization="int4")
