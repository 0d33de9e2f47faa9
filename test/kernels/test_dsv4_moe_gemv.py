"""The MoE's few-token decode as CUDA-core GEMVs (sgl_kernel.dsv4_moe_gemv): on the CPU the kernels under the
interpreter (Triton's own ops) against the torch reference, the activations' preparation, the dispatch, and the inline
PTX executed from its text; on a GPU (marked) the PTX path at Flash widths."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import struct

import pytest
import torch

from sgl_kernel import dsv4_moe_gemv as gemv
from sgl_kernel import dsv4_moe as moe
from sgl_kernel.dsv4_formats_ref import e2m1_values
from sgl_kernel.dsv4_moe_gemv import GemvLaunch, gemv_fits, gemv_moe, h_scale_of
from sgl_kernel.dsv4_moe import dsv4_moe_mxfp4
from sgl_kernel.dsv4_moe_ref import fused_moe_mxfp4_ref
from sgl_kernel.dsv4_mxfp4_scales import chunked

from ptx_text import run_ptx
from test_dsv4_moe import _experts, _routing

E2M1 = e2m1_values(torch.arange(16)).tolist()  # signed values of the 16 codes
PAIR_ORDER = [0, 4, 2, 6, 1, 5, 3, 7]  # the inputs of an 8-input group, as the prepared activations hold them
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _code_value(code: int) -> float:
    return E2M1[code]


def test_prepare_scales_each_token_into_range_and_orders_pairs():
    """Each token's activations times a power of two, largest |x| in [2^14, 2^15), stored fp16 in pair order; the
    multiplier times 2^-14 undoes the power exactly (a zero row and a tiny one included)."""
    x = torch.randn(5, 64) * torch.tensor([1.0, 300.0, 1e-3, 0.0, 1e-30])[:, None]
    x = x.bfloat16()
    out = torch.empty(5, 64, dtype=torch.float16)
    mult = torch.empty(5)
    gemv._prepare_kernel[(5,)](x, out, mult, 64, x.stride(0), out.stride(0), BLOCK=64, PDL=False)
    order = torch.tensor([8 * (i // 8) + PAIR_ORDER[i % 8] for i in range(64)])
    back = out.float()[:, torch.argsort(order)]  # position p holds input order[p]
    for t in range(3):
        amax = back[t].abs().max().item()
        assert 2.0 ** 14 <= amax < 2.0 ** 15, (t, amax)
        assert math.log2(mult[t].item()) == int(math.log2(mult[t].item()))  # a power of two
        assert torch.equal(back[t] * mult[t] * 2.0 ** -14, x[t].float()), t
    assert torch.equal(back[3], torch.zeros(64)) and mult[3] > 0
    assert back[4].abs().max() < 2.0 ** 15  # a tiny row: no overflow (its scaling is capped)


def test_h_scale_keeps_the_clamped_swiglu_below_fp16_range():
    for limit in (0.5, 1.0, 7.0, 10.0, 100.0):
        bound = max(limit, 1.0) * limit
        assert bound * h_scale_of(limit) < 2.0 ** 15 <= 2 * bound * h_scale_of(limit), limit


# 2 tokens: more than one token's pairs with the chunked scales (the interpreter's time grows with the tokens, and
# with the programs: 32-row tiles, the reads and sums of a row are the same in any tile)
@pytest.mark.parametrize("tokens,chunk", [(1, False), (2, True)])
def test_gemv_equals_reference(tokens, chunk):
    """The interpreter's path (Triton's ops: the same function as the PTX, fp32 sums) against the torch reference,
    with scale bytes row-major or chunked; a pair whose id is another rank's expert (-1) adds nothing."""
    w13, s13, w2, s2 = _experts(8, 256, 256, seed=3)
    ids, weights = _routing(tokens, 2, 8, seed=4, skew=False)
    x = (torch.randn(tokens, 256) * 0.1).bfloat16()
    ids[0, 1] = -1
    got = gemv_moe(x, ids, weights, w13, chunked(s13) if chunk else s13, w2, chunked(s2) if chunk else s2, 7.0, 256,
                   launch=GemvLaunch(32, 128)).float()
    keep = ids >= 0
    ref = fused_moe_mxfp4_ref(x, ids.clamp_min(0), weights * keep, w13, s13, w2, s2, 7.0)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 4e-3, err  # bf16 output; fp16 activations and h


