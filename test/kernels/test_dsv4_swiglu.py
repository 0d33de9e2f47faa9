"""The shared expert's clamped SwiGLU in one launch (sgl_kernel.dsv4_swiglu) against its torch path
(layers/moe/experts.clamped_swiglu), alone and quantized for its FP8 w2 (the codes and multipliers of
dsv4_fp8_act_quant of the result, row-major and in cuBLAS's layout); and the routed experts' last kernel adding the
shared expert's output (`add`: combine_pairs, the GEMV down's sum, the fused paths) as torch's `routed + shared` adds
it, bit for bit. CPU: the Triton interpreter at small odd shapes; GPU (marked, skipped without CUDA): Flash widths,
eager against the torch path and against a CUDA graph's replay; the kernel compiled for sm90 on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant
from sgl_kernel.dsv4_moe_gemv import GemvLaunch, gemv_moe
from sgl_kernel.dsv4_moe_sums import combine_pairs
from sgl_kernel.dsv4_swiglu import dsv4_clamped_swiglu, dsv4_clamped_swiglu_fp8
from sglang.srt.layers.moe.experts import clamped_swiglu

from test_dsv4_moe import _experts, _routing

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gate_up(rows: int, inter: int, dtype, seed: int, device="cpu") -> tuple:
    """The halves of a joined w13's output [rows, 2I] (strided views), values past the clamp's limits."""
    g = torch.Generator(device).manual_seed(seed)
    y = (torch.randn(rows, 2 * inter, generator=g, device=device) * 3).to(dtype)
    return y.chunk(2, dim=-1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_rarely_one_ulp_off(got: torch.Tensor, ref: torch.Tensor) -> None:
    """got equals ref but for at most 1 in 200 elements, each one unit in the last place off: silu's fp32 value
    differs in its last bits between the interpreter (numpy's exp) and torch's CPU silu, which moves the 16-bit
    rounding where that value lies next to a rounding boundary (a GPU's kernel takes torch's CUDA arithmetic)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    ints = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}[got.dtype]
    ulps = (got.view(ints).int() - ref.view(ints).int()).abs()
    assert ulps.max() <= 1 and (ulps > 0).sum() * 200 <= ulps.numel(), (ulps.max(), (ulps > 0).sum())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(1, 200), (5, 42), (19, 256)])
def test_swiglu_equals_torch_path(dtype, rows, inter):
    """16-bit, the limit 1.006 (not a bf16 / fp16 value: torch clamps to it rounded to the dtype) engaging the clamp
    on most elements; odd widths (a partial 128-channel block, less than one block), 1-19 rows."""
    gate, up = _gate_up(rows, inter, dtype, seed=rows)
    got = dsv4_clamped_swiglu(gate, up, 1.006)
    _assert_rarely_one_ulp_off(got, clamped_swiglu(gate, up, 1.006))


def test_limit_rounds_as_torch_rounds_a_clamp_bound():
    """limit_in is the bound torch's clamp takes for each dtype (the scalar in the tensor's dtype), from the host's
    floats: ties to even included, an fp16 overflow to infinity left to the caller (an infinite limit stays)."""
    from sgl_kernel.dsv4_swiglu import limit_in

    for limit in (0.7, 1.006, 10.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 3.3e-5, math.inf):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert limit_in(dtype, limit) == torch.tensor(limit, dtype=dtype).item(), (limit, dtype)


def test_swiglu_fp32_and_separate_inputs():
    """fp32 (the oracle's dtype), gate and up as two tensors of their own: the torch path's function up to the exp's
    last bits (the interpreter's exp is numpy's, torch's CPU silu another)."""
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(7, 130, generator=g) * 4, torch.randn(7, 130, generator=g) * 4
    got = dsv4_clamped_swiglu(gate, up, 2.5)
    torch.testing.assert_close(got, clamped_swiglu(gate, up, 2.5), rtol=3e-7, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cublas_layout", [False, True], ids=["row-major", "cublas"])
def test_swiglu_fp8_equals_act_quant_of_the_swiglu(dtype, cublas_layout):
    """The quantizing launch writes what dsv4_fp8_act_quant writes for the unquantized launch's output (codes and
    multipliers, cuBLAS's padded rows and outer-dim-major multipliers too), 2 x 128 + 44 channels, 5 rows."""
    gate, up = _gate_up(5, 300, dtype, seed=7)
    q, s = dsv4_clamped_swiglu_fp8(gate, up, 1.006, cublas_layout=cublas_layout)
    want_q, want_s = dsv4_fp8_act_quant(dsv4_clamped_swiglu(gate, up, 1.006), cublas_layout=cublas_layout)
    assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape and s.stride() == want_s.stride()
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)


