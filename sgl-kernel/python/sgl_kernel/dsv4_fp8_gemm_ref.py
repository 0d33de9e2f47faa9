"""Torch references of the FP8 block-scaled linear (dsv4_fp8_gemm.py): DeepSeek-V4's FP8 linears hold e4m3 weights
with one power-of-two multiplier per 128x128 block (partial blocks at the edges); activations are quantized at run
time per token and 128 input channels, also with power-of-two scales (the hub's `activation_scheme: dynamic`, ue8m0).

Power-of-two scales make quantization exact but for the e4m3 rounding itself: x / 2^e is exact, and a product of
e4m3 values and powers of two is exact in fp32. The exponent is derived from the bits of amax (no log2, no
division): amax = m * 2^E with m in [1, 2); amax / 448 <= 2^e  <=>  e >= E - 8 + (m > 1.75).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
BLOCK = 128


def act_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 e, the smallest with amax / 2^e <= 448, at least -126 (so 2^e and 2^-e are normal fp32; amax >= 0)."""
    bits = amax.float().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = bits & 0x7FFFFF
    e = exponent - 8 + (mantissa > 0x600000).to(torch.int32)  # 1.75 = mantissa field 0x600000
    return e.clamp(min=-126)


def act_quant_ref(x: torch.Tensor, block: int = BLOCK) -> tuple:
    """x [M, K] -> (e4m3 [M, K], fp32 multipliers [M, ceil(K / block)]); x ~= q * scale per block."""
    m, k = x.shape
    nb = -(-k // block)
    padded = torch.nn.functional.pad(x.float(), (0, nb * block - k)).view(m, nb, block)
    e = act_scale_exponent(padded.abs().amax(dim=-1))
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    q = (padded / scale[:, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, nb * block)[:, :k], scale


def dequant_weight_ref(w: torch.Tensor, w_scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """e4m3 [N, K] with fp32 multipliers [ceil(N / block), ceil(K / block)] -> fp32 [N, K]."""
    n, k = w.shape
    s = w_scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.float() * s


def fp8_block_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int = 1,
                         quantize_act: bool = True) -> torch.Tensor:
    """y [M, G * N] = per group g: x[:, g] [M, K] @ W[g * N:(g + 1) * N].T, x [M, G * K], W e4m3 [G * N, K]; the
    activations quantized per token and 128 channels of each group (W8A8) or used as they are (W8A16). fp32 out."""
    m = x.shape[0]
    wf = dequant_weight_ref(w, w_scale)
    n = w.shape[0] // groups
    xs = x.view(m, groups, x.shape[1] // groups)
    outs = []
    for g in range(groups):
        xg = xs[:, g]
        if quantize_act:
            q, s = act_quant_ref(xg)
            xg = q.float() * s.repeat_interleave(BLOCK, 1)[:, :xg.shape[1]]
        outs.append(xg.float() @ wf[g * n:(g + 1) * n].T)
    return torch.cat(outs, dim=1)
