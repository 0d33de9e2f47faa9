"""The fused MoE's front door (sgl_kernel.dsv4_moe: dsv4_moe_mxfp4, W4A16; dsv4_moe_fp8, W8A16) against its torch
references (sgl_kernel.dsv4_moe_ref), through each path it picks: the block layout of dsv4_moe_align equals the
reference's (capacity-static block count, -1 padding, experts past the work),
and the fused output equals the dequantized computation for skewed and uniform routing, experts nobody picks,
a hidden size that is not a multiple of the K tile, the clamp engaged, one token, zero tokens. fp32 activations on
CPU (the Triton interpreter); GPU (skipped without CUDA): bf16 at DeepSeek-V4 Flash widths, decode and prefill."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sgl_kernel.dsv4_moe import MoeConfig, MoeLaunch, dsv4_moe_fp8, dsv4_moe_mxfp4, fit_shared_memory, moe_config
from sgl_kernel.dsv4_moe_align import dsv4_moe_align
from sgl_kernel.dsv4_moe_ref import align_ref, dequant_mxfp4_ref, fused_moe_fp8_ref, fused_moe_mxfp4_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _experts(num_experts: int, hidden: int, inter: int, seed: int, device="cpu") -> tuple:
    g = torch.Generator(device).manual_seed(seed)  # drawn where they live: Flash widths are GBs of int32 draws

    def packed(n, k):
        codes = torch.randint(0, 256, (num_experts, n, k // 2), generator=g, dtype=torch.int32, device=device)
        scale = torch.randint(120, 126, (num_experts, n, k // 32), generator=g, dtype=torch.int32, device=device)
        return codes.to(torch.uint8), scale.to(torch.uint8)

    return (*packed(2 * inter, hidden), *packed(hidden, inter))


def _routing(tokens: int, top_k: int, num_experts: int, seed: int, skew: bool, device="cpu") -> tuple:
    g = torch.Generator().manual_seed(seed)
    if skew:  # most pairs on a few experts, some experts unused
        ids = torch.stack([torch.randperm(4, generator=g)[:top_k] for _ in range(tokens)])
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return ids.to(device), weights.to(device)


_ALIGN_CASES = [(1, 6, 16, 16, False), (37, 4, 8, 16, False), (300, 6, 32, 64, False), (37, 4, 8, 16, True),
                (1, 6, 16, 16, True), (42, 6, 256, 16, True)]


@pytest.mark.parametrize("tokens,top_k,experts,block_m,foreign,one_program", [
    (*case, one) for case in _ALIGN_CASES for one in (False, True)])
def test_align_equals_reference(tokens, top_k, experts, block_m, foreign, one_program):
    """Both sorts (torch ops; the one-program kernel, 6 to 1,800 pairs here, over 8 to 256 experts) give the
    reference's blocks, other ranks' pairs (-1) in the blocks of expert E."""
    ids, _ = _routing(tokens, top_k, experts, seed=tokens, skew=tokens == 37)
    if foreign:  # expert parallelism: the upper half of the experts is another rank's
        ids = torch.where(ids >= experts // 2, -1, ids)
    rows, block_expert = dsv4_moe_align(ids, experts, block_m, one_program=one_program)
    ref_rows, ref_experts = align_ref(ids, experts, block_m)
    if one_program:
        with pytest.raises(ValueError, match="one_program=False"):
            dsv4_moe_align(torch.zeros(16385, 1, dtype=torch.int64), experts, block_m, one_program=True)
    n = len(ref_experts)
    assert block_expert.shape[0] >= n and block_expert.shape[0] == -(-tokens * top_k // block_m) + min(experts + 1,
                                                                                                       tokens * top_k)
    assert block_expert[:n].tolist() == ref_experts and (block_expert[n:] == experts + 1).all()
    assert rows[:n * block_m].tolist() == ref_rows and (rows[n * block_m:] == -1).all()


def test_dequant_reference_values():
    codes = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2], dtype=torch.uint8)  # 32 inputs
    w = dequant_mxfp4_ref(codes, torch.tensor([[128]], dtype=torch.uint8))  # 2^1
    assert w[0, :16].tolist() == [2 * v for v in [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]]


@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter,skew,limit", [
    (1, 6, 16, 128, 64, False, 10.0),  # decode: one token, most experts unused
    (23, 4, 8, 96, 64, True, 10.0),  # skewed routing, hidden not a multiple of the 64-wide K tile
    (70, 2, 4, 64, 96, False, 0.5),  # the clamp engaged on most rows
])
def test_fused_equals_reference(tokens, top_k, experts, hidden, inter, skew, limit):
    w13, s13, w2, s2 = _experts(experts, hidden, inter, seed=hidden)
    ids, weights = _routing(tokens, top_k, experts, seed=3, skew=skew)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)) * 0.05
    got = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, limit)
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, limit)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("scaled_dot", [False, True], ids=["in-register", "scaled-dot"])
def test_other_ranks_pairs_add_nothing(scaled_dot):
    """Expert parallelism: pairs whose id is -1 (another rank's expert) add nothing and run no GEMM (their blocks are
    expert E's, which the gate-up kernel skips and the down kernel fills with zeros); MXFP4 and FP8 experts."""
    w13, s13, w2, s2 = _experts(8, 96, 64, seed=9)
    ids, weights = _routing(23, 4, 8, seed=4, skew=False)
    ids = torch.where(ids % 3 == 0, -1, ids)
    x = torch.randn(23, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    if scaled_dot:
        x = x.half()
    got = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0).float()
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    tol = 2e-3 if scaled_dot else 1e-4
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * ref.abs().max().item())
    if not scaled_dot:  # the parity planes split over K (3 gate-up splits, 2 down): each zero-fills its slice
        split = [MoeLaunch(32, 32, split_k=n, scaled_dot=False, planes=True) for n in (3, 2)]
        got_split = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=MoeConfig(16, *split))
        torch.testing.assert_close(got_split, ref, rtol=tol, atol=tol * ref.abs().max().item())
    kept = torch.where(ids < 0, 0, ids)  # the same pairs on expert 0 at weight 0: the old dispatch's result
    torch.testing.assert_close(got, fused_moe_mxfp4_ref(x, kept, torch.where(ids < 0, 0.0, weights), w13, s13, w2,
                                                        s2, 10.0), rtol=tol, atol=tol * ref.abs().max().item())
    if not scaled_dot:
        f8 = _fp8_experts(8, 96, 64, seed=9)
        got8 = dsv4_moe_fp8(x, ids, weights, *f8, 10.0)
        torch.testing.assert_close(got8, fused_moe_fp8_ref(x, ids, weights, *f8, 10.0), rtol=1e-4,
                                   atol=1e-4 * got8.abs().max().item())


