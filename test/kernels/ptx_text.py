"""Inline PTX blocks executed from their own text on the CPU, instruction by instruction as written: the integer,
bf16x2, fp16x2 and fp32 instructions our kernels' asm uses, on 32-bit registers ($N operands and .reg names; a .b16
register holds its 16 bits). Floating-point results are computed in float64 and rounded to the instruction's type
(nearest even): the GPU's single rounding up to a rare double rounding, so tests of sums compare within bounds."""

from __future__ import annotations

import re
import struct

MASK = 0xFFFFFFFF


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _to_bf16_bits(value: float) -> int:
    import torch

    return int(torch.tensor([value], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _mul_bf16x2(a: int, b: int) -> int:
    lo = _to_bf16_bits(_bf16(a) * _bf16(b))
    hi = _to_bf16_bits(_bf16(a >> 16) * _bf16(b >> 16))
    return lo | hi << 16


def _prmt(a: int, b: int, sel: int) -> int:
    """Default-mode byte permute: result byte i is byte (sel >> 4i) & 7 of {b, a}, or its sign bit replicated where
    selector bit 3 is set."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 15
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """Any 3-input bitwise function: bit i of the result is bit (a_i << 2 | b_i << 1 | c_i) of lut."""
    return sum(((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1))) & 1) << i for i in range(32))


def _f16(bits: int) -> float:
    return float(struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0])


def _to_f16_bits(value: float) -> int:
    import torch

    return int(torch.tensor([value], dtype=torch.float64).to(torch.float16).view(torch.int16).item()) & 0xFFFF


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & MASK))[0]


def _to_f32_bits(value: float) -> int:
    import torch

    return int(torch.tensor([value], dtype=torch.float64).to(torch.float32).view(torch.int32).item()) & MASK


def _f16x2(fn):
    """An fp16x2 instruction from its per-half function of floats."""
    def run(*regs):
        halves = [fn(*(_f16(r >> shift) for r in regs)) for shift in (0, 16)]
        return _to_f16_bits(halves[0]) | _to_f16_bits(halves[1]) << 16
    return run


def _rotl(v: int, n: int) -> int:
    n %= 32
    return ((v << n) | (v >> (32 - n))) & MASK


_OPS = {
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "xor.b32": lambda a, b: a ^ b,
    "shl.b32": lambda a, b: a << b if b < 32 else 0,
    "shr.b32": lambda a, b: a >> b if b < 32 else 0,
    "mad.lo.u32": lambda a, b, c: a * b + c,
    "mul.lo.u32": lambda a, b: a * b,
    # funnel shifts of {b, a} with a == b (the only use here): rotations
    "shf.l.wrap.b32": lambda a, b, c: _rotl(a, c) if a == b else None,
    "shf.r.wrap.b32": lambda a, b, c: _rotl(a, -c) if a == b else None,
    "mul.rn.bf16x2": _mul_bf16x2,
    "prmt.b32": _prmt,
    "lop3.b32": _lop3,
    "mul.rn.f16x2": _f16x2(lambda a, b: a * b),
    "fma.rn.f16x2": _f16x2(lambda a, b, c: a * b + c),
    "cvt.f32.f16": lambda a: _to_f32_bits(_f16(a)),
    "add.f32": lambda a, b: _to_f32_bits(_f32(a) + _f32(b)),
    "mul.f32": lambda a, b: _to_f32_bits(_f32(a) * _f32(b)),
    "fma.rn.f32": lambda a, b, c: _to_f32_bits(_f32(a) * _f32(b) + _f32(c)),
    "mov.b32": lambda a: a,
}


def run_ptx(text: str, inputs: dict) -> dict:
    """Registers after the block's instructions, from `inputs` ({"$4": word, ...}); an instruction outside _OPS, or a
    funnel shift of two different registers, raises."""
    regs = dict(inputs)
    for line in text.strip().splitlines():
        m = re.match(r"\s*([\w.]+)\s+([^;]+);", line)
        if not m or m.group(1).startswith(".reg"):
            continue
        op, operands = m.group(1), m.group(2)
        unpack = re.fullmatch(r"\{\s*(\w+),\s*(\w+)\s*\},\s*(\S+)", operands.strip())
        if op == "mov.b32" and unpack:  # mov.b32 {lo, hi}, r: the halves into two .b16 registers
            word = regs[unpack.group(3)]
            regs[unpack.group(1)], regs[unpack.group(2)] = word & 0xFFFF, word >> 16
            continue
        args = [a.strip() for a in operands.split(",")]
        if op not in _OPS:
            raise ValueError(f"PTX instruction {op} not simulated")
        val = [regs[a] if a in regs else int(a, 0) for a in args[1:]]
        out = _OPS[op](*val)
        if out is None:
            raise ValueError(f"{line.strip()}: a funnel shift of two different registers")
        regs[args[0]] = out & MASK
    return regs
