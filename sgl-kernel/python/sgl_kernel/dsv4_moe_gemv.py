"""The fused MXFP4 MoE's few-token decode as GEMVs on the CUDA cores (dsv4_moe.dsv4_moe_mxfp4's `gemv=True`).

At 1-8 decode tokens the parity planes' MMA kernels (dsv4_moe_planes) pad each expert's few pairs to 16 rows, sort the
pairs, stage the codes in shared memory and hold 150-250 registers per thread. Here one program takes one (token,
expert) pair and a tile of weight rows straight from the router's ids: no sort, no padding rows, no shared memory,
~64 registers, so an SM holds dozens of programs. Each 32-bit code word (8 inputs of a row) becomes four fp16x2
registers by one rotation, two bit selects and four shift-and-masks (fp16 bits sign << 15 | (e1 e0 m) << 9: the e2m1
value * 2^-14, exact), multiplied with the activations' matching pairs and summed in fp16x2 over the 32-input scale
group; the group's sum is scaled in fp32 by 2^(s - 127): one multiply per 32 weights, any scale byte.

So that the fp16 sums stay normal and in range, the activations are scaled by a power of two per token (their largest
|x| into [2^14, 2^15); the sums' multiplier undoes it) and the SwiGLU output by a constant from the clamp's limit L
(|silu(min(g, L)) * clamp(u, -L, L)| <= max(L, 1) * L). Both are stored fp16 in the order the PTX pairs inputs: per 8
inputs (0, 4), (2, 6), (1, 5), (3, 7). The chain: prepare (scale and order), gate-up (with the clamped SwiGLU), down
(times the router weight), the pairs' sum (dsv4_moe_sums.combine_pairs, or at 1-4 tokens the down's last program per
tile: GemvLaunch.sum_in_down; either adds the shared expert's output when given one, saving the MoE's `routed +
shared` launch), as programmatic dependent launches where the GPU has them (dsv4_pdl).

Elsewhere (the CPU interpreter) the same sums are computed in fp32 with Triton's own ops: the tests check the function
there and the PTX's arithmetic from its text (test/kernels/test_dsv4_moe_gemv.py). Timings: RESULTS.md, "MoE decode:
an 11-instruction e2m1 placement from the checkpoint's order; slower in the MMA planes, faster in the GEMV probe"
(2026-12-05; the probe `benchmark/kernels/moe_gemv_probe.py` this path grew from), and "MoE decode GEMVs: each
kernel's tile, the gate-up in one loop, the chain's variants timed" (2026-12-06; `benchmark/kernels/sweep_moe_gemv.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_moe_common import e2m1_value
from sgl_kernel.dsv4_moe_sums import add_rounded, bf16_bits, check_add, clamped_swiglu, combine_pairs
from sgl_kernel.dsv4_mxfp4_scales import scale_layout, scale_offsets
from sgl_kernel.dsv4_pdl import interpreting, pdl_enter, pdl_launch, pdl_supported

# Beyond 8 tokens more pairs share an expert, whose codes a GEMV reads once per pair (an MMA once per block): not
# timed there, the planes stay.
GEMV_MAX_TOKENS = 8


@dataclass(frozen=True)
class GemvLaunch:
    """Weight rows per program, inputs per K step, warps per program (the gate-up's; `down` = the down's (rows,
    inputs, warps) where they differ), and three variants of the chain: `early_weights` (with PDL, each program loads
    its first K step of weights before waiting for the kernel before it: the expert ids were written before that
    kernel was let start), `sum_in_down` (each token's last down program per tile sums the pairs' rows, counted by an
    atomic: no combine launch; the same bits) and `gate_up_one_loop` (the gate's and up's rows of a tile in one K
    loop: twice the bytes per load step, half the steps)."""
    block_n: int
    block_k: int
    num_warps: int = 1
    early_weights: bool = False
    sum_in_down: bool = False
    down: tuple[int, int, int] | None = None
    gate_up_one_loop: bool = False

    @property
    def gate_up_tile(self) -> tuple[int, int, int]:
        return self.block_n, self.block_k, self.num_warps

    @property
    def down_tile(self) -> tuple[int, int, int]:
        return self.down or self.gate_up_tile


# The sweep's best launches on an H100 (benchmark/kernels/sweep_moe_gemv.py; RESULTS.md, 2026-12-06): one token
# 8 x 512 gate-up tiles with the gate and up rows in one loop, 16 x 512 down tiles, two warps each, early weights and
# the sum in the down (35.8 us against 38.5 for the 4 x 512 tiles alone); 2-4 tokens 16 x 512 tiles with early
# weights and the sum in the down (64.5 / 118.4 us at 2 / 4 tokens against 65.9 / 124.7); 5-8 tokens 16 x 512 alone
# (the variants lose 1-3% at 8 tokens).
GEMV_ONE = GemvLaunch(8, 512, 2, early_weights=True, sum_in_down=True, down=(16, 512, 2), gate_up_one_loop=True)
GEMV_FEW = GemvLaunch(16, 512, early_weights=True, sum_in_down=True)
GEMV_MANY = GemvLaunch(16, 512)


def gemv_launch(num_tokens: int) -> GemvLaunch:
    return GEMV_ONE if num_tokens == 1 else GEMV_FEW if num_tokens <= 4 else GEMV_MANY


def gemv_fits(launch: GemvLaunch, hidden: int, inter: int) -> bool:
    """The kernels have no masks: each kernel's tile divides its rows and inputs (gate-up: intermediate rows, hidden
    inputs; down: the reverse), and every thread holds whole 32-input groups (4 code words of one row: the PTX reads
    one scale byte per 4 words; a smaller tile is replicated across threads)."""
    def fits(tile, rows, inputs):
        n, k, warps = tile
        return rows % n == 0 and inputs % k == 0 and k % 32 == 0 and n * k // 32 >= 32 * warps

    return fits(launch.gate_up_tile, inter, hidden) and fits(launch.down_tile, hidden, inter)


def gemv_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """The GEMV path: 16-bit activations on NVIDIA GPUs (its inline PTX) or in the CPU interpreter (Triton's ops)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    return interpreting() or (device.type == "cuda" and torch.version.hip is None)


def h_scale_of(limit: float) -> float:
    """The power of two the SwiGLU output is stored times: its bound max(L, 1) * L into [2^14, 2^15)."""
    return 2.0 ** (14 - math.floor(math.log2(max(limit, 1.0) * limit)))


def e2m1_fp16_ptx(q: str) -> list:
    """PTX lines placing the 8 e2m1 codes of word q (the checkpoint's nibble order) as fp16 bits, the code's value *
    2^-14, in r0 = codes (0, 4), r1 = (2, 6), r2 = (1, 5), r3 = (3, 7) (scratch t, a, b): a rotation by 3 puts each
    code's sign 4 bits above its e1 e0 m (onto a neighbour's e1 e0 m bits); one select per half of the codes takes
    their e1 e0 m from q and the rest from the rotation; each register is then one shift or rotation and one mask (11
    integer instructions per 8 codes)."""
    return [f"shf.l.wrap.b32 t, {q}, {q}, 3;", f"lop3.b32 a, {q}, t, 0x07070707, 0xE4;",
            f"lop3.b32 b, {q}, t, 0x70707070, 0xE4;", "shl.b32 t, a, 9;", "and.b32 r0, t, 0x8E008E00;",
            "shl.b32 t, a, 1;", "and.b32 r1, t, 0x8E008E00;", "shl.b32 t, b, 5;", "and.b32 r2, t, 0x8E008E00;",
            "shf.r.wrap.b32 t, b, b, 3;", "and.b32 r3, t, 0x8E008E00;"]


def _fold_ptx() -> str:
    """pack=4: 4 code words of one row's 32-input group ($4-$7), its scale byte ($8; $9-$11 repeat it), the
    activations' fp16x2 pairs (0, 4) $12-$15, (2, 6) $16-$19, (1, 5) $20-$23, (3, 7) $24-$27 (one per word), the fp32
    accumulators $28-$31. $0 = $28 + the group's dot * 2^(s - 127); $1-$3 pass $29-$31 through. Each word's codes
    placed by e2m1_fp16_ptx."""
    lines = ["{", ".reg .b32 t, a, b, r0, r1, r2, r3, c0, c1;", ".reg .b16 lo, hi;", ".reg .f32 f0, f1, f2, f3;"]
    for j in range(4):
        lines += e2m1_fp16_ptx(f"${4 + j}")
        acc = f"c{j % 2}"
        lines.append(f"mul.rn.f16x2 {acc}, r0, ${12 + j};" if j < 2 else f"fma.rn.f16x2 {acc}, r0, ${12 + j}, {acc};")
        lines += [f"fma.rn.f16x2 {acc}, r{i}, ${12 + 4 * i + j}, {acc};" for i in range(1, 4)]
    lines += ["mov.b32 {lo, hi}, c0;", "cvt.f32.f16 f0, lo;", "cvt.f32.f16 f1, hi;", "mov.b32 {lo, hi}, c1;",
              "cvt.f32.f16 f2, lo;", "cvt.f32.f16 f3, hi;", "add.f32 f0, f0, f1;", "add.f32 f2, f2, f3;",
              "add.f32 f0, f0, f2;", "shl.b32 t, $8, 23;", "mov.b32 f1, t;", "fma.rn.f32 $0, f0, f1, $28;",
              "mov.b32 $1, $29;", "mov.b32 $2, $30;", "mov.b32 $3, $31;", "}"]
    return "\n".join(lines)


_PTX = tl.constexpr(_fold_ptx())
_CONS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 28))