@pytest.mark.parametrize("early, fused, one_loop", [(True, False, False), (False, True, False), (True, True, False),
                                                    (False, False, True), (True, True, True)])
def test_variants_give_the_same_bits(early, fused, one_loop):
    """The untimed chain variants compute the same function in the same order: early weights (the first K step
    loaded before the wait), sum in the down (the last program of each token's tile sums its pairs in slot order,
    counted by an atomic, counters zeroed by the gate-up), the gate-up's rows in one loop (each row's sums in the
    same order): bit-equal to the default chain in the interpreter, -1 ids included, 2 tokens (two tokens'
    counters), down tiles more than the gate-up's programs zero one each (2 per program here: 8 down tiles of 32
    rows, 4 gate-up programs)."""
    (x, ids, weights, w13, s13, w2, s2), base, ref = _default_chain()
    got = gemv_moe(x, ids, weights, w13, s13, w2, s2, 7.0, 128,
                   launch=GemvLaunch(32, 128, early_weights=early, sum_in_down=fused, gate_up_one_loop=one_loop))
    assert torch.equal(got, base)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 4e-3


@functools.lru_cache(maxsize=1)
def _default_chain() -> tuple:
    """The variants' inputs, the default chain's output and the reference: the same for every variant, computed once
    (the interpreted default chain costs as much as a variant)."""
    w13, s13, w2, s2 = _experts(8, 256, 128, seed=8)
    ids, weights = _routing(2, 2, 8, seed=9, skew=False)
    ids[1, 0] = -1
    x = (torch.randn(2, 256) * 0.1).bfloat16()
    base = gemv_moe(x, ids, weights, w13, s13, w2, s2, 7.0, 128, launch=GemvLaunch(32, 128))
    ref = fused_moe_mxfp4_ref(x, ids.clamp_min(0), weights * (ids >= 0), w13, s13, w2, s2, 7.0)
    return (x, ids, weights, w13, s13, w2, s2), base, ref


@pytest.mark.parametrize("down, fused", [((32, 64, 1), False), ((32, 64, 1), True), ((16, 128, 1), True)])
def test_down_takes_its_own_tile(down, fused):
    """GemvLaunch.down: the down's tile where it differs from the gate-up's, here beside a 256-input gate-up tile
    that the down's 128 inputs could not take (gemv_fits refuses it for both kernels); with the sum in the down, its
    counters are per down tile (8 or 16, zeroed 1 or 2 per gate-up program of 16 rows)."""
    w13, s13, w2, s2 = _experts(8, 256, 128, seed=10)
    split = GemvLaunch(16, 256, down=down, sum_in_down=fused)
    assert not gemv_fits(GemvLaunch(16, 256), 256, 128) and gemv_fits(split, 256, 128)
    ids, weights = _routing(2, 2, 8, seed=11, skew=False)
    x = (torch.randn(2, 256) * 0.1).bfloat16()
    got = gemv_moe(x, ids, weights, w13, s13, w2, s2, 7.0, 128, launch=split).float()
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 7.0)
    assert ((got - ref).norm() / ref.norm()).item() < 4e-3


def test_dispatch_takes_gemv_only_where_it_fits(monkeypatch):
    """gemv=True takes the GEMVs up to GEMV_MAX_TOKENS tokens (2 here) with tiles dividing the widths and a finite
    limit; else the MMA path. Both agree with the reference."""
    calls = []
    real = moe.gemv_moe
    monkeypatch.setattr(moe, "gemv_moe", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(moe, "GEMV_MAX_TOKENS", 2)
    monkeypatch.setattr(gemv, "GEMV_ONE", GemvLaunch(32, 128))
    monkeypatch.setattr(gemv, "GEMV_FEW", GemvLaunch(32, 128))
    w13, s13, w2, s2 = _experts(4, 128, 128, seed=5)
    for tokens, limit, want in ((2, 7.0, True), (3, 7.0, False), (1, math.inf, False)):
        ids, weights = _routing(tokens, 2, 4, seed=6, skew=False)
        x = (torch.randn(tokens, 128) * 0.1).bfloat16()
        calls.clear()
        got = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, limit, gemv=True)
        assert bool(calls) == want, (tokens, limit)
        ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, limit)
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    monkeypatch.setattr(gemv, "GEMV_ONE", GemvLaunch(8, 256))  # 256 does not divide intermediate 128: MMA path
    calls.clear()
    ids, weights = _routing(1, 2, 4, seed=7, skew=False)
    dsv4_moe_mxfp4(torch.randn(1, 128).bfloat16(), ids, weights, w13, s13, w2, s2, 7.0, gemv=True)
    assert not calls


