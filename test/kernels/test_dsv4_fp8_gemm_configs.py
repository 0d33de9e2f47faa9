"""The FP8 block GEMM's launch configurations (sgl_kernel.dsv4_fp8_gemm: Fp8GemmConfig, the FP8_GEMM_TUNED table,
benchmark/kernels/sweep_fp8_decode.py's grid): every configuration the sweep may pick computes the reference's
product; the table is looked up by (shape, row tier) for W8A8 launches only, today's rule elsewhere; the sweep's
printed table is the Python the kernel takes. GPU (skipped without CUDA): the grid at Flash shapes against the fp32
product, and a tuned launch under CUDA-graph replay."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton

import sgl_kernel.dsv4_fp8_gemm as kernels
from sgl_kernel.dsv4_fp8_gemm import Fp8GemmConfig, Fp8GemmTuned, _config, _launch, dsv4_fp8_act_quant
from sgl_kernel.dsv4_fp8_gemm_ref import fp8_block_linear_ref

from benchmark_module import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


sweep = load_benchmark("sweep_fp8_decode")


def _operands(m: int, groups: int, n: int, k: int, seed: int, device="cpu") -> tuple:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(groups * n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    e = torch.randint(-12, -4, (-(-groups * n // 128), -(-k // 128)), generator=g)
    x = torch.randn(m, groups * k, generator=g)
    return x.to(device), w.to(device), torch.ldexp(torch.ones(e.shape), e).to(device)


def _splits_of(cfg: Fp8GemmConfig, m: int, n: int, kb: int, groups: int, device: torch.device) -> int:
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m) * groups
    return triton.cdiv(kb, triton.cdiv(kb, kernels._splits(tiles, kb, device, cfg.programs_per_sm)))


@pytest.mark.parametrize("block_m", sorted({bm for tiles in sweep.BLOCK_M.values() for bm in tiles}))
def test_every_sweep_config_equals_reference(block_m):
    """Every configuration of the sweep's grid with this row tile (BLOCK_N x programs per SM x TMA; the warps and
    stages, which the interpreter ignores, cycled through) computes the fp32 product of the same FP8 operands: two
    groups of 80 outputs (tiles crossing into the next group's rows), a partial last K block (528 = 4 * 128 + 16),
    one and two K splits. Configurations that launch alike are run once; TMA equals pointer loads bit for bit."""
    groups, n, k, m = 2, 80, 528, 5
    x, w, ws = _operands(m, groups, n, k, seed=block_m)
    a, a_s = dsv4_fp8_act_quant(x, groups)
    ref = fp8_block_linear_ref(x, w, ws, groups)
    warps_stages = [(wa, st) for wa in sweep.WARPS for st in sweep.STAGES]
    seen, splits_run = {}, set()
    for i, (bn, per_sm, tma) in enumerate((bn, p, t) for bn in sweep.BLOCK_N for p in sweep.PROGRAMS_PER_SM
                                          for t in (False, True)):
        cfg = Fp8GemmConfig(block_m, bn, *warps_stages[i % len(warps_stages)], per_sm, tma)
        splits = _splits_of(cfg, m, n, triton.cdiv(k, 128), groups, a.device)
        if (bn, splits, tma) in seen:
            continue
        got = _launch(a, a_s, w, ws, groups, torch.float32, config=cfg)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=str(cfg))
        seen[(bn, splits, tma)] = got
        splits_run.add(splits)
        if tma:
            assert torch.equal(got, seen[(bn, splits, False)]), cfg
    assert splits_run == {1, 2}


def test_default_rule_is_unchanged(monkeypatch):
    """With no table entry (the table emptied: it lists this shape): BLOCK_M 16 x BLOCK_N 64 up to 16 rows, 64 x 64
    up to 64 (fp32 activations 2 stages), K split for twice the SMs; 128 x 128 at 8 warps beyond, unsplit."""
    for m, a_bytes, want in [(1, 1, (16, 64, 4, 4, 2)), (16, 2, (16, 64, 4, 4, 2)), (17, 1, (64, 64, 4, 4, 2)),
                             (64, 4, (64, 64, 4, 2, 2)), (65, 1, (128, 128, 8, 3, 0)), (4096, 4, (128, 128, 8, 1, 0))]:
        monkeypatch.setattr(kernels, "FP8_GEMM_TUNED", ())
        cfg = _config(m, a_bytes, 1536, 4096, 1)
        assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm, cfg.tma) == \
            (*want, False), (m, a_bytes)


def test_splits_reach_the_programs_per_sm():
    """K splits so that tiles x splits reach about programs_per_sm x the SMs (4 on the CPU), at least 2 K blocks a
    split; 0 programs per SM: one split."""
    cpu = torch.device("cpu")
    assert [kernels._splits(2, 64, cpu, p) for p in (0, 1, 2, 4, 8)] == [1, 2, 4, 8, 16]
    assert kernels._splits(2, 6, cpu, 8) == 3 and kernels._splits(100, 64, cpu, 8) == 1


def _recorded_launches(monkeypatch) -> list:
    """The block GEMM's launches from here on, as the keyword arguments (constexprs, warps, stages, grid) they ran
    with."""
    launches = []
    kind = type(kernels._fp8_block_gemm_kernel)  # JITFunction, or the interpreter's
    real = kind.run

    def run(self, *args, **kw):
        if self.fn.__name__ == "_fp8_block_gemm_kernel":
            launches.append(kw)
        return real(self, *args, **kw)

    monkeypatch.setattr(kind, "run", run)
    return launches


def test_tuned_table_picks_the_launch_by_shape_and_row_tier(monkeypatch):
    """A W8A8 launch of a listed shape runs its tier's configuration (tile, warps, stages, K splits for its programs
    per SM, TMA): 2-8 rows the 8-row entry, 1 row the 1-row entry; 9 rows (no 32-row entry), another shape and W8A16
    keep the rule. The tuned launch computes the same product."""
    groups, n, k = 2, 80, 1040  # 9 K blocks
    tuned8 = Fp8GemmConfig(16, 32, 2, 6, 8, True)
    tuned1 = Fp8GemmConfig(32, 128, 8, 3, 0, False)
    monkeypatch.setattr(kernels, "FP8_GEMM_TUNED", (Fp8GemmTuned(n, k, groups, 8, tuned8),
                                                    Fp8GemmTuned(n, k, groups, 1, tuned1)))
    rule = kernels._default_config(8, 1)
    assert [_config(m, 1, n, k, groups) for m in (1, 2, 8, 9)] == [tuned1, tuned8, tuned8, rule]
    assert _config(8, 1, n, k, 1) == rule and _config(8, 2, n, k, groups) == rule  # other shape; W8A16
    x, w, ws = _operands(9, groups, n, k, seed=1)
    launches = _recorded_launches(monkeypatch)
    for m in (1, 3, 9):
        got = kernels.dsv4_fp8_block_gemm(x[:m].contiguous(), w, ws, groups, out_dtype=torch.float32)
        ref = fp8_block_linear_ref(x[:m], w, ws, groups)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    kernels.dsv4_fp8_block_gemm(x[:3].contiguous(), w, ws, groups, quantize_act=False)
    seen = [(kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"], kw["TMA"], kw["grid"][2] // groups)
            for kw in launches]
    kb = triton.cdiv(k, 128)
    assert seen == [(32, 128, 8, 3, False, 1),
                    (16, 32, 2, 6, True, _splits_of(tuned8, 3, n, kb, groups, x.device)),
                    (16, 64, 4, 4, False, _splits_of(rule, 9, n, kb, groups, x.device)),
                    (16, 64, 4, 4, False, _splits_of(rule, 3, n, kb, groups, x.device))]
    # 6 tiles: 8 programs per SM on 4 SMs want 6 splits, 2 K blocks a split allow 4, of 3 blocks (9 = 3 x 3): 3;
    # the rule's 4 tiles at 2 per SM: 2
    assert seen[1][5] == 3 and seen[3][5] == 2


def test_tuned_tma_needs_a_weight_that_allows_it(monkeypatch):
    """A tuned configuration's TMA is skipped (pointer loads) where the weight allows no descriptor (K not a multiple
    of 16), where a caller's tma=True is refused; tma=False overrides the table."""
    groups, n, k = 1, 64, 600
    cfg = Fp8GemmConfig(16, 32, 4, 4, 2, True)
    monkeypatch.setattr(kernels, "FP8_GEMM_TUNED", (Fp8GemmTuned(n, k, groups, 8, cfg),))
    x, w, ws = _operands(4, groups, n, k, seed=2)
    launches = _recorded_launches(monkeypatch)
    got = kernels.dsv4_fp8_block_gemm(x, w, ws, groups, out_dtype=torch.float32)
    ref = fp8_block_linear_ref(x, w, ws, groups)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.dsv4_fp8_block_gemm(x, w, ws, groups, tma=True)
    x2, w2, ws2 = _operands(4, groups, n, 512, seed=3)
    monkeypatch.setattr(kernels, "FP8_GEMM_TUNED", (Fp8GemmTuned(n, 512, groups, 8, cfg),))
    kernels.dsv4_fp8_block_gemm(x2, w2, ws2, groups)
    kernels.dsv4_fp8_block_gemm(x2, w2, ws2, groups, tma=False)
    assert [(kw["BLOCK_N"], kw["TMA"]) for kw in launches] == [(32, False), (32, True), (32, False)]


