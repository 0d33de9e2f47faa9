"""Quantized weights kept quantized (layers/quantization/: FP8 linears, packed MXFP4 routed experts) on the engine path,
run on CPU through the Triton interpreter (the GPU path; a real CPU run dequantizes at load): the hub-quantized tiny
checkpoint's FP8 linears become Fp8BlockLinear modules (grouped wo_a included) holding e4m3 weights and fp32 block
scales, its routed experts Mxfp4RoutedExperts holding packed codes and exponent bytes (the shared expert beside
them, unfused, its linears FP8); weights take fewer bytes, and outputs equal the dequantized engine's (W8A16 /
W4A16: activations are not rounded) through both FP8 paths (the Triton kernel for few rows, dequantize + matmul for
many) and the fused MoE.
--quantization is detected and printed; an explicit value the checkpoint does not store is refused, and so is
SGLANG_DSV4_FP4_EXPERTS contradicting it."""

from __future__ import annotations

import pytest
import torch

import oracle
from oracle import checkpoint, engine, random_ids

# The interpreted runs on two layers: a CSA one (wq_b joined with the indexer's) and an HCA one, one hash-routed and
# one routed by score; the window-only layers of the tiny config hold the same FP8 linears and experts as the HCA one
TWO_LAYERS = {**oracle.TINY, "num_hidden_layers": 2, "compress_ratios": [4, 8, 0], "num_hash_layers": 1}


@pytest.fixture
def kept_on_cpu(monkeypatch):
    """The GPU's choice on CPU: FP8 linears and MXFP4 experts kept, their Triton kernels run by the interpreter."""
    import sglang.srt.model_loader.model_builder as model_builder

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(model_builder, "fp8_linears_supported", lambda device: True)
    monkeypatch.setattr(model_builder, "mxfp4_experts_supported", lambda device: True)
    monkeypatch.setitem(oracle.ORACLE_CONFIGS, "two_layers", TWO_LAYERS)
    monkeypatch.setitem(oracle.PAGE_SIZES, "two_layers", oracle.PAGE_SIZES["tiny"])


def _prompt_logprobs(eng, ids):
    # two tokens: the prefill's and one decode step's (each later decode step runs the same kernels, interpreted)
    out = eng.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                       sampling_params={"temperature": 0, "max_new_tokens": 2, "ignore_eos": True})
    # the decode step's logprob too: the kernel's decode output compared, not only its argmax
    meta = out["meta_info"]
    return [lp for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]], out["output_ids"]