def _f16_bits(v: float) -> int:
    return struct.unpack("<H", struct.pack("<e", v))[0]


def test_ptx_places_codes_and_sums_a_group():
    """The PTX executed from its text on random 32-input groups: its fp16x2 registers hold each code's value * 2^-14
    in pair order (bit-exact: every byte value appears), and $0 is the accumulator plus the group's dot times
    2^(s - 127) to fp16 rounding (against the exact sum)."""
    rng = random.Random(0)
    ptx = gemv._PTX.value
    # the placement alone: the first word's four registers, read before the next word overwrites them
    head = "\n".join(ptx.splitlines()[:15]) + "\n}"
    for v in range(256):
        for pos in range(4):
            b = [rng.randrange(256) for _ in range(4)]
            b[pos] = v
            word = sum(byte << (8 * i) for i, byte in enumerate(b))
            regs = run_ptx(head, {"$4": word})
            for r, (lo, hi) in enumerate(((0, 4), (2, 6), (1, 5), (3, 7))):
                for half, nib in ((regs[f"r{r}"] & 0xFFFF, lo), (regs[f"r{r}"] >> 16, hi)):
                    assert half == _f16_bits(_code_value((word >> (4 * nib)) & 15) * 2.0 ** -14), (v, pos, r)
    for _ in range(300):
        words = [rng.getrandbits(32) for _ in range(4)]
        s = rng.randrange(100, 140)
        xs = [[rng.uniform(-2.0 ** 15, 2.0 ** 15) for _ in range(8)] for _ in range(4)]
        xs = [[struct.unpack("<e", struct.pack("<e", v))[0] for v in w] for w in xs]  # fp16 values
        inputs = {"$4": words[0], "$5": words[1], "$6": words[2], "$7": words[3], "$8": s, "$28": 0x3F800000}
        for j in range(4):  # register (0, 4) of word j is $12 + j, (2, 6) $16 + j, (1, 5) $20 + j, (3, 7) $24 + j
            for r, (lo, hi) in enumerate(((0, 4), (2, 6), (1, 5), (3, 7))):
                inputs[f"${12 + 4 * r + j}"] = _f16_bits(xs[j][lo]) | _f16_bits(xs[j][hi]) << 16
        inputs.update({"$29": 7, "$30": 8, "$31": 9})
        regs = run_ptx(ptx, inputs)
        exact = sum(_code_value((words[j] >> (4 * i)) & 15) * 2.0 ** -14 * xs[j][i] for j in range(4) for i in range(8))
        got = struct.unpack("<f", struct.pack("<I", regs["$0"]))[0] - 1.0
        scale = 2.0 ** (s - 127)
        bound = 2.0 ** -7 * sum(abs(_code_value((words[j] >> (4 * i)) & 15)) * 2.0 ** -14 * abs(xs[j][i])
                                for j in range(4) for i in range(8)) * scale
        assert abs(got - exact * scale) <= bound + 1e-6, (got, exact * scale)
        assert (regs["$1"], regs["$2"], regs["$3"]) == (7, 8, 9)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_gpu_flash_widths_equal_reference(tokens):
    """Flash widths (hidden 4096, intermediate 2048, top-6 of 256 experts), bf16, the inline PTX with PDL: relative
    error vs the fp32 reference below 1%, the same bits twice, and the same from a CUDA graph's replay; each untimed
    variant (early weights, sum in the down, the gate-up in one loop or two) the same bits, eager and replayed."""
    from sgl_kernel.dsv4_moe import mxfp4_experts_of

    w13, s13, w2, s2 = _experts(256, 4096, 2048, seed=0, device="cuda")
    s13, s2 = chunked(s13), chunked(s2)  # as the experts module stores them
    ids, weights = _routing(tokens, 6, 256, seed=1, skew=False, device="cuda")
    x = (torch.randn(tokens, 4096, device="cuda") * 0.05).bfloat16()
    _, (a, b, c, d) = mxfp4_experts_of(x, w13, s13, w2, s2)
    run = lambda: gemv_moe(x, ids, weights, a, b, c, d, 10.0, 2048)  # noqa: E731
    got = run()
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, s13, w2, s2, 10.0)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    print(f"tokens {tokens}: relative error {err:.2e}")
    assert err < 1e-2
    assert torch.equal(run(), got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, got)
    for early, fused, one_loop in ((True, False, False), (False, True, False), (True, True, False),
                                   (False, False, True), (True, True, True)):
        variant = dataclasses.replace(gemv.gemv_launch(tokens), early_weights=early, sum_in_down=fused,
                                      gate_up_one_loop=one_loop)
        again = lambda: gemv_moe(x, ids, weights, a, b, c, d, 10.0, 2048, launch=variant)  # noqa: E731
        first = again()
        assert torch.equal(first, got), (early, fused, one_loop)  # one loop too: each row's sums in the same order
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = again()
        for _ in range(3):  # counters zeroed again on every replay
            replayed.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, first), (early, fused, one_loop)


