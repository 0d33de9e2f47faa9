"""dsv4_rms_norm against the engine's torch RMSNorm (sglang.srt.layers.norm): weighted and unweighted, fp32 and fp16
inputs, a non-power-of-two width, strided rows (query heads), zero rows. GPU (skipped without CUDA): bf16 at
DeepSeek-V4 widths and the dispatch from RMSNorm / rms_normalize."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm
from sglang.srt.layers import norm

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _torch_norm(x, weight, eps):
    m = norm.RMSNorm(x.shape[-1], eps).to(x.device)
    if weight is None:
        return norm.rms_normalize(x, eps)
    m.weight.data.copy_(weight)
    return m(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("d", [64, 96])
def test_matches_torch(dtype, weighted, d):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(7, 3, d, generator=g) * 3).to(dtype)
    w = torch.randn(d, generator=g) if weighted else None
    got = dsv4_rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, _torch_norm(x, w, 1e-6), atol=1e-5 if dtype == torch.float32 else 1e-3,
                               rtol=1e-5 if dtype == torch.float32 else 1e-3)


def test_strided_rows_and_zero_rows():
    x = torch.randn(5, 8, 64)
    heads = x[:, 2:6]  # rows with stride 8 * 64, last dim contiguous
    torch.testing.assert_close(dsv4_rms_norm(heads, None, 1e-6), _torch_norm(heads, None, 1e-6))
    assert dsv4_rms_norm(torch.randn(0, 64), None, 1e-6).shape == (0, 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [512, 4096, 7168])
def test_gpu_bf16_and_dispatch(d):
    x = torch.randn(300, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(d, device="cuda")
    ref = (w * (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6))).bfloat16()
    got = dsv4_rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=1e-2)
    assert norm._fused(x) is dsv4_rms_norm  # the engine's RMSNorm takes this path on CUDA
    torch.testing.assert_close(_torch_norm(x, w, 1e-6).float(), got.float(), atol=0, rtol=0)


def _act_quant(y, cublas_layout):
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant

    return dsv4_fp8_act_quant(y, cublas_layout=cublas_layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cublas_layout", [False, True])
@pytest.mark.parametrize("d", [256, 384])  # 384: a masked tail past the last 128-block in the power-of-two row
def test_fp8_output_is_norm_then_act_quant(dtype, cublas_layout, d):
    """dsv4_rms_norm_fp8 writes the norm and, bit for bit, what dsv4_fp8_act_quant makes of it (codes and
    multipliers, in either layout), from strided rows (the joined projection's split view)."""
    from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm_fp8

    g = torch.Generator().manual_seed(d)
    x = (torch.randn(7, d + 64, generator=g) * 3).to(dtype)[:, 64:]  # rows strided by d + 64
    x[3] = 0  # a zero row: multiplier 2^-126, codes 0
    w = torch.randn(d, generator=g)
    y, q, s = dsv4_rms_norm_fp8(x, w, 1e-6, cublas_layout=cublas_layout)
    ref = dsv4_rms_norm(x, w, 1e-6)
    rq, rs = _act_quant(ref, cublas_layout)
    assert torch.equal(y, ref)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and q.shape == rq.shape
    assert torch.equal(s, rs) and s.stride() == rs.stride()


_ROW_LAYOUTS = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from sgl_kernel.dsv4_rmsnorm import _dsv4_rms_norm_kernel as kernel, norm_warps

types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "eps": "fp32"}
aligned = ("x_ptr", "w_ptr", "out_ptr", "q_ptr", "s_ptr", "stride_x", "stride_o")  # as the JIT specializes them
out = {}
for d in map(int, sys.argv[1:]):
    block = triton.next_power_of_2(d)
    for quant in (False, True):
        consts = {"HAS_WEIGHT": True, "BLOCK_D": block, "QUANT": quant, "FP8_MAX": 448.0, "ROUND_IN_FP32": False}
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in aligned}
        src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
        ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": norm_warps(block)}).asm["ttgir"]
        layouts = dict(re.findall(r"(#blocked\d*) = #ttg.blocked<([^>]*)>", ttgir))
        load = re.search(r"tt\.load [^:]*: tensor<\d+x!tt\.ptr<bf16>, (#blocked\d*)>", ttgir).group(1)
        out[f"{d} {quant}"] = layouts[load]
print(json.dumps(out))
"""


def test_fp8_variant_has_the_plain_layout():
    """On a GPU the fused norm equals norm + act_quant bit for bit only if both compile the row to the same layout
    (the same sum of squares order): a 16-aligned FP8 store pulls the quantizing variant to 16 elements per thread, so
    its codes' row stride is known as a multiple of 8 only. Compiled for sm90 on the CPU (a subprocess: this one runs
    the interpreter) at norm_warps' launch for Flash's and Pro's hidden widths and q_norm's 1,024."""
    from sm90_compile import compiled_facts

    layouts = compiled_facts(_ROW_LAYOUTS, "1024", "4096", "7168", timeout=600)
    for d in (1024, 4096, 7168):
        assert layouts[f"{d} True"] == layouts[f"{d} False"], (d, layouts)


def test_fp8_output_refuses_partial_blocks():
    from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm_fp8

    with pytest.raises(ValueError, match="multiple of 128"):
        dsv4_rms_norm_fp8(torch.randn(3, 96), None, 1e-6)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d,cublas_layout", [(4096, False), (4096, True), (1024, True), (7168, True)])
def test_gpu_fp8_output(d, cublas_layout):
    from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm_fp8

    x = torch.randn(300, d + 512, device="cuda", dtype=torch.bfloat16)[:, :d]
    w = torch.randn(d, device="cuda")
    y, q, s = dsv4_rms_norm_fp8(x, w, 1e-6, cublas_layout=cublas_layout)
    ref = dsv4_rms_norm(x, w, 1e-6)
    rq, rs = _act_quant(ref, cublas_layout)
    assert torch.equal(y, ref) and torch.equal(s, rs) and s.stride() == rs.stride()
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