def test_tma_launches_only_where_descriptors_exist(monkeypatch):
    """The decode launches take TMA copies only on NVIDIA sm90+ (tma_supported): never on the CPU, ROCm (simulated)
    or an sm80 GPU (simulated), never for one token's gate-up, prefill blocks or the in-register path."""
    from sgl_kernel import dsv4_moe as moe, dsv4_moe_general as general

    assert not moe.tma_supported(torch.device("cpu"))
    for hip, capability, want in ((None, (9, 0), True), (None, (8, 0), False), ("6.2", (9, 4), False)):
        general._TMA.clear()
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        assert moe.tma_supported(torch.device("cuda", 0)) is want, (hip, capability)
    general._TMA.clear()
    on = moe_config(48, 256, tma=True)  # 8 tokens, top-6
    assert on.block_m == 16 and on.gate_up.tma and on.down.tma
    assert not any(launch.tma for launch in (moe_config(48, 256, tma=False).gate_up, moe_config(48, 256).down))
    one = moe_config(6, 256, tma=True)
    assert not one.gate_up.tma and one.down.tma and not moe_config(6, 256, tma=False).down.tma
    assert not moe_config(4096 * 6, 256, tma=True).gate_up.tma
    assert not moe_config(48, 256, scaled_dot=False, tma=True).gate_up.tma