def test_swiglu_refuses_what_it_cannot_read():
    gate, up = _gate_up(3, 64, torch.float16, seed=1)
    with pytest.raises(ValueError):
        dsv4_clamped_swiglu(gate, up[:2], 1.0)
    with pytest.raises(ValueError):
        dsv4_clamped_swiglu(gate.t(), up.t(), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2])
def test_combine_adds_as_torch_adds(dtype, splits):
    """combine_pairs(add=shared) == combine_pairs() + shared, bit for bit (the routed sum rounded to the dtype first,
    then the two added): 3 tokens of top-2, hidden 1030 (a partial 1024-column block), K splits or none."""
    g = torch.Generator().manual_seed(splits)
    pairs = torch.randn(splits, 6, 1030, generator=g)
    shared = torch.randn(3, 1030, generator=g).to(dtype)
    got = combine_pairs(pairs if splits > 1 else pairs[0], 2, dtype, add=shared)
    assert torch.equal(got, combine_pairs(pairs if splits > 1 else pairs[0], 2, dtype) + shared)
    with pytest.raises(ValueError):
        combine_pairs(pairs[0], 2, dtype, add=shared[:2])


@pytest.mark.parametrize("dtype, sum_in_down", [(torch.float16, False), (torch.bfloat16, True)],
                         ids=["combine-fp16", "sum-in-down-bf16"])
def test_gemv_adds_the_shared_output(dtype, sum_in_down):
    """The GEMV MoE's last kernel (the down's summing program, or combine_pairs) adds `add` as `routed + shared`
    adds it, bit for bit, another rank's pair (-1) included. Tiles of 32 rows: the add is the last kernel's, whatever
    the tile (the interpreter's time is per program; test_dsv4_moe_gemv runs the 8-row tiles)."""
    w13, s13, w2, s2 = _experts(8, 128, 128, seed=12)
    ids, weights = _routing(2, 2, 8, seed=13, skew=False)
    ids[1, 0] = -1
    x = (torch.randn(2, 128, generator=torch.Generator().manual_seed(14)) * 0.1).to(dtype)
    shared = (torch.randn(2, 128, generator=torch.Generator().manual_seed(15)) * 0.1).to(dtype)
    launch = GemvLaunch(32, 128, sum_in_down=sum_in_down)
    routed = gemv_moe(x, ids, weights, w13, s13, w2, s2, 7.0, 128, launch=launch)
    got = gemv_moe(x, ids, weights, w13, s13, w2, s2, 7.0, 128, launch=launch, add=shared)
    assert torch.equal(got, routed + shared)


def test_fused_paths_add_the_shared_output():
    """The MMA path (dsv4_moe_mxfp4 above the GEMVs), FP8 experts and dense experts pass `add` to combine_pairs."""
    from sgl_kernel.dsv4_moe import dsv4_moe_dense, dsv4_moe_fp8, dsv4_moe_mxfp4

    w13, s13, w2, s2 = _experts(4, 128, 128, seed=16)
    ids, weights = _routing(3, 2, 4, seed=17, skew=False)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(18)) * 0.1
    shared = torch.randn(3, 128, generator=torch.Generator().manual_seed(19))
    assert torch.equal(dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 7.0, add=shared),
                       dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 7.0) + shared)
    g = torch.Generator().manual_seed(20)
    d1, d3, d2 = (torch.randn(4, *shape, generator=g) * 0.1 for shape in ((40, 128), (40, 128), (128, 40)))
    assert torch.equal(dsv4_moe_dense(x, ids, weights, d1, d3, d2, 7.0, add=shared),
                       dsv4_moe_dense(x, ids, weights, d1, d3, d2, 7.0) + shared)
    f13 = (torch.randn(4, 256, 128, generator=g) * 8).to(torch.float8_e4m3fn)
    f2 = (torch.randn(4, 128, 128, generator=g) * 8).to(torch.float8_e4m3fn)
    f13s, f2s = torch.rand(4, 2, 1, 1, generator=g) * 0.01, torch.rand(4, 1, 1, 1, generator=g) * 0.01
    assert torch.equal(dsv4_moe_fp8(x, ids, weights, f13, f13s, f2, f2s, 7.0, add=shared),
                       dsv4_moe_fp8(x, ids, weights, f13, f13s, f2, f2s, 7.0) + shared)


