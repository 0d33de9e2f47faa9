"""The routed experts' dispatcher (layers/moe/dispatch.py) and the start-up log lines naming its choice.

Acceptance, "the dense MoE fallback is unreachable": RoutedExperts has no path that runs every expert on every token,
and every (device, dtype, width) case the dispatcher can see (the CPU with and without torch's grouped GEMM, NVIDIA
Hopper and A100, ROCm: simulated with platform.simulate_platform) maps to the grouped GEMM, the fused Triton MoE or the
CPU's per-expert loop; each case runs (the fused MoE in the Triton interpreter) and equals the per-token definition.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from sglang.srt.layers.moe import dispatch
from sglang.srt.layers.moe.dispatch import FUSED, GROUPED, LOOP, moe_device, routed_path
from sglang.srt.layers.moe.experts import RoutedExperts, clamped_swiglu, log_moe_paths
from sglang.srt.platform import simulate_platform

PLATFORMS = ("cpu", "cpu-without-grouped-mm", "cuda-sm90", "cuda-sm80", "rocm")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def fresh_dispatch():
    """The device facts are cached per device and simulated platform; a test that removes torch's op clears them."""
    dispatch._moe_device.cache_clear()
    yield
    dispatch._moe_device.cache_clear()


def _platform(name: str, monkeypatch):
    if name == "cpu-without-grouped-mm":  # a torch before 2.9
        monkeypatch.delattr(torch, "_grouped_mm")
    return {"cuda-sm90": lambda: simulate_platform("cuda", capability=(9, 0)),
            "cuda-sm80": lambda: simulate_platform("cuda", capability=(8, 0)),
            "rocm": lambda: simulate_platform("hip", gfx="gfx942")}.get(name, contextlib.nullcontext)()


def _expected(platform: str, dtype: torch.dtype, hidden: int, width: int) -> str:
    whole = all(n * torch.finfo(dtype).bits // 8 % 16 == 0 for n in (hidden, width))
    if platform == "cpu":
        return GROUPED if whole else LOOP
    if platform == "cpu-without-grouped-mm":
        return LOOP
    if platform == "cuda-sm90":
        return GROUPED if dtype == torch.bfloat16 and whole else FUSED
    return FUSED  # A100: no grouped GEMM; a ROCm build without it (simulated)


def test_the_dense_all_experts_path_is_gone():
    assert not any("dense" in name for name in dir(RoutedExperts))
    assert {dispatch.GROUPED, dispatch.FUSED, dispatch.LOOP} == {"grouped", "fused", "loop"}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("hidden,width", [(40, 64), (40, 48), (40, 42), (40, 12), (36, 48), (4096, 2048)])
def test_every_case_maps_to_grouped_fused_or_loop(monkeypatch, platform, dtype, hidden, width):
    """42 rows are whole 16-byte units in no dtype, 12 and a 36 hidden only in fp32; Flash's widths in all."""
    with _platform(platform, monkeypatch):
        x = torch.zeros(1, hidden, dtype=dtype)
        assert routed_path(moe_device(x), dtype, hidden, width).kernel == _expected(platform, dtype, hidden, width)


def _per_token(experts: RoutedExperts, x, ids, weights) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            if e >= 0:
                h = clamped_swiglu(experts.w1[e].float() @ x[t].float(), experts.w3[e].float() @ x[t].float(),
                                   experts.limit)
                out[t] += w * (experts.w2[e].float() @ h)
    return out


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("width", [48, 42])
def test_each_case_runs_its_path(monkeypatch, platform, dtype, width):
    """The forward runs exactly the path the dispatcher names, and that path computes the experts (other ranks' pairs
    skipped)."""
    g = torch.Generator().manual_seed(width)
    experts = RoutedExperts(6, 40, width, 10.0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    experts = experts.to(dtype)
    x = torch.randn(5, 40, generator=g).to(dtype)
    ids = torch.randint(0, 6, (5, 3), generator=g)
    ids[1, 2] = -1
    weights = torch.rand(5, 3, generator=g)
    ran = []
    for kernel in (GROUPED, FUSED, LOOP):
        real = getattr(RoutedExperts, f"_forward_{kernel}")
        monkeypatch.setattr(RoutedExperts, f"_forward_{kernel}",
                            lambda self, *a, _real=real, _kernel=kernel: ran.append(_kernel) or _real(self, *a))
    with torch.no_grad(), _platform(platform, monkeypatch):
        got = experts(x, ids, weights)
    assert ran == [_expected(platform, dtype, 40, width)]
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), _per_token(experts, x, ids, weights), rtol=tol, atol=tol)


