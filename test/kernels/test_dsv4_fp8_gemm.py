"""dsv4_fp8_act_quant / dsv4_fp8_block_gemm against their torch references (sgl_kernel.dsv4_fp8_gemm_ref):
power-of-two activation scales and e4m3 codes equal exactly (ties to even included), the GEMM of given FP8 operands
equal to the fp32 product of their dequantized values, W8A16, groups with N not a multiple of 128 and partial K
blocks, zero rows; split-K reduced in its one launch exactly as the partials summed in split order. GPU (skipped
without CUDA): exact activation codes and measured error bounds at DeepSeek-V4 Flash shapes in bf16, the split-K
reduction bit for bit and under CUDA-graph replays."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant, dsv4_fp8_block_gemm, dsv4_fp8_dequant, dsv4_fp8_scaled_gemm
from sgl_kernel.dsv4_fp8_gemm_ref import (
    act_quant_ref, act_scale_exponent, dequant_weight_ref, fp8_block_linear_ref)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _weight(n: int, k: int, seed: int, device="cpu") -> tuple:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    e = torch.randint(-12, -4, (-(-n // 128), -(-k // 128)), generator=g)
    return w.to(device), torch.ldexp(torch.ones(e.shape), e).to(device)


def test_scale_exponent_from_bits():
    amax = torch.tensor([448.0, 448.5, 896.0, 1.0, 0.0, 1e-45, 3.5, 3.5 * 2 ** 100])
    e = act_scale_exponent(amax)
    assert e.tolist() == [0, 1, 1, -8, -126, -126, -7, 93]
    ok = amax / torch.ldexp(torch.ones(8), e) <= 448  # the smallest such e: one less overflows (where allowed)
    tighter = amax / torch.ldexp(torch.ones(8), e - 1) > 448
    assert ok.all() and tighter[:4].all() and tighter[6:].all()


@pytest.mark.parametrize("groups,k", [(1, 256), (3, 200)])
def test_act_quant_matches_reference(groups, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(6, groups * k, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0  # a zero row
    q, s = dsv4_fp8_act_quant(x, groups)
    ref_q, ref_s = zip(*(act_quant_ref(x[:, i * k:(i + 1) * k]) for i in range(groups)))
    assert torch.equal(s, torch.cat(ref_s, dim=1))
    qf = q.float()
    assert torch.equal(q.view(torch.uint8), torch.cat(ref_q, dim=1).view(torch.uint8))  # the same e4m3 codes
    deq = qf.view(6, groups, k) * s.view(6, groups, -1).repeat_interleave(128, 2)[:, :, :k]
    step = s.view(6, groups, -1).repeat_interleave(128, 2)[:, :, :k].reshape(6, -1) * 2 ** -9
    assert ((deq.view(6, -1) - x).abs() <= x.abs() * 2 ** -3 + step).all()  # 3 mantissa bits; subnormal steps


@pytest.mark.parametrize("m", [5, 8, 16, 21])
def test_act_quant_cublas_layout(m):
    """The layout torch._scaled_mm's blockwise recipe takes: rows padded with zeros (multiplier 1) to a multiple of 16
    (cuBLAS needs 4; 16 keeps the multipliers' stride, a kernel argument, in one compile class), multipliers outer-dim
    major; the same codes and multipliers as the plain layout."""
    x = torch.randn(m, 2 * 256, generator=torch.Generator().manual_seed(m))
    q, s = dsv4_fp8_act_quant(x, 2)
    cq, cs = dsv4_fp8_act_quant(x, 2, cublas_layout=True)
    rows = -(-m // 16) * 16
    assert cq.shape == (rows, 512) and cs.shape == (rows, 4) and cs.stride() == (1, rows)
    assert torch.equal(cq[:m].view(torch.uint8), q.view(torch.uint8)) and torch.equal(cs[:m], s)
    assert not cq[m:].float().any() and bool((cs[m:] == 1).all())


@pytest.mark.parametrize("m,groups,n,k", [(5, 1, 96, 384), (20, 3, 80, 200), (70, 2, 130, 128), (0, 1, 64, 128)])
def test_scaled_gemm_equals_fp32_product(m, groups, n, k):
    w, ws = _weight(groups * n, k, seed=n)
    x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(m))
    a, a_s = zip(*(act_quant_ref(x[:, i * k:(i + 1) * k]) for i in range(groups)))
    a, a_s = torch.cat(a, dim=1), torch.cat(a_s, dim=1)
    got = dsv4_fp8_scaled_gemm(a, a_s, w, ws, groups, out_dtype=torch.float32)
    assert got.shape == (m, groups * n)
    ref = fp8_block_linear_ref(x, w, ws, groups)  # quantizes x the same way, then an fp32 product
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * (ref.abs().max().item() if ref.numel() else 0) + 1e-6)


@pytest.mark.parametrize("groups,n,k", [(1, 96, 384), (3, 80, 200)])
def test_w8a16_and_end_to_end(groups, n, k):
    w, ws = _weight(groups * n, k, seed=k)
    x = torch.randn(9, groups * k, generator=torch.Generator().manual_seed(1))
    w16 = dsv4_fp8_block_gemm(x, w, ws, groups, out_dtype=torch.float32, quantize_act=False)
    wf = dequant_weight_ref(w, ws)
    ref16 = torch.cat([x[:, i * k:(i + 1) * k] @ wf[i * n:(i + 1) * n].T for i in range(groups)], dim=1)
    torch.testing.assert_close(w16, ref16, rtol=1e-5, atol=1e-5 * ref16.abs().max().item())
    w8 = dsv4_fp8_block_gemm(x, w, ws, groups, out_dtype=torch.float32)
    # activation rounding (and the interpreter's own e4m3 rounding): within a few percent of the W8A16 result
    err = (w8 - ref16).norm() / ref16.norm()
    assert err < 0.05, err


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("quantize_act", [False, True])
def test_tma_equals_pointer_loads(split_k, quantize_act):
    """Weight tiles through a TMA descriptor give the pointer loads' result exactly: two groups of 80 rows (64-row
    tiles crossing into the next group's rows, masked out), a partial last K block (608 = 4 * 128 + 96), and K
    splits; a K that is not a multiple of 16 is refused."""
    from sgl_kernel.dsv4_fp8_gemm import _launch

    groups, n, k = 2, 80, 608
    w, ws = _weight(groups * n, k, seed=4)
    x = torch.randn(5, groups * k, generator=torch.Generator().manual_seed(3))
    a, a_s = (dsv4_fp8_act_quant(x, groups) if quantize_act else (x, None))
    ref = _launch(a, a_s, w, ws, groups, torch.float32, split_k=split_k)
    assert torch.equal(_launch(a, a_s, w, ws, groups, torch.float32, split_k=split_k, tma=True), ref)
    w2, ws2 = _weight(64, 600, seed=5)
    with pytest.raises(ValueError, match="multiple of 16"):
        dsv4_fp8_block_gemm(torch.randn(2, 600), w2, ws2, tma=True)


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (33, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequant_equals_reference(n, k, dtype):
    """The one-pass dequantization equals the reference exactly, partial 128-blocks and tiles included."""
    w, ws = _weight(n, k, seed=n + k)
    got = dsv4_fp8_dequant(w, ws, dtype)
    assert got.dtype == dtype and torch.equal(got, dequant_weight_ref(w, ws).to(dtype))
    with pytest.raises(ValueError, match="scale"):
        dsv4_fp8_dequant(w, ws[:, :1], dtype)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("quantize_act", [False, True])
def test_split_k_equals_one_pass(split_k, quantize_act):
    """Split-K (few rows: each split sums its K blocks into an fp32 slice, the tile's last split adds the slices)
    gives the one-pass result, with a partial last K block and two groups."""
    from sgl_kernel.dsv4_fp8_gemm import _launch

    groups, n, k = 2, 80, 600  # 5 K blocks, the last partial
    w, ws = _weight(groups * n, k, seed=3)
    x = torch.randn(3, groups * k, generator=torch.Generator().manual_seed(2))
    a, a_s = (dsv4_fp8_act_quant(x, groups) if quantize_act else (x, None))
    one = _launch(a, a_s, w, ws, groups, torch.float32, split_k=1)
    split = _launch(a, a_s, w, ws, groups, torch.float32, split_k=split_k)
    torch.testing.assert_close(split, one, rtol=1e-5, atol=1e-5 * one.abs().max().item())
    ref = fp8_block_linear_ref(x, w, ws, groups) if quantize_act else torch.cat(
        [x[:, i * k:(i + 1) * k] @ dequant_weight_ref(w, ws)[i * n:(i + 1) * n].T for i in range(groups)], dim=1)
    torch.testing.assert_close(split, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def _summed_in_order(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the two-launch GEMM + sum computed from the splits' fp32 partials: added in split order, cast once (as
    the kernel casts: to bf16 the CPU interpreter drops the low 16 bits, a GPU rounds to nearest even)."""
    total = part[0].clone()
    for p in part[1:]:
        total += p
    if dtype == torch.bfloat16 and not total.is_cuda:
        total = (total.view(torch.int32) & -65536).view(torch.float32)  # exact in bf16: the cast keeps it
    return total.to(dtype)


def _operands(m: int, groups: int, n: int, k: int, quantize_act: bool, seed: int, device="cpu") -> tuple:
    w, ws = _weight(groups * n, k, seed=seed, device=device)
    x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(seed)).to(device)
    if device != "cpu":
        x = x.bfloat16()
    a, a_s = (dsv4_fp8_act_quant(x, groups) if quantize_act else (x, None))
    return a, a_s, w, ws


@pytest.mark.parametrize("m,groups,quantize_act", [(1, 1, True), (5, 2, False), (63, 1, False), (1, 2, False),
                                                  (5, 1, True), (63, 2, True)])
def test_last_split_reduces_like_two_launches(m, groups, quantize_act):
    """The split-K launch's in-kernel reduction (the tile's last split adds the partials) equals the fp32 partials
    summed in split order and cast once, bit for bit: 2 and 5 splits (odd N, a partial last K block), fp32 and bf16
    outputs; the partials are each split's own K range (launches over those K blocks alone); counters back to 0."""
    from sgl_kernel.dsv4_fp8_gemm import _COUNTERS, _launch

    n, k = 80, 600  # 5 K blocks, the last partial
    a, a_s, w, ws = _operands(m, groups, n, k, quantize_act, seed=m + groups)
    for split_k in (2, 5):
        part = _launch(a, a_s, w, ws, groups, torch.float32, split_k=split_k, last_reduces=False)
        assert part.shape == (split_k, m, groups * n)
        for dtype in (torch.float32, torch.bfloat16):
            got = _launch(a, a_s, w, ws, groups, dtype, split_k=split_k)
            assert got.dtype == dtype and torch.equal(got, _summed_in_order(part, dtype)), (split_k, dtype)
            assert not _COUNTERS[("cpu", None)][-1].any()
    # the 2-split partials: K blocks [0, 3) and [3, 5), each one launch of its own K range (m rows per group)
    kb = ((0, 3), (3, 5))
    per_group = lambda t, lo, hi, width: t.view(m, groups, width)[:, :, lo:hi].reshape(m, -1)  # noqa: E731
    for s, (lo, hi) in enumerate(kb):
        a_k = per_group(a.float() if quantize_act else a, lo * 128, min(hi * 128, k), k)
        a_k = a_k.to(torch.float8_e4m3fn) if quantize_act else a_k
        s_k = per_group(a_s, lo, hi, 5) if quantize_act else None
        alone = _launch(a_k, s_k, w[:, lo * 128:hi * 128], ws[:, lo:hi].contiguous(), groups, torch.float32,
                        split_k=1)
        assert torch.equal(_launch(a, a_s, w, ws, groups, torch.float32, split_k=2, last_reduces=False)[s], alone)


def test_split_k_is_one_launch_reading_nothing_back(monkeypatch):
    """A split-K GEMM is one kernel launch (W8A16) or the activation quantization and one (W8A8), beside
    allocations only; no tensor is read on the host (graph-capturable)."""
    import sgl_kernel.dsv4_fp8_gemm as kernels

    w, ws = _weight(2 * 80, 600, seed=7)
    x = torch.randn(3, 2 * 600, generator=torch.Generator().manual_seed(7))
    dsv4_fp8_block_gemm(x, w, ws, 2, quantize_act=False)  # the counters allocated once
    launches, reads = [], []
    with monkeypatch.context() as mp:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            real = getattr(torch.Tensor, name)
            mp.setattr(torch.Tensor, name, lambda t, *a, _name=name, _real=real, **kw: reads.append(_name) or
                       _real(t, *a, **kw))
        kind = type(kernels._fp8_block_gemm_kernel)  # every Triton launch (JITFunction, or interpreted)
        real = kind.run
        mp.setattr(kind, "run", lambda self, *a, **kw: launches.append(self.fn.__name__) or real(self, *a, **kw))
        bool(torch.tensor(1))  # the guard sees a read (positive control)
        for quantize_act in (False, True):
            assert kernels._splits(4, 5, x.device) == 2  # the 4 output tiles leave the 4 CPU "SMs" half idle
            dsv4_fp8_block_gemm(x, w, ws, 2, quantize_act=quantize_act)
    assert reads == ["__bool__"]
    assert launches == ["_fp8_block_gemm_kernel", "_act_quant_kernel", "_fp8_block_gemm_kernel"]


def test_tile_counters_grow_and_are_allocated_outside_graph_capture(monkeypatch):
    """A launch of more output tiles than the counters hold gets a larger zeroed buffer (the smaller one stays
    allocated: graphs may hold it); needing one while a CUDA graph is captured is an error, not an allocation."""
    from sgl_kernel.dsv4_fp8_gemm import _COUNTERS, _tile_counters

    device = torch.device("cpu")
    small = _tile_counters(device, 10)
    big = _tile_counters(device, small.numel() + 1)
    assert big.numel() > small.numel() and not big.any() and _COUNTERS[("cpu", None)][-2:] == [small, big]
    assert _tile_counters(device, 10) is big
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before graph capture"):
        _tile_counters(torch.device("cuda", 0), 10)


_SM90_SPLIT_K = r"""
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
import sgl_kernel.dsv4_fp8_gemm as k

kernel = k._fp8_block_gemm_kernel
out = {}
for m in map(int, sys.argv[1:]):
    cfg = k._config(m, 2)
    block_m, block_n, warps, stages = cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages
    for quant in (True, False):
        types = {"a_ptr": "*fp8e4nv" if quant else "*bf16", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                 "ws_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32"}
        consts = dict(w_desc=None, QUANT_A=quant, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, PREC="tf32",
                      TMA=False, SPLIT_K=True, LAST_REDUCES=True)
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n.endswith("_ptr")}
        src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
        asm = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": warps, "num_stages": stages}).asm
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(asm["cubin"])
            f.flush()
            usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        line = next(ln for ln in usage.splitlines() if "REG:" in ln).split()
        ptx = asm["ptx"]
        out[f"m {m} {'w8a8' if quant else 'w8a16'}"] = dict(
            regs=int(line[0].split(":")[1]), stack=int(line[1].split(":")[1]), atomics=ptx.count("atom."),
            acq_rel=ptx.count("atom.global.gpu.acq_rel.add"), l2_loads=ptx.count("ld.global.cg"))
print(json.dumps(out))
"""


def test_sm90_split_k_counts_with_acq_rel_and_does_not_spill():
    """The split-K launches at decode batch 1 as compiled for sm90 on the CPU: one atomic per program, a GPU-scope
    acquire-release add (the partials stored before the count, read after it), the partials read from L2 (.cg: no
    stale L1 lines), and no local-memory stack (spills)."""
    from sm90_compile import compiled_facts

    found = compiled_facts(_SM90_SPLIT_K, "1", timeout=600)
    print(found)
    for facts in found.values():
        assert facts["atomics"] == 1 and facts["acq_rel"] == 1 and facts["l2_loads"] > 0, found
        assert facts["regs"] <= 255 and facts["stack"] == 0, found


def test_bad_shapes_are_refused():
    w, ws = _weight(64, 128, seed=0)
    with pytest.raises(ValueError, match="do not fit"):
        dsv4_fp8_block_gemm(torch.randn(2, 256), w, ws)
    with pytest.raises(ValueError, match="contiguous rows"):
        dsv4_fp8_block_gemm(torch.randn(128, 2).T, w, ws)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 32, 4096])