@pytest.mark.parametrize("config", [
    MoeConfig(32, MoeLaunch(block_n=32, block_k=128), MoeLaunch(block_n=128, block_k=32)),  # K tile past hidden
    MoeConfig(16, MoeLaunch(block_n=128, block_k=32, num_stages=1), MoeLaunch(block_n=32, block_k=64)),
    # the decode in-register tiles at the stages that fit an H100's shared memory with fp32 activations
    fit_shared_memory(moe_config(6, 256, scaled_dot=False, fp8=True), 4, True, False, 227 * 1024),
], ids=["wide-k", "wide-n", "h100-fp32-decode"])
def test_fused_launch_variants_equal_reference(config):
    """Every tile shape the sweep may pick computes the same function (K tiles wider than the hidden size, 32-wide
    ones: one scale per tile row)."""
    w13, s13, w2, s2 = _experts(8, 96, 64, seed=7)
    ids, weights = _routing(23, 4, 8, seed=3, skew=True)
    x = torch.randn(23, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    got = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=config)
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    got8 = dsv4_moe_fp8(x, ids, weights, *_fp8_experts(8, 96, 64, seed=7), 10.0, config=config)
    torch.testing.assert_close(got8, fused_moe_fp8_ref(x, ids, weights, *_fp8_experts(8, 96, 64, seed=7), 10.0),
                               rtol=1e-4, atol=1e-4 * got8.abs().max().item())


@pytest.mark.parametrize("tokens,block_m,block_k,tma", [
    (1, 16, 64, False), (23, 16, 32, False), (70, 32, 128, False), (1, 16, 64, True), (70, 32, 128, True),
    (23, 16, 32, True)])
def test_scaled_dot_equals_reference(tokens, block_m, block_k, tma):
    """fp16 activations take tl.dot_scaled (the interpreter computes fp16 exactly): the same function as the
    reference on the same fp16 inputs, K tiles of one scale group and past the hidden size, with the codes read by
    pointers and through TMA descriptors (tiles past a projection's rows, or past the tensor, only reach masked
    outputs: the second 64-row down tile of 96 outputs, the last expert's)."""
    w13, s13, w2, s2 = _experts(8, 96, 64, seed=5)
    ids, weights = _routing(tokens, 4, 8, seed=3, skew=tokens > 20)
    x = (torch.randn(tokens, 96, generator=torch.Generator().manual_seed(2)) * 0.05).half()
    launch = MoeLaunch(block_n=32 if not tma else 64, block_k=block_k, tma=tma)
    got = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=MoeConfig(block_m, launch, launch))
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