@triton.jit
def slot(i):
    """Where input i sits among its 8-input group's pair-ordered activations (0, 4, 2, 6, 1, 5, 3, 7: a 3-bit
    reversal, its own inverse)."""
    j = i % 8
    return i - j + (j % 2) * 4 + (j // 2 % 2) * 2 + j // 4


@triton.jit
def pair_words(x_row, wi, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """The pair-ordered activations of the WORDS code words wi as four int32 words each ((0, 4), (2, 6), (1, 5),
    (3, 7)), broadcast over BLOCK_N rows."""
    x0 = tl.broadcast_to(tl.load(x_row + 4 * wi)[None, :], [BLOCK_N, WORDS])
    x1 = tl.broadcast_to(tl.load(x_row + 4 * wi + 1)[None, :], [BLOCK_N, WORDS])
    x2 = tl.broadcast_to(tl.load(x_row + 4 * wi + 2)[None, :], [BLOCK_N, WORDS])
    x3 = tl.broadcast_to(tl.load(x_row + 4 * wi + 3)[None, :], [BLOCK_N, WORDS])
    return x0, x1, x2, x3


@triton.jit
def _half(v, HIGH: tl.constexpr):
    """The low or high fp16 of int32 words, as fp32."""
    if HIGH:
        v = v >> 16
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _weight_tile(w_e, s_e, r0, k0, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SCALE_CHUNKED: tl.constexpr, PAIRED: tl.constexpr, up):
    """Rows r0 .. r0 + BLOCK_N's code words at inputs k0 .. k0 + BLOCK_K [BLOCK_N, BLOCK_K / 8] int32, and each
    word's scale byte (its 32-input group's) as int32 of the same shape. PAIRED: BLOCK_N / 2 gate rows from r0,
    alternating with their up rows (`up` rows further)."""
    if PAIRED:
        j = tl.arange(0, BLOCK_N)
        rows = r0 + j // 2 + (j % 2) * up
    else:
        rows = r0 + tl.arange(0, BLOCK_N)
    wi = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    q = tl.load(w_e + rows[:, None] * stride_wn + wi[None, :])
    gi = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(s_e + scale_offsets(rows, gi, stride_sn, SCALE_CHUNKED)).to(tl.int32)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, BLOCK_K // 32, 4]), [BLOCK_N, BLOCK_K // 8])
    return q, s


@triton.jit
def _tile_dots(q, s, x_row, acc, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K / 8] fp32 plus a weight tile's code words (q, s: _weight_tile at inputs k0 ..) dotted
    with the pair-ordered activations (x_row: int32 words, two fp16 each), each times its group's scale 2^(s - 127),
    in units of 2^-14 (the caller's multipliers finish). The caller sums acc over its last axis once, after its loop."""
    wi = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    if PTX:
        x0, x1, x2, x3 = pair_words(x_row, wi, BLOCK_N, BLOCK_K // 8)
        acc = tl.inline_asm_elementwise(_PTX, _CONS, [q, s, x0, x1, x2, x3, acc], dtype=tl.float32, is_pure=True,
                                        pack=4)
    else:
        word = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        for j in tl.static_range(4):  # the pair (a, a + 4) in register j: a = 0, 2, 1, 3
            a = (j % 2) * 2 + j // 2
            xj = tl.load(x_row + 4 * wi + j)
            word += e2m1_value((q >> (4 * a)) & 15) * _half(xj, False)[None, :]
            word += e2m1_value((q >> (4 * a + 16)) & 15) * _half(xj, True)[None, :]
        acc += word * (2.0 ** -14) * (s << 23).to(tl.float32, bitcast=True)
    return acc


@triton.jit
def _row_sums(w_e, s_e, x_row, r0, K, q0, s0, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PTX: tl.constexpr, SCALE_CHUNKED: tl.constexpr, EARLY: tl.constexpr, PAIRED: tl.constexpr, up):
    """[BLOCK_N] fp32: rows r0 .. r0 + BLOCK_N (PAIRED: _weight_tile's gate and up rows) dotted with the activations
    over all K inputs, units of 2^-14. EARLY: the first K step's tile is (q0, s0), loaded by the caller before its PDL
    wait (else they are unused)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    if EARLY:
        acc = _tile_dots(q0, s0, x_row, acc, 0, BLOCK_N, BLOCK_K, PTX)
        first: tl.constexpr = BLOCK_K
    else:
        first: tl.constexpr = 0
    for k0 in range(first, K, BLOCK_K):
        q, s = _weight_tile(w_e, s_e, r0, k0, stride_wn, stride_sn, BLOCK_N, BLOCK_K, SCALE_CHUNKED, PAIRED, up)
        acc = _tile_dots(q, s, x_row, acc, k0, BLOCK_N, BLOCK_K, PTX)
    return tl.sum(acc, axis=1)


@triton.jit
def _prepare_kernel(x_ptr, out_ptr, mult_ptr, D, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One token per program: x times 2^k (its largest |x| into [2^14, 2^15)) as fp16 in pair order, and its sums'
    multiplier 2^(14 - k) (the codes' 2^-14 undone too)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < D
    x = tl.load(x_ptr + t * stride_x + i, mask=ok, other=0.0).to(tl.float32)
    # the largest |x|'s biased exponent ex: it lies in [2^(ex - 127), 2^(ex - 126)); zeros and tiny rows take 14
    ex = tl.maximum((tl.max(tl.abs(x), axis=0).to(tl.int32, bitcast=True) >> 23) & 255, 14)
    scale = ((268 - ex) << 23).to(tl.float32, bitcast=True)  # 2^k, k = 141 - ex
    tl.store(out_ptr + t * stride_o + slot(i), (x * scale).to(tl.float16), mask=ok)
    tl.store(mult_ptr + t, (ex << 23).to(tl.float32, bitcast=True))  # 2^(ex - 127) = 2^(14 - k)


@triton.jit
def _pair_expert(ids_ptr, E):
    """This program's pair (program_id(1)), its expert id, and whether this rank holds that expert."""
    p = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    return p, e, (e >= 0) & (e < E)


@triton.jit
def _gate_up_kernel(x_ptr, xm_ptr, ids_ptr, w_ptr, s_ptr, h_ptr, cnt_ptr, D, I, E, TOPK, DOWN_TILES, stride_x,
                    stride_we, stride_wn, stride_se, stride_sn, stride_h, limit, h_scale, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PTX: tl.constexpr, SCALE_CHUNKED: tl.constexpr, PDL: tl.constexpr,
                    EARLY: tl.constexpr, ZERO_PER_PROGRAM: tl.constexpr, ONE_LOOP: tl.constexpr):
    """program_id(1) = pair, program_id(0) = a tile of BLOCK_N gate rows: their gate and up sums, the clamped SwiGLU
    times h_scale, stored fp16 in pair order (the down's activations). EARLY: the first K step's weights are loaded
    before the PDL wait (the ids were written before the previous kernel, the prepare, was let start).
    ZERO_PER_PROGRAM > 0: the programs of each token's first pair zero that many of the token's down counters each
    (the down's sum_in_down). ONE_LOOP: the gate and up rows in one K loop (each step loads both, alternating rows),
    not one loop after the other."""
    if EARLY:
        p, e, local = _pair_expert(ids_ptr, E)
        r0 = tl.program_id(0) * BLOCK_N
        e0 = tl.where(local, e, 0)  # a pair without a local expert loads expert 0's first tile, unused
        w0, s0 = w_ptr + e0 * stride_we, s_ptr + e0 * stride_se
        if ONE_LOOP:
            qg, sg = _weight_tile(w0, s0, r0, 0, stride_wn, stride_sn, 2 * BLOCK_N, BLOCK_K, SCALE_CHUNKED, True, I)
            qu, su = 0, 0  # unused
        else:
            qg, sg = _weight_tile(w0, s0, r0, 0, stride_wn, stride_sn, BLOCK_N, BLOCK_K, SCALE_CHUNKED, False, 0)
            qu, su = _weight_tile(w0, s0, I + r0, 0, stride_wn, stride_sn, BLOCK_N, BLOCK_K, SCALE_CHUNKED, False, 0)
        pdl_enter(PDL)
    else:  # the order the default launches were timed in
        pdl_enter(PDL)
        p, e, local = _pair_expert(ids_ptr, E)
        qg, sg, qu, su = 0, 0, 0, 0  # unused
    if ZERO_PER_PROGRAM > 0:
        if p % TOPK == 0:
            c = tl.program_id(0) * ZERO_PER_PROGRAM + tl.arange(0, ZERO_PER_PROGRAM)
            tl.store(cnt_ptr + (p // TOPK) * DOWN_TILES + c, tl.zeros([ZERO_PER_PROGRAM], tl.int32),
                     mask=c < DOWN_TILES)
    if local:
        r0 = tl.program_id(0) * BLOCK_N
        w_e = w_ptr + e * stride_we
        s_e = s_ptr + e * stride_se
        x_row = x_ptr + (p // TOPK).to(tl.int64) * stride_x
        if ONE_LOOP:
            gu = _row_sums(w_e, s_e, x_row, r0, D, qg, sg, stride_wn, stride_sn, 2 * BLOCK_N, BLOCK_K, PTX,
                           SCALE_CHUNKED, EARLY, True, I)
            g, u = tl.split(tl.reshape(gu, [BLOCK_N, 2]))
        else:
            g = _row_sums(w_e, s_e, x_row, r0, D, qg, sg, stride_wn, stride_sn, BLOCK_N, BLOCK_K, PTX, SCALE_CHUNKED,
                          EARLY, False, 0)
            u = _row_sums(w_e, s_e, x_row, I + r0, D, qu, su, stride_wn, stride_sn, BLOCK_N, BLOCK_K, PTX,
                          SCALE_CHUNKED, EARLY, False, 0)
        xm = tl.load(xm_ptr + p // TOPK)
        act = clamped_swiglu(g * xm, u * xm, limit) * h_scale
        tl.store(h_ptr + p.to(tl.int64) * stride_h + slot(r0 + tl.arange(0, BLOCK_N)), act.to(tl.float16))


@triton.jit
def _down_kernel(h_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, out_ptr, cnt_ptr, sum_ptr, add_ptr, D, I, E, TOPK, stride_h,
                 stride_we, stride_wn, stride_se, stride_sn, stride_o, stride_sum, stride_add, out_scale,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr, SCALE_CHUNKED: tl.constexpr,
                 PDL: tl.constexpr, EARLY: tl.constexpr, SUM: tl.constexpr, ADD: tl.constexpr,
                 BF16_BITS: tl.constexpr):
    """program_id(1) = pair, program_id(0) = a tile of BLOCK_N output rows: the pair's down rows times its router
    weight and out_scale, fp32 (zeros for a pair without a local expert). EARLY: the first K step's weights are
    loaded before the PDL wait (ids were written before the gate-up was let start). SUM: the token's last program of
    this tile to finish (counted in cnt_ptr, zeroed by the gate-up) sums its TOPK pairs' rows in slot order, as
    combine_pairs does, into sum_ptr in sum_ptr's dtype; ADD: plus the token's row of add_ptr, as combine_pairs adds
    it (dsv4_moe_sums.add_rounded)."""
    if EARLY:
        p, e, local = _pair_expert(ids_ptr, E)
        e0 = tl.where(local, e, 0)
        q0, s0 = _weight_tile(w_ptr + e0 * stride_we, s_ptr + e0 * stride_se, tl.program_id(0) * BLOCK_N, 0,
                              stride_wn, stride_sn, BLOCK_N, BLOCK_K, SCALE_CHUNKED, False, 0)
        pdl_enter(PDL)
    else:  # the order the default launches were timed in
        pdl_enter(PDL)
        p, e, local = _pair_expert(ids_ptr, E)
        q0, s0 = 0, 0  # unused
    r0 = tl.program_id(0) * BLOCK_N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if local:
        w_e = w_ptr + e * stride_we
        s_e = s_ptr + e * stride_se
        h_row = h_ptr + p.to(tl.int64) * stride_h
        acc = _row_sums(w_e, s_e, h_row, r0, I, q0, s0, stride_wn, stride_sn, BLOCK_N, BLOCK_K, PTX, SCALE_CHUNKED,
                        EARLY, False, 0)
        acc = acc * (tl.load(wts_ptr + p) * out_scale)
    n = r0 + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + p.to(tl.int64) * stride_o + n, acc)
    if SUM:
        t = p // TOPK
        tl.debug_barrier()  # every thread's row stored before the count releases them
        arrived = tl.atomic_add(cnt_ptr + t * tl.num_programs(0) + tl.program_id(0), 1, sem="acq_rel")
        if arrived == TOPK - 1:  # the other pairs' rows are visible (acquire): sum them from L2 in slot order
            rows = out_ptr + (t * TOPK).to(tl.int64) * stride_o + n
            total = tl.load(rows, cache_modifier=".cg")
            for i in range(1, TOPK):
                total += tl.load(rows + i * stride_o, cache_modifier=".cg")
            total = add_rounded(total, add_ptr + t.to(tl.int64) * stride_add + n, n < D, sum_ptr.dtype.element_ty,
                                ADD, BF16_BITS)
            tl.store(sum_ptr + t.to(tl.int64) * stride_sum + n, total)


def gemv_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
             s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float, inter: int,
             launch: GemvLaunch | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE of x [T, D] (bf16 / fp16) through GEMVs: w13 uint8 [E, 2I, D/2], w2 uint8 [E, D, I/2] and their scale
    bytes (row-major or chunked: dsv4_mxfp4_scales) as dsv4_moe.dsv4_moe_mxfp4 takes them; limit finite and
    positive. -> [T, D] in x's dtype, plus `add` [T, D] (x's dtype: the shared expert's output) if given, added as
    combine_pairs adds it. A pair whose expert id is outside [0, E) adds nothing (experts held by other ranks)."""
    tokens, hidden = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    launch = launch or gemv_launch(tokens)
    if not gemv_fits(launch, hidden, inter) or not (0 < limit < math.inf):
        raise ValueError(f"the GEMV MoE takes tiles dividing hidden {hidden} / intermediate {inter} and a finite "
                         f"positive limit, got {launch} and limit {limit}")
    check_add(add, tokens, hidden, x.dtype)
    ptx = not interpreting()
    pdl = pdl_supported(x.device)
    pairs = tokens * top_k
    xq = torch.empty(tokens, hidden, dtype=torch.float16, device=x.device)
    xm = torch.empty(tokens, dtype=torch.float32, device=x.device)
    _prepare_kernel[(tokens,)](x, xq, xm, hidden, x.stride(0), xq.stride(0), BLOCK=triton.next_power_of_2(hidden),
                               PDL=pdl, num_warps=4, **pdl_launch(pdl))
    ids = topk_ids.reshape(-1)
    wts = topk_weights.reshape(-1).float()
    w13i, w2i = w13.view(torch.int32), w2.view(torch.int32)
    s13e, s13n, ch13 = scale_layout(s13)
    s2e, s2n, ch2 = scale_layout(s2)
    h_scale = h_scale_of(limit)
    h = torch.empty(pairs, inter, dtype=torch.float16, device=x.device)
    xw = xq.view(torch.int32)
    n, k, warps = launch.gate_up_tile
    dn, dk, dwarps = launch.down_tile
    early, fused, one_loop = launch.early_weights, launch.sum_in_down, launch.gate_up_one_loop
    down_tiles = hidden // dn
    counters = torch.empty(tokens, down_tiles, dtype=torch.int32, device=x.device) if fused else ids
    zero_per_program = triton.next_power_of_2(triton.cdiv(down_tiles, inter // n)) if fused else 0
    _gate_up_kernel[(inter // n, pairs)](
        xw, xm, ids, w13i, s13, h, counters, hidden, inter, num_experts, top_k, down_tiles, xw.stride(0),
        w13i.stride(0), w13i.stride(1), s13e, s13n, h.stride(0), float(limit), h_scale, BLOCK_N=n, BLOCK_K=k, PTX=ptx,
        SCALE_CHUNKED=ch13, PDL=pdl, EARLY=early, ZERO_PER_PROGRAM=zero_per_program, ONE_LOOP=one_loop,
        num_warps=warps, **pdl_launch(pdl))
    hw = h.view(torch.int32)
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    summed = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device) if fused else out
    added = fused and add is not None
    _down_kernel[(down_tiles, pairs)](
        hw, ids, wts, w2i, s2, out, counters, summed, add if added else summed, hidden, inter, num_experts, top_k,
        hw.stride(0), w2i.stride(0), w2i.stride(1), s2e, s2n, out.stride(0), summed.stride(0),
        add.stride(0) if added else 0, 2.0 ** 14 / h_scale, BLOCK_N=dn, BLOCK_K=dk, PTX=ptx, SCALE_CHUNKED=ch2,
        PDL=pdl, EARLY=early, SUM=fused, ADD=added, BF16_BITS=bf16_bits(x.dtype, x.device), num_warps=dwarps,
        **pdl_launch(pdl))
    return summed if fused else combine_pairs(out, top_k, x.dtype, pdl, add)