@pytest.mark.parametrize("groups,n,k", [(1, 1024, 4096), (1, 32768, 1024), (8, 1024, 4096), (1, 4096, 8192)])
def test_gpu_flash_shapes(m, groups, n, k):
    """Flash's wq_a, wq_b, grouped wo_a and wo_b: exact activation codes; bf16 output within 1% (relative
    Frobenius error vs the fp32 product of the same FP8 operands, measured about 0.3%)."""
    w, ws = _weight(groups * n, k, seed=n, device="cuda")
    x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
    q, s = dsv4_fp8_act_quant(x, groups)
    rq, rs = zip(*(act_quant_ref(x[:, i * k:(i + 1) * k]) for i in range(groups)))
    assert torch.equal(s, torch.cat(rs, dim=1)) and torch.equal(q.view(torch.uint8), torch.cat(rq, 1).view(torch.uint8))
    got = dsv4_fp8_block_gemm(x, w, ws, groups).float()
    ref = fp8_block_linear_ref(x, w, ws, groups)
    err = ((got - ref).norm() / ref.norm()).item()
    print(f"m {m} groups {groups} n {n} k {k}: relative error {err:.2e}")
    assert err < 1e-2
    w16 = dsv4_fp8_block_gemm(x, w, ws, groups, quantize_act=False).float()
    assert ((w16 - ref).norm() / ref.norm()).item() < 5e-2  # W8A16 skips the activation rounding


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 32, 64, 300])
def test_gpu_w8a16_fp32_activations(m):
    """W8A16 with fp32 activations (an engine run with --dtype float32): the tiles fit in shared memory (fewer
    pipeline stages) and the result equals the fp32 product of the dequantized weight."""
    w, ws = _weight(1024, 4096, seed=m, device="cuda")
    x = torch.randn(m, 4096, device="cuda")
    got = dsv4_fp8_block_gemm(x, w, ws, out_dtype=torch.float32, quantize_act=False)
    ref = x @ dequant_weight_ref(w, ws).T
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [65, 4096])
@pytest.mark.parametrize("groups,n,k", [(1, 1024, 4096), (8, 1024, 4096), (1, 4096, 8192)])
def test_gpu_cublas_w8a8(m, groups, n, k):
    """The prefill path on sm90 (layers/quantization/fp8.py): cuBLAS's blockwise-scaled GEMM through torch._scaled_mm
    equals the fp32 product of the same FP8 operands within bf16 output rounding (it must be there on an H200)."""
    from sglang.srt.layers.quantization.fp8 import cublas_blockwise_ok, cublas_w8a8

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuBLAS's blockwise FP8 recipe is sm90's")
    assert cublas_blockwise_ok(torch.device("cuda"), n, k)
    w, ws = _weight(groups * n, k, seed=n, device="cuda")
    x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
    got = cublas_w8a8(x, w, ws, groups).float()
    ref = fp8_block_linear_ref(x, w, ws, groups)
    err = ((got - ref).norm() / ref.norm()).item()
    print(f"cuBLAS W8A8 m {m} groups {groups} n {n} k {k}: relative error {err:.2e}")
    assert got.shape == (m, groups * n) and err < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["w8a8", "cublas_w8a8", "dequant", "w8a16"])