def _fp8_experts(num_experts: int, hidden: int, inter: int, seed: int, device="cpu") -> tuple:
    g = torch.Generator(device).manual_seed(seed)

    def grid(halves, n, k):
        w = torch.randn(num_experts, halves * n, k, generator=g, device=device).mul_(64).clamp_(-448, 448)
        e = torch.randint(-14, -9, (num_experts, halves, -(-n // 128), -(-k // 128)), generator=g, device=device)
        return w.to(torch.float8_e4m3fn), torch.ldexp(torch.ones(e.shape, device=device), e)

    return (*grid(2, inter, hidden), *grid(1, hidden, inter))


@pytest.mark.parametrize("tokens,block_n,block_k,swap", [(1, 32, 64, False), (23, 32, 32, True), (5, 64, 64, True),
                                                      (23, 64, 32, False)])
def test_planes_equal_reference(tokens, block_n, block_k, swap):
    """The parity planes' decode kernels (dsv4_moe_planes; the planes computed in Triton here, by PTX on a GPU)
    with the activations split by parity: the reference's function in fp32, K tiles of one scale group and more, the
    planes first in the MMA (swap) or second, scale bytes at both ends of the planes' exact range, padding rows."""
    from sgl_kernel.dsv4_moe import SCALE_MAX, SCALE_MIN

    w13, s13, w2, s2 = _experts(8, 128, 64, seed=9)
    s13[0, :3, 0], s2[1, :3, 1] = SCALE_MIN, SCALE_MAX  # the range's ends
    ids, weights = _routing(tokens, 4, 8, seed=3, skew=tokens > 20)
    x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    launch = MoeLaunch(block_n=block_n, block_k=block_k, scaled_dot=False, planes=True, swap=swap)
    got = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=MoeConfig(16, launch, launch))
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    with pytest.raises(ValueError, match="bf16 or fp32"):
        dsv4_moe_mxfp4(x.half(), ids, weights, w13, s13, w2, s2, 10.0, config=MoeConfig(16, launch, launch))


@pytest.mark.parametrize("launch", [MoeLaunch(32, 96, scaled_dot=False, planes=True),
                                    MoeLaunch(48, 64, scaled_dot=False, planes=True),
                                    MoeLaunch(32, 32, split_k=3, scaled_dot=False, planes=True)])
def test_planes_refuse_launches_that_do_not_fit(launch):
    """The planes' kernels have no masks: a launch whose tiles do not divide the widths (or whose K splits do not
    divide the K tiles) is refused by name, never run over the edge."""
    w13, s13, w2, s2 = _experts(8, 128, 64, seed=9)
    ids, weights = _routing(3, 4, 8, seed=3, skew=False)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    with pytest.raises(ValueError, match="MoeLaunch.planes .* divide"):
        dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=MoeConfig(16, launch, launch))


@pytest.mark.parametrize("hidden,planes_taken", [(128, True), (96, False)])
def test_planes_fall_back_where_widths_do_not_fit(monkeypatch, hidden, planes_taken):
    """Decode with vouched scales on a device with the PTX (simulated) takes the planes where its tiles divide the
    widths and the scaled dot / in-register path elsewhere (small test models), the reference's result both ways."""
    import sgl_kernel.dsv4_moe as moe

    monkeypatch.setattr(moe, "planes_supported", lambda device, dtype: True)
    monkeypatch.setattr(moe, "PLANES_GATE_UP", MoeLaunch(32, 64, scaled_dot=False, planes=True))
    monkeypatch.setattr(moe, "PLANES_DOWN", MoeLaunch(32, 64, scaled_dot=False, planes=True))
    calls = []
    real = moe.planes_gate_up
    monkeypatch.setattr(moe, "planes_gate_up", lambda *a, **k: calls.append(1) or real(*a, **k))
    w13, s13, w2, s2 = _experts(8, hidden, 64, seed=4)
    ids, weights = _routing(2, 4, 8, seed=3, skew=False)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(2)) * 0.05
    got = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, scales_fit_planes=True)
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert bool(calls) == planes_taken


def test_planes_only_where_chosen(monkeypatch):
    """Decode takes the planes only when the caller vouches for the scales and the device has the PTX (NVIDIA, bf16,
    not the interpreter); prefill blocks keep the scaled dot."""
    import sgl_kernel.dsv4_moe_planes as planes

    assert moe_config(6, 256, planes=True).gate_up.planes and moe_config(192, 256, planes=True).down.planes
    assert not moe_config(6, 256).gate_up.planes and not moe_config(24576, 256, planes=True).gate_up.planes
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(planes, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert planes.planes_supported(cuda, torch.bfloat16)
    assert not planes.planes_supported(cuda, torch.float16) and not planes.planes_supported(cpu, torch.bfloat16)
    monkeypatch.setattr(torch.version, "hip", "6.3")
    assert not planes.planes_supported(cuda, torch.bfloat16)


@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter", [(1, 6, 16, 256, 128), (29, 3, 6, 200, 96)])
def test_fused_fp8_experts_equal_reference(tokens, top_k, experts, hidden, inter):
    """FP8-converted experts through the same kernels: partial 128-blocks (200 inputs, 96 intermediate rows whose
    w1 and w3 grids are separate)."""
    w13, s13, w2, s2 = _fp8_experts(experts, hidden, inter, seed=inter)
    ids, weights = _routing(tokens, top_k, experts, seed=5, skew=False)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)) * 0.05
    got = dsv4_moe_fp8(x, ids, weights, w13, s13, w2, s2, 10.0)
    ref = fused_moe_fp8_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    with pytest.raises(ValueError, match="FP8 experts"):
        dsv4_moe_fp8(x, ids, weights, w13, s13[:, :1], w2, s2, 10.0)


