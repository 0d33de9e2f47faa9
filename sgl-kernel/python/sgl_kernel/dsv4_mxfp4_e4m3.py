"""MXFP4 codes as e4m3 bytes for the W4A8 MoE (dsv4_moe_w4a8): DeepSeek-V4's reference runs its routed experts as
FP8 activations times FP4 weights; Hopper has FP8 tensor cores but no FP4, so the codes become e4m3 in registers and
one FP8 MMA runs per 32-input scale group, its fp32 sums times the group's scale.

An e2m1 code s e1 e0 m placed in an e4m3 byte as s << 7 | (e1 e0 m) << 2 is the code's value * 2^-6 (e = 0 lands on
e4m3 subnormals, which hold 0.5 * 2^-6 exactly). A packed byte b holds inputs 2j (low nibble) and 2j + 1 (high), so
    even input: (b & 7) << 2 | (b & 8) << 4        odd input: (b >> 2) & 0x1C | b & 0x80,
7 32-bit instructions per 4 packed bytes on NVIDIA GPUs (the PTX below; Triton's own integer ops elsewhere, the same
bytes). The two planes of one scale group (16 packed bytes of a row) side by side are its 32 inputs in *group parity
order*: the 16 even inputs, then the 16 odd ones. The W4A8 activations are stored in that order (their quantizers
write it: `parity_column`), so the MMA pairs the right inputs with no byte moved in registers (compiled for sm90 the
K loop has no byte permutes; joining the planes in input order instead cost ~9 per 4 packed bytes).
"""

from __future__ import annotations

import triton
import triton.language as tl

GROUP = 32  # inputs per scale byte (the MXFP4 block)
E4M3_SHIFT = tl.constexpr(6)  # the e4m3 bytes are the code values * 2^-6: callers multiply their sums by 2^6

# $0: the even inputs of the 4 code bytes in $2 as 4 e4m3 bytes, $1: the odd inputs.
_PTX = tl.constexpr("""
{
.reg .b32 x, s, t;
and.b32 x, $2, 0x07070707;
and.b32 s, $2, 0x08080808;
shl.b32 s, s, 4;
mad.lo.u32 $0, x, 4, s;
shr.b32 t, $2, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 s, $2, 0x80808080;
or.b32 $1, t, s;
}
""")


@triton.jit
def fp4_group_e4m3(b, PTX: tl.constexpr):
    """Codes of one scale group per row, [N, 16] uint8 -> its 32 inputs as e4m3 [N, 32] in group parity order (each
    the code's value * 2^-E4M3_SHIFT). PTX: the inline PTX (NVIDIA GPUs), else Triton's integer ops."""
    if PTX:
        lo, hi = tl.inline_asm_elementwise(_PTX, "=r,=r,r", [b], dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True,
                                           pack=4)
    else:
        lo = (((b & 7) << 2) | ((b & 8) << 4)).to(tl.float8e4nv, bitcast=True)
        hi = (((b >> 2) & 0x1C) | (b & 0x80)).to(tl.float8e4nv, bitcast=True)
    return tl.reshape(tl.permute(tl.join(lo, hi), [0, 2, 1]), [b.shape[0], 2 * b.shape[1]])


@triton.jit
def parity_column(k):
    """Where input k is stored in group parity order: its group's start, then even inputs at 0..15, odd at 16..31."""
    return (k & ~31) | ((k & 31) >> 1) | ((k & 1) << 4)


@triton.jit
def group_multiplier(s):
    """Scale bytes (int32) -> their multipliers 2^(s - 127) as fp32 (byte 0 reads as 0: multipliers below 2^-126
    are not kept)."""
    return (s << 23).to(tl.float32, bitcast=True)


def parity_order(width: int):
    """The inverse of parity_column as an index tensor: stored[:, j] = natural[:, parity_order(width)[j]] (tests and
    torch references)."""
    import torch

    return torch.arange(width).view(width // GROUP, GROUP // 2, 2).transpose(1, 2).reshape(width)