@pytest.mark.parametrize("m,groups,n,k", [(1, 1, 32768, 1024), (32, 8, 1024, 4096), (128, 1, 1024, 4096),
                                         (256, 8, 1024, 4096), (2048, 1, 512, 4096),
                                         (1, 1, 1536, 4096), (4096, 1, 1536, 4096)])  # wq_a + wkv joined
def test_gpu_engine_paths(m, groups, n, k, path):
    """Each kernel `fp8_path` may pick (W8A8, cuBLAS W8A8, one-pass dequantize + bf16 GEMM, W8A16) through
    fp8_linear, against the fp32 product of the same operands: W8A8 within its activation rounding, the others within
    bf16's; the one-pass dequantization equals torch's bit for bit."""
    from sglang.srt.layers.quantization.fp8 import cublas_blockwise_ok, dequantize_weight, fp8_linear

    if path == "cublas_w8a8" and not cublas_blockwise_ok(torch.device("cuda"), n, k):
        pytest.skip("no cuBLAS blockwise FP8 recipe on this GPU")
    w, ws = _weight(groups * n, k, seed=m + n, device="cuda")
    assert torch.equal(dsv4_fp8_dequant(w, ws), dequantize_weight(w, ws, torch.bfloat16))
    x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
    got = fp8_linear(x, w, ws, groups, path=path).float()
    wf = dequant_weight_ref(w, ws)
    ref = torch.cat([x[:, i * k:(i + 1) * k].float() @ wf[i * n:(i + 1) * n].T for i in range(groups)], dim=1)
    err = ((got - ref).norm() / ref.norm()).item()
    print(f"path {path} m {m} groups {groups} n {n} k {k}: relative error {err:.2e}")
    assert got.shape == (m, groups * n) and err < (5e-2 if "w8a8" in path else 1e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m,groups,n,k", [(1, 1, 32768, 1024), (16, 8, 1024, 4096), (64, 1, 4096, 8192)])
@pytest.mark.parametrize("quantize_act", [True, False])
def test_gpu_tma_equals_pointer_loads(m, groups, n, k, quantize_act):
    """At Flash's shapes on the GPU (real TMA copies, pipelined), weight tiles through a descriptor give the pointer
    loads' result within fp32 summation order."""
    w, ws = _weight(groups * n, k, seed=n + m, device="cuda")
    x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
    ref = dsv4_fp8_block_gemm(x, w, ws, groups, out_dtype=torch.float32, quantize_act=quantize_act)
    got = dsv4_fp8_block_gemm(x, w, ws, groups, out_dtype=torch.float32, quantize_act=quantize_act, tma=True)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m,groups,n,k", [(16, 1, 1536, 4096), (4096, 1, 1536, 4096), (4096, 1, 40960, 1024),
                                         (32, 8, 1024, 4096), (4096, 8, 1024, 4096)])