def test_quantized_weights_stay_quantized_and_agree(kept_on_cpu):
    from sglang.srt.layers.moe.experts import RoutedExperts, SharedExpert
    from sglang.srt.layers.quantization.fp8 import Fp8BlockLinear
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4RoutedExperts
    from sglang.srt.model_loader.loader import fp8_linear_names, load_config, plan_checkpoint

    path = checkpoint("two_layers", quantize=True)
    config = load_config(path)
    ref = engine("two_layers", quantize=True, quantization="none", disable_cuda_graph=True)
    eng = engine("two_layers", quantize=True, disable_cuda_graph=True)
    assert eng.server_args.quantization == "fp8"
    model = eng.model_runner.model
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear)}
    # each attention's wq_a and wkv were joined into one FP8 linear after loading (join_projections)
    # and each CSA attention's wq_b and its indexer's wq_b
    # and each shared expert's w1 and w3 (FP8 beside the kept routed experts)
    joined = [n for n in fp8 if n.endswith((".attn.wq_kv_a", ".attn.wq_b_indexer", ".shared_experts.w13"))]
    csa = sum(config.is_csa(i) for i in range(config.num_hidden_layers))
    moes = [m for m in model.modules() if hasattr(m, "shared_experts")]
    assert csa and len(joined) == config.num_hidden_layers + csa + len(moes)
    assert len(fp8) + len(joined) == len(fp8_linear_names(plan_checkpoint(path, config, "main"), config,
                                                          shared_experts=True)) > 0
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.dtype == torch.float32
               for m in fp8.values())
    assert fp8["layers.0.attn.wo_a"].groups == config.o_groups > 1
    assert sum(".shared_experts." in n for n in fp8) == 2 * len(moes)  # w13, w2: FP8 beside the routed experts
    assert moes and all(isinstance(m.experts, Mxfp4RoutedExperts) and isinstance(m.shared_experts, SharedExpert)
                        for m in moes)
    assert not any(isinstance(m, RoutedExperts) for m in model.modules())
    experts = moes[0].experts
    assert experts.w13.dtype == torch.uint8 and experts.w13.shape[1:] == (2 * config.moe_intermediate_size,
                                                                          config.hidden_size // 2)
    assert eng.model_runner.weight_bytes < ref.model_runner.weight_bytes
    for n in (24, 70):  # prefill of <= 64 rows: the Triton kernel; of more: dequantize + matmul; decode: the kernel
        ids = random_ids(n, seed=3)
        lp, tokens = _prompt_logprobs(eng, ids)
        ref_lp, ref_tokens = _prompt_logprobs(ref, ids)
        assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-4 and tokens == ref_tokens  # summation order only
    eng.model_runner.token_allocator.check_all_free()


def test_quantization_detected_and_refused():
    from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
    from sglang.srt.environ import envs
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
    with pytest.raises(ValueError, match="no MXFP4 experts"):
        resolved(False, quantization="mxfp4")
    assert resolved(True, quantization="mxfp4").quantization == "mxfp4"
    with envs.SGLANG_DSV4_FP4_EXPERTS.override(False):
        with pytest.raises(ValueError, match="SGLANG_DSV4_FP4_EXPERTS=0"):
            resolved(True)
    with envs.SGLANG_DSV4_FP4_EXPERTS.override(True):
        assert resolved(True).quantization == "fp8"


def test_cpu_and_unknown_rocm_gpus_dequantize_at_load(monkeypatch):
    """CPU, and a ROCm GPU whose architecture is not known to run the kept formats (here: none found), say no; gfx942
    / gfx950 say yes (test_fp8_format.py)."""
    from sglang.srt import platform as plat
    from sglang.srt.layers.quantization.fp8 import fp8_linears_supported
    from sglang.srt.layers.quantization.mxfp4 import mxfp4_experts_supported

    cuda = torch.device("cuda")
    for supported in (fp8_linears_supported, mxfp4_experts_supported):
        assert not supported(torch.device("cpu"))
        monkeypatch.setattr(plat, "is_hip", lambda: False)
        assert supported(cuda)
        monkeypatch.setattr(plat, "is_hip", lambda: True)
        assert not supported(cuda)


def test_weights_that_do_not_fit_are_refused_before_loading(monkeypatch, caplog):
    """The weights' bytes are counted on the meta model; a device that cannot hold them refuses before any allocation,
    saying how much is needed and how much the checkpoint holds. When they fit, the log gives both figures."""
    import logging

    import sglang.srt.model_loader.model_builder as model_builder
    from sglang.srt.model_loader.loader import checkpoint_bytes, load_config, plan_checkpoint

    path = checkpoint("tiny", quantize=True)
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader.model_builder"):
        eng = engine("tiny", quantize=True, disable_cuda_graph=True, log_level="info")
    stored = checkpoint_bytes(plan_checkpoint(path, load_config(path), "main"))
    assert eng.model_runner.checkpoint_bytes == stored
    assert f"(checkpoint {stored / 1e9:.2f} GB" in caplog.text and "weights on cpu" in caplog.text
    allocated = []
    real_materialize = model_builder.materialize
    monkeypatch.setattr(model_builder, "materialize", lambda *a: allocated.append(1) or real_materialize(*a))
    monkeypatch.setattr(model_builder, "memory_budget_bytes", lambda device: (1_000_000, 2_000_000))
    with pytest.raises(ValueError, match=r"the weights need 0\.\d GB on cpu .*checkpoint 0\.\d GB.*0\.0 GB is "
                                         r"available") as err:
        engine("tiny", quantize=True, disable_cuda_graph=True)
    assert "--quantization fp8" in str(err.value) and not allocated


def test_fp8_converted_experts_stay_fp8_and_agree(kept_on_cpu, tmp_path):
    """A checkpoint whose routed experts are FP8-converted (the repacked FP8 checkpoints H200 users run): they stay FP8
    in Fp8RoutedExperts (the fused MoE's FP8 tiles) and the engine equals the dequantized one."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from sglang.srt.layers.quantization.fp8 import Fp8RoutedExperts
    from sglang.srt.model_loader.quant_formats import dequantize_mxfp4, quantize_fp8_block

    src, dst = checkpoint("two_layers", quantize=True), str(tmp_path / "fp8-experts")
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(dst, name))
            for key in [k for k in tensors if ".experts." in k and k.endswith(".weight")]:
                scale_key = key[:-len("weight")] + "scale"
                tensors[key], tensors[scale_key] = quantize_fp8_block(dequantize_mxfp4(tensors[key],
                                                                                       tensors[scale_key]))
            save_file(tensors, os.path.join(dst, name))
    with open(os.path.join(dst, "config.json")) as f:
        raw = json.load(f)
    raw["expert_dtype"] = "fp8"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f)
    eng = engine("two_layers", model_path=dst, disable_cuda_graph=True)
    ref = engine("two_layers", model_path=dst, quantization="none", disable_cuda_graph=True)
    moes = [m for m in eng.model_runner.model.modules() if hasattr(m, "shared_experts")]
    assert moes and all(isinstance(m.experts, Fp8RoutedExperts) for m in moes)
    assert moes[0].experts.w13.dtype == torch.float8_e4m3fn
    lp, tokens = _prompt_logprobs(eng, random_ids(24, seed=5))
    ref_lp, ref_tokens = _prompt_logprobs(ref, random_ids(24, seed=5))
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-4 and tokens == ref_tokens
    eng.model_runner.token_allocator.check_all_free()


def test_mxfp4_scale_range_gates_the_parity_planes(monkeypatch):
    """The decode kernels' parity planes are exact only for scale bytes in [SCALE_MIN, SCALE_MAX]: the experts module
    records the loaded bytes' range (one read per tensor at load, none per forward) and vouches for the planes only
    inside it; a module never loaded vouches for nothing. The flag reaches dsv4_moe_mxfp4."""
    import sgl_kernel.dsv4_moe as moe
    from sgl_kernel.dsv4_moe import SCALE_MAX, SCALE_MIN
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4RoutedExperts

    experts = Mxfp4RoutedExperts(2, 64, 32, 10.0)
    assert not experts.scales_fit_planes
    codes = lambda n, k: torch.zeros(n, k // 2, dtype=torch.uint8)  # noqa: E731
    scales = lambda n, k, v: torch.full((n, k // 32), v, dtype=torch.uint8)  # noqa: E731
    for e in range(2):
        for which, n, k in (("w1", 32, 64), ("w3", 32, 64), ("w2", 64, 32)):
            experts.load_expert(which, e, codes(n, k), is_scale=False)
            experts.load_expert(which, e, scales(n, k, SCALE_MIN if e == 0 else SCALE_MAX), is_scale=True)
    assert experts.scale_range == (SCALE_MIN, SCALE_MAX) and experts.scales_fit_planes
    seen = []
    monkeypatch.setattr(moe, "dsv4_moe_mxfp4", lambda *a, **k: seen.append(k["scales_fit_planes"]) or a[0])
    experts(torch.zeros(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
    experts.load_expert("w2", 1, scales(64, 32, SCALE_MAX + 1), is_scale=True)
    assert experts.scale_range == (SCALE_MIN, SCALE_MAX + 1) and not experts.scales_fit_planes
    experts(torch.zeros(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
    assert seen == [True, False]


def test_mxfp4_decode_env_picks_gemv_or_planes(monkeypatch):
    """SGLANG_DSV4_MOE_DECODE reaches dsv4_moe_mxfp4: auto (the default) lets 1-8 tokens take the GEMVs, planes
    keeps the MMA planes."""
    import sgl_kernel.dsv4_moe as moe
    from sglang.srt.environ import envs
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4RoutedExperts

    experts = Mxfp4RoutedExperts(2, 64, 32, 10.0)
    seen = []
    monkeypatch.setattr(moe, "dsv4_moe_mxfp4", lambda *a, **k: seen.append(k["gemv"]) or a[0])
    args = (torch.zeros(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
    experts(*args)
    with envs.SGLANG_DSV4_MOE_DECODE.override("planes"):
        experts(*args)
    assert seen == [True, False]


def test_mxfp4_experts_keep_scales_chunked(monkeypatch):
    """Rows of a multiple of 8 scale groups (256 inputs, as at every real width) are kept in sgl_kernel's chunked
    storage: load_expert places the checkpoint's [rows, groups] bytes by (row, group), the forward hands the kernel
    the [E, rows, groups / 8, 8] view of them, and a checkpoint tensor of another shape is refused naming the
    checkpoint's shape."""
    import sgl_kernel.dsv4_moe as moe
    from sgl_kernel.dsv4_mxfp4_scales import chunked
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4RoutedExperts

    experts = Mxfp4RoutedExperts(2, 256, 512, 10.0)
    assert experts.w13_scale.shape == (2, 1, 1024, 8) and experts.w2_scale.shape == (2, 2, 256, 8)
    g = torch.Generator().manual_seed(0)
    raw = {w: torch.randint(0, 256, (2, n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
           for w, n, k in (("w1", 512, 256), ("w3", 512, 256), ("w2", 256, 512))}
    for e in range(2):
        for which, n, k in (("w1", 512, 256), ("w3", 512, 256), ("w2", 256, 512)):
            experts.load_expert(which, e, torch.zeros(n, k // 2, dtype=torch.uint8), is_scale=False)
            assert experts.load_expert(which, e, raw[which][e], is_scale=True) in ("w13_scale", "w2_scale")
    seen = {}
    monkeypatch.setattr(moe, "dsv4_moe_mxfp4", lambda x, ids, wts, w13, s13, w2, s2, *a, **k: seen.update(
        s13=s13, s2=s2) or x)
    experts(torch.zeros(3, 256), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
    assert torch.equal(seen["s13"], chunked(torch.cat((raw["w1"], raw["w3"]), dim=1)))
    assert torch.equal(seen["s2"], chunked(raw["w2"]))
    with pytest.raises(ValueError, match=r"expected \(512, 8\)"):
        experts.load_expert("w1", 0, raw["w1"][0][:, :4], is_scale=True)