@pytest.mark.parametrize("tokens,top_k,hidden,splits", [(1, 6, 1500, 1), (5, 2, 64, 1), (0, 6, 64, 1),
                                                        (3, 6, 1500, 2), (2, 2, 64, 3)])
def test_combine_sums_slots_in_order(tokens, top_k, hidden, splits):
    """The last step: each token's k rows (and K splits' slices) summed in slot then split order in fp32 (the same
    bits as a sequential sum) and cast to the activations' dtype in the same launch, widths past one program's block,
    no tokens."""
    from sgl_kernel.dsv4_moe_sums import combine_pairs

    pairs = torch.randn(splits, tokens * top_k, hidden, generator=torch.Generator().manual_seed(top_k))
    view = pairs.view(splits, tokens, top_k, hidden)
    seq = view[0, :, 0].clone()
    for i in range(1, top_k * splits):
        seq += view[i % splits, :, i // splits]
    given = pairs[0] if splits == 1 else pairs
    assert torch.equal(combine_pairs(given, top_k, torch.float32), seq)
    assert torch.equal(combine_pairs(given, top_k, torch.float16), seq.half())


@pytest.mark.parametrize("swap", [False, True])
def test_planes_split_k_equals_reference(swap):
    """The planes' kernels split over K (more programs, shorter K loops: one token's few experts): the gate-up's
    splits through the SwiGLU over splits, the down's slices added by combine_pairs; the reference's function in fp32,
    4 gate-up splits of one K tile each, 2 down splits, padding rows and experts nobody picks."""
    w13, s13, w2, s2 = _experts(8, 128, 64, seed=9)
    ids, weights = _routing(3, 4, 8, seed=3, skew=False)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    gate_up = MoeLaunch(32, 32, split_k=4, scaled_dot=False, planes=True, swap=swap)
    down = MoeLaunch(32, 32, split_k=2, scaled_dot=False, planes=True, swap=swap)
    got = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=MoeConfig(16, gate_up, down))
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_k_splits_only_for_the_parity_planes():
    """K splits lost at every decode size measured on the general kernels (no default took them): a launch asking for
    them there is refused by name at construction, as is a split count below 1; the planes' splits stay."""
    with pytest.raises(ValueError, match="MoeLaunch.split_k"):
        MoeLaunch(32, 32, split_k=2)
    with pytest.raises(ValueError, match="MoeLaunch.split_k"):
        MoeLaunch(32, 32, split_k=0, scaled_dot=False, planes=True)
    assert MoeLaunch(32, 32, split_k=2, scaled_dot=False, planes=True).split_k == 2


def test_scale_range_gate_of_the_planes():
    """The loader's check (scale_bytes_fit_planes): a range inside [SCALE_MIN, SCALE_MAX] fits, one past either end
    or an empty one (nothing loaded: smallest > largest) does not."""
    from sgl_kernel.dsv4_moe import SCALE_MAX, SCALE_MIN, scale_bytes_fit_planes

    assert scale_bytes_fit_planes(SCALE_MIN, SCALE_MAX) and scale_bytes_fit_planes(120, 120)
    assert not scale_bytes_fit_planes(SCALE_MIN - 1, 120) and not scale_bytes_fit_planes(120, SCALE_MAX + 1)
    assert not scale_bytes_fit_planes(256, -1)