def test_gpu_quantized_input_equals_own_quantization(m, groups, n, k):
    """An Fp8BlockLinear handed rows quantized by their producer, in the layout its path wants (w8a8_input_layout),
    computes what it computes quantizing the producer's 16-bit output itself: at decode rows (the Triton W8A8) and
    prefill rows (cuBLAS's), for the joined projections after their RMSNorm (exactly) and the grouped wo_a after the
    inverse RoPE (Flash's attention output [T, 64, 512], rope 64; within bf16 rounding, should the two RoPE kernels'
    rotations round apart)."""
    from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm, dsv4_rms_norm_fp8
    from sgl_kernel.dsv4_rope import dsv4_rope, dsv4_rope_fp8
    from sglang.srt.layers.quantization.fp8 import Fp8Activation, Fp8BlockLinear
    from sglang.srt.layers.rotary import RotaryEmbedding

    lin = Fp8BlockLinear(k, groups * n, groups).cuda()
    w, ws = _weight(groups * n, k, seed=m + n, device="cuda")
    lin.weight.data.copy_(w)
    lin.weight_scale_inv.data.copy_(ws)
    path = lin.w8a8_input_layout(m, torch.bfloat16, torch.device("cuda"))  # eager: cuBLAS from 4,096 rows
    assert path == ("w8a8" if m <= 64 else "cublas_w8a8")
    cublas = path == "cublas_w8a8"
    if groups == 1:
        x = torch.randn(m, k + 512, device="cuda", dtype=torch.bfloat16)[:, :k]  # strided rows, as q_a's
        nw = torch.randn(k, device="cuda")
        y, q, s = dsv4_rms_norm_fp8(x, nw, 1e-6, cublas_layout=cublas)
        assert torch.equal(y, dsv4_rms_norm(x, nw, 1e-6))
        ref = lin(y)
    else:
        o = torch.randn(m, 64, 512, device="cuda", dtype=torch.bfloat16)
        positions = torch.randint(0, 60000, (m,), device="cuda")
        inv = RotaryEmbedding(64, 10000.0, None).inv_freq.cuda()
        q, s = dsv4_rope_fp8(o, positions, inv, True, cublas_layout=cublas)
        ref = lin(dsv4_rope(o, positions, inv, True).flatten(1))
    got = lin(Fp8Activation(q, s, m, torch.bfloat16, path))
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{path} m {m} groups {groups} n {n} k {k}: bit-equal {torch.equal(got, ref)}, relative difference {err:.1e}")
    assert got.shape == (m, groups * n) and (torch.equal(got, ref) if groups == 1 else err < 1e-2)