_SM90 = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from sgl_kernel import dsv4_swiglu as sw

out = {}
for quant in (False, True):
    consts = {"BLOCK_M": 16, "QUANT": quant, "LIBDEVICE": True, "FP8_MAX": 448.0, "ROUND_IN_FP32": False,
              "BF16_BITS": False}
    types = {"g_ptr": "*bf16", "u_ptr": "*bf16", "h_ptr": "*bf16", "q_ptr": "*fp8e4nv" if quant else "*bf16",
             "s_ptr": "*fp32" if quant else "*bf16", "limit": "fp32"}
    kernel = sw._swiglu_kernel
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    out["fp8" if quant else "plain"] = [compiled.asm["ptx"].count("ex2.approx"), "div.rn.f32" in compiled.asm["ptx"]]
print(json.dumps(out))
"""


def test_swiglu_compiles_for_sm90_with_libdevice_exp():
    """Both variants compile for an H100 with libdevice's expf (its ex2 range-reduced, not Triton's one-instruction
    exp) and an IEEE division."""
    from sm90_compile import compiled_facts

    found = compiled_facts(_SM90)
    assert set(found) == {"plain", "fp8"}
    for name, (ex2, div_rn) in found.items():
        assert ex2 >= 1 and div_rn, (name, ex2, div_rn)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 32, 128])
def test_gpu_flash_swiglu_equals_torch_path(rows):
    """Flash's shared expert (intermediate 2048, bf16): the kernel's SwiGLU equal to torch's CUDA path bit for bit
    (libdevice's expf and an IEEE division are its silu's arithmetic), its FP8 codes and multipliers equal to
    dsv4_fp8_act_quant of torch's SwiGLU in both layouts, and a CUDA graph's replay with new inputs equal to plain
    launches."""
    from graph_replays import assert_replays_equal

    gate, up = _gate_up(rows, 2048, torch.bfloat16, seed=rows, device="cuda")
    ref = clamped_swiglu(gate, up, 10.0)
    got = dsv4_clamped_swiglu(gate, up, 10.0)
    print(f"rows {rows}: {(got != ref).sum().item()} of {ref.numel()} differ from torch's SwiGLU")
    assert torch.equal(got, ref)
    for cublas_layout in (False, True):
        q, s = dsv4_clamped_swiglu_fp8(gate, up, 10.0, cublas_layout=cublas_layout)
        want_q, want_s = dsv4_fp8_act_quant(ref, cublas_layout=cublas_layout)
        assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s), cublas_layout
    live = _gate_up(rows, 2048, torch.bfloat16, seed=0, device="cuda")
    y = torch.cat(live, dim=-1)
    g, u = y.chunk(2, dim=-1)
    run = lambda: _bits(dsv4_clamped_swiglu_fp8(g, u, 10.0)[0])  # noqa: E731
    run()  # compiled before capture
    assert_replays_equal(run, run, (y,), lambda seed: (torch.cat(_gate_up(rows, 2048, torch.bfloat16, seed + 1,
                                                                          "cuda"), dim=-1),), range(3))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 2, 8, 32])
def test_gpu_flash_moe_adds_the_shared_output(tokens):
    """Flash widths (hidden 4096, intermediate 2048, top-6 of 256 MXFP4 experts), bf16: the routed experts' last
    kernel (the GEMV down's sum at 1-2 tokens, combine_pairs at 8, the MMA path's at 32) adds the shared output as
    `routed + shared` does, bit for bit, eager and from a CUDA graph's replay."""
    from sgl_kernel.dsv4_moe import dsv4_moe_mxfp4
    from sgl_kernel.dsv4_mxfp4_scales import chunked

    w13, s13, w2, s2 = _experts(256, 4096, 2048, seed=0, device="cuda")
    s13, s2 = chunked(s13), chunked(s2)
    ids, weights = _routing(tokens, 6, 256, seed=1, skew=False, device="cuda")
    x = (torch.randn(tokens, 4096, device="cuda") * 0.05).bfloat16()
    shared = (torch.randn(tokens, 4096, device="cuda") * 0.05).bfloat16()
    moe = lambda add=None: dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, gemv=True, add=add)  # noqa: E731
    got = moe(shared)
    assert torch.equal(got, moe() + shared)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe(shared)
    for _ in range(2):
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got)
