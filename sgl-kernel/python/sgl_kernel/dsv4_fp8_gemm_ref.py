"""Torch references of the FP8 block-scaled linear (dsv4_fp8_gemm.py): DeepSeek-V4's FP8 linears hold e4m3 weights
with one power-of-two multiplier per 128x128 block (partial blocks at the edges); activations are quantized at run
time per token and 128 input channels, also with power-of-two scales (the hub's `activation_scheme: dynamic`, ue8m0).

Power-of-two scales make quantization exact but for the e4m3 rounding itself: x / 2^e is exact, and a product of
e4m3 values and powers of two is exact in fp32. The exponent is derived from the bits of amax (no log2, no
division): amax = m * 2^E with m in [1, 2); amax / 448 <= 2^e  <=>  e >= E - 8 + (m > 1.75).

Two e4m3 encodings exist: OCP e4m3fn (NVIDIA, gfx950; largest 448 = 1.75 * 2^8) and e4m3fnuz (gfx942, whose FP8
MMA takes only it: exponent bias 8, no -0, 0x80 its one NaN; largest 240 = 1.875 * 2^7). The quantizing code takes
the encoding from its output tensor's dtype (`fp8_max`), so one function serves both: for e4m3fnuz,
amax / 240 <= 2^e  <=>  e >= E - 7 + (m > 1.875).
"""

from __future__ import annotations

import math

import torch

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_E4M3FNUZ_MAX = 240.0  # largest finite float8_e4m3fnuz
BLOCK = 128
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an e4m3 dtype (the clamp before the cast, the scale's denominator)."""
    if dtype == torch.float8_e4m3fn:
        return FP8_E4M3_MAX
    if dtype == torch.float8_e4m3fnuz:
        return FP8_E4M3FNUZ_MAX
    raise ValueError(f"{dtype} is not an e4m3 dtype (float8_e4m3fn or float8_e4m3fnuz)")


def act_scale_exponent(amax: torch.Tensor, qmax: float = FP8_E4M3_MAX) -> torch.Tensor:
    """int32 e, the smallest with amax / 2^e <= qmax (448 or 240), at least -126 (so 2^e and 2^-e are normal fp32;
    amax >= 0)."""
    mant, exp = math.frexp(qmax)  # qmax = 2 * mant * 2^(exp - 1), 2 * mant in [1, 2)
    bits = amax.float().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = bits & 0x7FFFFF
    # 448: exponent - 8 + (m > 1.75, mantissa field 0x600000); 240: exponent - 7 + (m > 1.875, 0x700000)
    e = exponent - (exp - 1) + (mantissa > int((2 * mant - 1) * 2 ** 23)).to(torch.int32)
    return e.clamp(min=-126)


def act_quant_ref(x: torch.Tensor, block: int = BLOCK, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple:
    """x [M, K] -> (e4m3 [M, K] in `dtype`, fp32 multipliers [M, ceil(K / block)]); x ~= q * scale per block."""
    m, k = x.shape
    nb = -(-k // block)
    qmax = fp8_max(dtype)
    padded = torch.nn.functional.pad(x.float(), (0, nb * block - k)).view(m, nb, block)
    e = act_scale_exponent(padded.abs().amax(dim=-1), qmax)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    q = (padded / scale[:, :, None]).clamp(-qmax, qmax).to(dtype)
    return q.view(m, nb * block)[:, :k], scale


def dequant_weight_ref(w: torch.Tensor, w_scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """e4m3 [N, K] with fp32 multipliers [ceil(N / block), ceil(K / block)] -> fp32 [N, K]."""
    n, k = w.shape
    s = w_scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.float() * s


def fp8_block_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int = 1,
                         quantize_act: bool = True) -> torch.Tensor:
    """y [M, G * N] = per group g: x[:, g] [M, K] @ W[g * N:(g + 1) * N].T, x [M, G * K], W e4m3 [G * N, K]; the
    activations quantized per token and 128 channels of each group (W8A8, to W's e4m3 dtype) or used as they are
    (W8A16). fp32 out."""
    m = x.shape[0]
    wf = dequant_weight_ref(w, w_scale)
    n = w.shape[0] // groups
    xs = x.view(m, groups, x.shape[1] // groups)
    outs = []
    for g in range(groups):
        xg = xs[:, g]
        if quantize_act:
            q, s = act_quant_ref(xg, dtype=w.dtype)
            xg = q.float() * s.repeat_interleave(BLOCK, 1)[:, :xg.shape[1]]
        outs.append(xg.float() @ wf[g * n:(g + 1) * n].T)
    return torch.cat(outs, dim=1)