def test_tuned_table_rejects_rows_off_the_tiers(monkeypatch):
    monkeypatch.setattr(kernels, "FP8_GEMM_TUNED", (Fp8GemmTuned(64, 128, 1, 5, Fp8GemmConfig(16, 64, 4, 4)),))
    with pytest.raises(ValueError, match="tier"):
        _config(5, 1, 64, 128, 1)


def test_sweep_prints_the_table_the_kernel_takes():
    """The sweep's printed winners, pasted, are the entries (positional Python under 120 columns)."""
    winners = [(Fp8GemmTuned(40960, 1024, 1, 128, Fp8GemmConfig(128, 128, 8, 6, 8, True)), "wq_b_indexer: 1.25x, 0.81"),
               (Fp8GemmTuned(1536, 4096, 1, 1, Fp8GemmConfig(16, 32, 2, 3, 4, False)), "")]
    source = sweep.table_source(winners, "sweep_fp8_decode.py, NVIDIA H100 80GB HBM3: gain, fraction of copy")
    assert all(len(line) <= 120 for line in source.splitlines()), source
    scope = {"Fp8GemmTuned": Fp8GemmTuned, "Fp8GemmConfig": Fp8GemmConfig}
    exec(source, scope)
    assert scope["FP8_GEMM_TUNED"] == tuple(e for e, _ in winners)