def test_zero_tokens_and_bad_shapes():
    w13, s13, w2, s2 = _experts(4, 64, 32, seed=0)
    assert dsv4_moe_mxfp4(torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), w13, s13,
                          w2, s2, 10.0).shape == (0, 64)
    with pytest.raises(ValueError, match="do not fit"):
        dsv4_moe_mxfp4(torch.zeros(3, 96), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2), w13, s13, w2, s2,
                       10.0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens,dtype", [(1, torch.bfloat16), (32, torch.bfloat16), (4096, torch.bfloat16),
                                          (1, torch.float32)])
def test_gpu_fp8_experts_flash_widths(tokens, dtype):
    """FP8-converted experts at Flash widths in bf16: relative error below 1% vs the fp32 reference; fp32 activations
    (the oracle path) at one token launch within the GPU's shared memory (fit_shared_memory's stages)."""
    w13, s13, w2, s2 = _fp8_experts(256, 4096, 2048, seed=0, device="cuda")
    ids, weights = _routing(tokens, 6, 256, seed=1, skew=False, device="cuda")
    x = (torch.randn(tokens, 4096, device="cuda") * 0.05).to(dtype)
    got = dsv4_moe_fp8(x, ids, weights, w13, s13, w2, s2, 10.0).float()
    ref = fused_moe_fp8_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens,path", [
    (t, p) for t in (1, 8, 32, 4096) for p in ("default", "in-register", "pointers", "tma", "planes", "planes-split")
    if not (t == 4096 and p == "planes-split")])  # splits are a decode launch's
def test_gpu_flash_widths(tokens, path):
    """Flash widths (hidden 4096, intermediate 2048, top-6 of 256 experts) in bf16: relative error vs the fp32
    reference on the same bf16 inputs below 1% (bf16 intermediate rows and outputs), for the default launches
    (tl.dot_scaled; TMA copies from 8 tokens on sm90), the in-register dequantization, the scaled dot's launches
    with every code read by pointers / through TMA, and the PTX parity planes (decode; the scales in range), also split
    over K in 2 (gate-up) and 4 (down)."""
    from sgl_kernel.dsv4_moe import planes_supported

    w13, s13, w2, s2 = _experts(256, 4096, 2048, seed=0, device="cuda")
    ids, weights = _routing(tokens, 6, 256, seed=1, skew=False, device="cuda")
    x = (torch.randn(tokens, 4096, device="cuda") * 0.05).bfloat16()
    if path.startswith("planes"):
        assert planes_supported(x.device, x.dtype)
        config = None
        if path == "planes-split":
            config = moe_config(tokens * 6, 256, planes=True)
            config = MoeConfig(16, dataclasses.replace(config.gate_up, split_k=2),
                               dataclasses.replace(config.down, split_k=4))
        got = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=config, scales_fit_planes=True).float()
        ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"tokens {tokens} {path}: relative error {err:.2e}")
        assert err < 1e-2
        return
    config = None if path == "default" else moe_config(tokens * 6, 256, scaled_dot=path != "in-register")
    if path in ("pointers", "tma"):
        config = MoeConfig(config.block_m, dataclasses.replace(config.gate_up, tma=path == "tma"),
                           dataclasses.replace(config.down, tma=path == "tma"))
    got = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=config).float()
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    err = ((got - ref).norm() / ref.norm()).item()
    print(f"tokens {tokens} {path}: relative error {err:.2e}")
    assert err < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 32, 42, 128, 341])
def test_gpu_align_one_program_equals_torch_ops(tokens):
    """On the GPU (the one-program sort's home: barriers between its scratch writes and reads), Flash's 256 experts:
    the same blocks as the torch ops, other ranks' pairs included."""
    ids, _ = _routing(tokens, 6, 256, seed=tokens, skew=False, device="cuda")
    ids[0, 0] = -1
    rows, block_expert = dsv4_moe_align(ids, 256, 16, one_program=True)
    ref_rows, ref_expert = dsv4_moe_align(ids, 256, 16, one_program=False)
    assert torch.equal(rows, ref_rows) and torch.equal(block_expert, ref_expert)
