"""The parity planes' PTX (sgl_kernel.dsv4_moe_planes) on the CPU: its scale multiplier's arithmetic, and the compiled
operand layout it relies on (the planes' kernels against the reference, and the GPU tests of their products, are in
test_dsv4_moe.py)."""

from __future__ import annotations

import re
import struct

import torch
from sgl_kernel.dsv4_formats_ref import e2m1_values
from sgl_kernel.dsv4_moe_planes import _PTX, BIAS, SCALE_MAX, SCALE_MIN

from ptx_text import run_ptx

E2M1 = e2m1_values(torch.arange(16)).tolist()  # signed values of the 16 codes
# the nibble (input) of a 4-byte word in each output half: the even plane's $0 = (0, 2), $1 = (4, 6), the odd
# plane's $2 = (1, 3), $3 = (5, 7)
PARITY_ORDER = {"$0": (0, 2), "$1": (4, 6), "$2": (1, 3), "$3": (5, 7)}


def test_multiplier_of_every_scale_byte_in_range():
    """The asm forms m = s * 0x00800080 + C: both bf16 halves must hold 2^(s - 1 - BIAS), i.e. (s + 126 - BIAS) << 7,
    with no carry between the halves, for every scale byte the planes take."""
    c = int(re.search(r"mad\.lo\.u32 m, \$5, 0x00800080, (\d+);", _PTX.value).group(1))
    for s in range(SCALE_MIN, SCALE_MAX + 1):
        m = (s * 0x00800080 + c) & 0xFFFFFFFF
        half = (s + 126 - BIAS.value) << 7
        assert m & 0xFFFF == half and m >> 16 == half, s
        assert not half & 0x8000  # a positive power of two


def _half(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def test_ptx_places_every_code_in_parity_order():
    """The PTX executed from its own text: every byte value in every byte position (the other bytes varied, so no
    bit bleeds across codes), at the extreme and a middle scale byte, gives each code's value * 2^(s - 127 - BIAS)
    in the half PARITY_ORDER names (the planes' element order, which split_parity matches)."""
    def value(code: int, s: int) -> float:
        return E2M1[code] * 2.0 ** (s - 127 - BIAS.value)

    checked = 0
    for s in (SCALE_MIN, 120, SCALE_MAX):
        for v in range(256):
            for pos in range(4):
                others = [(0x5A + 0x33 * k + v) & 0xFF for k in range(4)]
                others[pos] = v
                word = sum(b << (8 * k) for k, b in enumerate(others))
                regs = run_ptx(_PTX.value, {"$4": word, "$5": s, "$6": s, "$7": s, "$8": s})
                for reg, (a, b) in PARITY_ORDER.items():
                    for half, nib in ((regs[reg], a), (regs[reg] >> 16, b)):
                        code = (word >> (4 * nib)) & 15
                        assert _half(half) == value(code, s), (s, v, pos, reg, nib)
                        checked += 1
    assert checked == 3 * 256 * 4 * 8


def packs_one_row_group(layout: str) -> bool:
    """Whether a TTGIR layout gives each thread its asm operand elements in runs of 4 consecutive, 4-aligned inputs of
    one row (so the 4 bytes of a pack lie in one 32-input scale group: the asm reads one scale byte per pack)."""
    blocked = re.match(r"#ttg\.blocked<\{sizePerThread = \[(\d+), (\d+)\].*order = \[1, 0\]", layout)
    if blocked:
        return int(blocked.group(2)) % 4 == 0
    dot = re.match(r"#ttg\.dot_op<\{opIdx = 0, parent = #\w+, kWidth = (\d+)\}>", layout)
    if dot:  # the MMA's first operand (the planes first: MoeLaunch.swap), runs of kWidth inputs per thread
        return int(dot.group(1)) % 4 == 0
    linear = re.match(r"#ttg\.linear<\{register = \[(.*?)\], lane", layout)
    return bool(linear) and linear.group(1).replace(" ", "").startswith("[0,1],[0,2]")


def test_pack_layout_checker():
    assert packs_one_row_group("#ttg.blocked<{sizePerThread = [1, 16], threadsPerWarp = [4, 8], warpsPerCTA = [4, 1], "
                               "order = [1, 0]}>")
    assert not packs_one_row_group("#ttg.blocked<{sizePerThread = [1, 2], threadsPerWarp = [4, 8], warpsPerCTA = [4, "
                                   "1], order = [1, 0]}>")
    assert packs_one_row_group("#ttg.linear<{register = [[0, 1], [0, 2], [0, 16], [32, 0]], lane = [[0, 4]]}>")
    assert not packs_one_row_group("#ttg.linear<{register = [[0, 1], [1, 0], [0, 2]], lane = [[0, 4]]}>")
    assert packs_one_row_group("#ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 4}>")
    assert not packs_one_row_group("#ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>")
    assert not packs_one_row_group("#ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 4}>")  # K is the other dim


_OPERAND_LAYOUTS = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from sgl_kernel import dsv4_moe as moe, dsv4_moe_planes as planes

types = {"x_ptr": "*bf16", "h_ptr": "*bf16", "rows_ptr": "*i64", "bexp_ptr": "*i64", "w_ptr": "*u8", "s_ptr": "*u8",
         "wts_ptr": "*fp32", "out_ptr": "*fp32", "limit": "fp32"}
launches = set()
for tokens in (1, 2, 8, 32):  # every tier moe_config has for the planes, and other tiles the sweep tries
    cfg = moe.moe_config(tokens * 6, 256, planes=True)
    launches |= {("gate_up", cfg.gate_up), ("down", cfg.down)}
for n, k, w in ((32, 128, 2), (64, 128, 4), (128, 128, 8), (32, 256, 4)):
    launches |= {(name, moe.MoeLaunch(n, k, w, 3, scaled_dot=False, planes=True)) for name in ("gate_up", "down")}
out = []
for name, launch in sorted(launches, key=str):
    kernel = planes._planes_gate_up_kernel if name == "gate_up" else planes._planes_down_kernel
    consts = {"BLOCK_M": 16, "BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k, "PREC": "tf32",
              "SCALE_CHUNKED": True, "SWAP": launch.swap, "PTX": True, "SPLITS": launch.split_k, "PDL": True}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n not in consts and n not in ("TOPK", "limit")}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": launch.num_warps, "num_stages": launch.num_stages}).asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    for line in ttgir.splitlines():
        if "elementwise_inline_asm" in line and "mad.lo.u32 m" in line:
            operand = re.search(r"tensor<\d+x\d+xi8, (#[\w.]+(?:<\{[^}]*\}>)?)>", line).group(1)
            out.append([name, str(launch), layouts.get(operand, operand)])  # an alias, or written inline
print(json.dumps(out))
"""


def test_planes_operands_pack_four_inputs_of_one_group():
    """The asm multiplies a pack of 4 code bytes by the scale byte of its first one: compiled for sm90 on the CPU (a
    subprocess: this one may run the interpreter) at every planes launch moe_config picks and more tiles, each thread
    must hold its code bytes in runs of 4 consecutive, aligned inputs of one row."""
    from sm90_compile import compiled_facts

    found = compiled_facts(_OPERAND_LAYOUTS)
    assert len(found) >= 8  # two calls per gate-up, one per down, over every launch
    for name, launch, layout in found:
        assert packs_one_row_group(layout), (name, launch, layout)