_OPERAND_LAYOUTS = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from sgl_kernel import dsv4_moe_gemv as gemv

types = {"x_ptr": "*i32", "xm_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*u8", "h_ptr": "*i32",
         "wts_ptr": "*fp32", "out_ptr": "*fp32", "cnt_ptr": "*i32", "sum_ptr": "*bf16", "add_ptr": "*bf16",
         "limit": "fp32", "h_scale": "fp32", "out_scale": "fp32"}
tiles = {gemv.GemvLaunch(8, 256), gemv.GemvLaunch(16, 512, 2), gemv.GemvLaunch(4, 512, 2),
         gemv.GemvLaunch(4, 1024, 2), gemv.GemvLaunch(16, 256),  # tiles benchmark/kernels/sweep_moe_gemv.py sweeps
         gemv.GemvLaunch(4, 128)}  # too small (gemv_fits refuses it): the check must see that
# the engine's launches as they run, every sweep tile with no variant, and the variants together at 16 x 512
launches = [gemv.gemv_launch(t) for t in (1, 2, 8)] + sorted(tiles, key=str) + [
    gemv.GemvLaunch(16, 512, early_weights=True, sum_in_down=True, gate_up_one_loop=True)]
out = []
for launch in launches:
    early, fused, one = launch.early_weights, launch.sum_in_down, launch.gate_up_one_loop
    for kernel in (gemv._gate_up_kernel, gemv._down_kernel):
        n, k, warps = launch.gate_up_tile if kernel is gemv._gate_up_kernel else launch.down_tile
        consts = {"BLOCK_N": n, "BLOCK_K": k, "PTX": True, "SCALE_CHUNKED": True, "PDL": True, "EARLY": early}
        consts.update({"ZERO_PER_PROGRAM": 2 if fused else 0, "ONE_LOOP": one} if kernel is gemv._gate_up_kernel
                      else {"SUM": fused, "ADD": fused, "BF16_BITS": False})  # the shared expert's rows added
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
        floats = ("TOPK", "limit", "h_scale", "out_scale")
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                 if n not in consts and n not in floats}
        src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
        ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps}).asm["ttgir"]
        layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
        # the PTX's sites: one per K loop (the gate-up's two unless in one loop), one more each with early weights
        want = ((1 if one else 2) if kernel is gemv._gate_up_kernel else 1) * (2 if early else 1)
        sites = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line and "shf.l.wrap.b32 t" in line]
        assert len(sites) == want, (kernel.fn.__name__, launch, len(sites))
        for line in sites:
            operand = re.search(r"tensor<\d+x\d+xi32, (#[\w.]+(?:<\{[^}]*\}>)?)>", line).group(1)
            out.append([kernel.fn.__name__, str(launch), gemv.gemv_fits(launch, 4096, 2048),
                        layouts.get(operand, operand)])
print(json.dumps(out))
"""


def test_ptx_operands_pack_four_words_of_one_group():
    """The PTX sums a pack of 4 code words under the scale byte of its first: compiled for sm90 on the CPU (a
    subprocess: this one may run the interpreter) at the launches gemv_launch picks and more, each thread must hold
    its code words in runs of 4 consecutive, aligned words of one row (one 32-input group) wherever gemv_fits allows
    the launch, also with the chain's variants (early weights, sum in the down, the gate-up in one loop); the
    too-small tile it refuses does not."""
    from sm90_compile import compiled_facts
    from test_dsv4_moe_planes import packs_one_row_group

    found = compiled_facts(_OPERAND_LAYOUTS)
    assert len(found) >= 2 * 10, [f[:2] for f in found]  # every launch's kernels (their sites counted in the script)
    for name, launch, fits, layout in found:
        assert packs_one_row_group(layout) == fits, (name, launch, layout)