# Flash's FP8 linears (benchmark/kernels/sweep_fp8_linears.py): name, N per group, K, groups
_FLASH_LINEARS = [("wq_a", 1024, 4096, 1), ("wq_b", 32768, 1024, 1), ("wkv", 512, 4096, 1), ("wo_a", 1024, 4096, 8),
                  ("wo_b", 4096, 8192, 1), ("indexer.wq_b", 8192, 1024, 1), ("wq_kv_a", 1536, 4096, 1)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("name,n,k,groups", _FLASH_LINEARS)
def test_gpu_split_k_reduction_equals_two_launches(m, name, n, k, groups):
    """At Flash's decode shapes, W8A8 and W8A16, bf16 out: the one launch (its K splits as the engine picks them,
    reduced by each tile's last split) equals the same splits' fp32 partials summed in split order and cast, bit for
    bit; 20 more launches give the same bits (no race between the splits); the counters end at zero."""
    from sgl_kernel.dsv4_fp8_gemm import _COUNTERS, _launch

    for quantize_act in (True, False):
        a, a_s, w, ws = _operands(m, groups, n, k, quantize_act, seed=m + n, device="cuda")
        got = _launch(a, a_s, w, ws, groups, torch.bfloat16)
        part = _launch(a, a_s, w, ws, groups, torch.bfloat16, last_reduces=False)
        splits = part.shape[0] if part.dim() == 3 else 1
        print(f"{name} m {m} {'w8a8' if quantize_act else 'w8a16'}: {splits} splits")
        assert torch.equal(got, _summed_in_order(part, torch.bfloat16) if splits > 1 else part)
        for _ in range(20):
            assert torch.equal(_launch(a, a_s, w, ws, groups, torch.bfloat16), got)
        assert not _COUNTERS[("cuda", a.device.index)][-1].any()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m,name,n,k,groups", [(1, *_FLASH_LINEARS[3]), (8, *_FLASH_LINEARS[6]),
                                               (32, *_FLASH_LINEARS[4])])
@pytest.mark.parametrize("quantize_act", [True, False])
def test_gpu_split_k_graph_replays(m, name, n, k, groups, quantize_act):
    """A captured split-K GEMM replayed on new rows equals the plain launch bit for bit (the counters the last
    splits put back to zero serve the next replay), and leaves the counters at zero."""
    from graph_replays import assert_replays_equal
    from sgl_kernel.dsv4_fp8_gemm import _COUNTERS

    w, ws = _weight(groups * n, k, seed=m, device="cuda")
    x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
    run = lambda: dsv4_fp8_block_gemm(x, w, ws, groups, quantize_act=quantize_act)  # noqa: E731
    run()  # warm-up: compiled, counters allocated
    rows = lambda seed: (torch.randn(m, groups * k, generator=torch.Generator().manual_seed(seed)).to(x),)  # noqa
    assert_replays_equal(run, run, (x,), rows, seeds=range(4))
    torch.cuda.synchronize()
    assert not _COUNTERS[("cuda", x.device.index)][-1].any()