def _layers(*widths, dtype=torch.float32) -> torch.nn.Module:
    return torch.nn.ModuleList(RoutedExperts(4, 40, w, 10.0).to(dtype) for w in widths)


def test_startup_line_on_the_cpu(caplog):
    """Once per kind of layer, with how many layers: the main model's and the draft's together."""
    with caplog.at_level(logging.INFO, logger="sglang.srt.layers.moe.experts"):
        lines = log_moe_paths([_layers(42, 42, 48), None, _layers(42)], torch.float32)
    assert lines == [
        "MoE: routed experts fp32 via a per-expert loop over the rows sorted by expert (torch's grouped GEMM takes "
        "rows of whole 16-byte units: intermediate 42 x 4 bytes is not) in 3 layers",
        "MoE: routed experts fp32 via torch grouped GEMM in 1 layer"]
    assert [r.getMessage() for r in caplog.records] == lines


@pytest.mark.parametrize("capability,dtype,width,why", [
    ((8, 0), torch.float32, 48, "no grouped GEMM for fp32 on this GPU"),
    ((8, 0), torch.bfloat16, 48, "no grouped GEMM for bf16 on this GPU"),
    ((9, 0), torch.float32, 48, "no grouped GEMM for fp32 on this GPU"),
    ((9, 0), torch.bfloat16, 42, "torch's grouped GEMM takes rows of whole 16-byte units: intermediate 42 x 2 bytes "
                                 "is not"),
    ((9, 0), torch.bfloat16, 48, None),
])
def test_startup_line_on_a_simulated_gpu(capability, dtype, width, why):
    name = dispatch.DTYPE_NAMES[dtype]
    line = f"MoE: routed experts {name} via " + ("torch grouped GEMM" if why is None else
                                                 f"the fused Triton MoE ({why})")
    with simulate_platform("cuda", capability=capability):
        assert log_moe_paths([_layers(width, width, dtype=dtype)], dtype) == [f"{line} in 2 layers"]


def test_startup_line_of_packed_experts(monkeypatch):
    """MXFP4 experts name the fused MoE's kernels by batch size (GEMVs where their tiles divide the widths and
    SGLANG_DSV4_MOE_DECODE=auto; the parity planes where the device has them and the scales fit); FP8 experts theirs."""
    import sgl_kernel.dsv4_moe as door

    from sglang.srt.environ import envs
    from sglang.srt.layers.quantization.fp8 import Fp8RoutedExperts
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4RoutedExperts

    fp4 = Mxfp4RoutedExperts(2, 512, 512, 10.0)
    assert log_moe_paths([fp4], torch.bfloat16) == [
        "MoE: routed experts MXFP4 kept, fused Triton MoE (CUDA-core GEMVs at 1-8 tokens, general kernels "
        "(tl.dot_scaled) above) in 1 layer"]
    fp4.scale_range = (120, 126)
    monkeypatch.setattr(door, "planes_supported", lambda device, dtype: dtype == torch.bfloat16)
    assert log_moe_paths([fp4], torch.bfloat16) == [
        "MoE: routed experts MXFP4 kept, fused Triton MoE (CUDA-core GEMVs at 1-8 tokens, PTX parity planes for "
        "other decode batches, general kernels (tl.dot_scaled) above) in 1 layer"]
    with envs.SGLANG_DSV4_MOE_DECODE.override("planes"):
        assert log_moe_paths([fp4], torch.bfloat16) == [
            "MoE: routed experts MXFP4 kept, fused Triton MoE (PTX parity planes for decode batches, general kernels "
            "(tl.dot_scaled) above) in 1 layer"]
    assert log_moe_paths([Mxfp4RoutedExperts(2, 64, 96, 10.0)], torch.float32) == [
        "MoE: routed experts MXFP4 kept, fused Triton MoE (general kernels (in-register dequantization) at every batch "
        "size) in 1 layer"]
    assert log_moe_paths([Fp8RoutedExperts(2, 256, 256, 10.0)], torch.bfloat16) == [
        "MoE: routed experts FP8 kept, fused Triton MoE (W8A16, general kernels with the FP8 tiles converted in "
        "registers at every batch size) in 1 layer"]