def test_sweep_grid_is_pruned_in_stages():
    """Stage 1 tries each row tile x BLOCK_N x programs per SM x TMA at one warps / stages; stage 2 warps x stages
    at its best: the grid the CPU test above covers."""
    first = sweep.stage1(32, tma=True)
    assert len(first) == 2 * len(sweep.BLOCK_N) * len(sweep.PROGRAMS_PER_SM) * 2
    assert {c.block_m for c in first} == {16, 32}
    assert sweep.stage1(32, tma=False) == [c for c in first if not c.tma]
    second = sweep.stage2(first[0])
    assert len(set(second)) == len(sweep.WARPS) * len(sweep.STAGES)
    assert {dataclasses.replace(c, num_warps=4, num_stages=4) for c in second} == {first[0]}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name,n,k,groups,m", [("wq_kv_a", 1536, 4096, 1, 1), ("wo_a", 1024, 4096, 8, 8),
                                              ("wq_b_indexer", 40960, 1024, 1, 32)])
def test_gpu_sweep_configs_at_flash_shapes(name, n, k, groups, m):
    """The sweep's stage-1 grid and its warps x stages corners, with and without TMA, at Flash decode shapes: bf16
    output within 1% of the fp32 product of the same FP8 operands (measured ~0.3% on the rule's); launches repeat
    bit for bit. Prints which configurations of equal K splits give the rule's bits."""
    x, w, ws = _operands(m, groups, n, k, seed=n + m, device="cuda")
    x = x.bfloat16()
    a, a_s = dsv4_fp8_act_quant(x, groups)
    ref = fp8_block_linear_ref(x, w, ws, groups)
    rule = kernels._default_config(m, 1)
    base = _launch(a, a_s, w, ws, groups, torch.bfloat16, config=rule)
    first = sweep.stage1(m, tma=True)
    corners = [dataclasses.replace(c, num_warps=wa, num_stages=st) for c in first[::15] for wa, st in ((2, 3), (8, 6))]
    same = []
    for cfg in first + corners:
        got = _launch(a, a_s, w, ws, groups, torch.bfloat16, config=cfg)
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (cfg, err)
        assert torch.equal(_launch(a, a_s, w, ws, groups, torch.bfloat16, config=cfg), got), cfg
        kb = triton.cdiv(k, 128)
        if _splits_of(cfg, m, n, kb, groups, a.device) == _splits_of(rule, m, n, kb, groups, a.device):
            same.append((sweep.label(cfg), torch.equal(got, base)))
    print(f"{name} m {m}: same splits as the rule, rule's bits: {[c for c, eq in same if eq]}; "
          f"other bits: {[c for c, eq in same if not eq]}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tma", [False, True])
def test_gpu_tuned_launch_graph_replays(monkeypatch, tma):
    """A W8A8 launch by a tuned table entry (K split for 8 programs per SM, 2 warps, 6 stages), captured in a CUDA
    graph and replayed on new rows, equals its plain launch bit for bit and leaves the split counters at zero."""
    from graph_replays import assert_replays_equal

    groups, n, k, m = 8, 1024, 4096, 4
    monkeypatch.setattr(kernels, "FP8_GEMM_TUNED",
                        (Fp8GemmTuned(n, k, groups, 8, Fp8GemmConfig(16, 32, 2, 6, 8, tma)),))
    x, w, ws = _operands(m, groups, n, k, seed=5, device="cuda")
    x = x.bfloat16()
    run = lambda: kernels.dsv4_fp8_block_gemm(x, w, ws, groups)  # noqa: E731
    run()  # warm-up: compiled, counters allocated
    rows = lambda seed: (torch.randn(m, groups * k, generator=torch.Generator().manual_seed(seed)).to(x),)  # noqa
    assert_replays_equal(run, run, (x,), rows, seeds=range(3))
    torch.cuda.synchronize()
    assert not kernels._COUNTERS[("cuda", x.device.index)][-1].any()
