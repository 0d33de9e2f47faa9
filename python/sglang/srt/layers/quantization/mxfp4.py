"""Routed experts that stay packed MXFP4 on the GPU (the hub's e2m1 codes, two per byte, one ue8m0 exponent byte per
32 inputs), computed by sgl_kernel's fused dsv4_moe_mxfp4 (sgl_kernel.dsv4_moe; W4A16: weights dequantized in
registers, clamped SwiGLU fused, router weights applied, device-side expert sort; no host read, graph-capturable).
W4A16 is the only MoE precision: FP8 activations (W4A8, DeepSeek's reference function) ran 1.4-1.9x slower at every
measured batch on an H200 (RESULTS.md, "MoE decode: W4A8 timed, it loses to W4A16; the FP8 shared expert end to end",
2026-12-04).

`Mxfp4RoutedExperts` replaces `RoutedExperts` when the checkpoint's experts are stored FP4 and the device keeps them
(`mxfp4_experts_supported`: NVIDIA GPUs and ROCm gfx942 / gfx950; CPU and other AMD GPUs dequantize at load; the
format is the same on every target). On NVIDIA GPUs at 1-8 tokens the kernel takes CUDA-core GEMVs unless
SGLANG_DSV4_MOE_DECODE=planes; on ROCm the general kernels run at every batch size: tl.dot_scaled on gfx950 (MXFP4
MFMA), the in-register dequantization on gfx942, which has none (`scaled_dot_supported`).
Its parameters hold all experts of a layer: w13 [E, 2I, D/2] (w1 rows, then w3
rows), w2 [E, D, I/2], all uint8, as the checkpoint packs them; the scale bytes (the checkpoint's [2I, D/32] and
[D, I/32] per expert) in sgl_kernel's chunked storage where a row's groups are a multiple of 8 (w13_scale
[E, D/256, 2I, 8], w2_scale [E, I/256, D, 8]: one decode K step's bytes of consecutive rows contiguous), else
row-major. `load_expert` fills one expert's slice from the checkpoint's per-expert tensors. On MI355X with AITER's
A8W4 fused MoE available (`serve_experts_with_aiter`, layers/moe/aiter_moe.py) a layer's tensors are rewritten in place
into AITER's pre-shuffled layout after loading and AITER computes it. The shared expert is not
fused into them (a SharedExpert beside them, its linears kept FP8 too).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from sglang.srt import platform as plat
from sglang.srt.environ import envs
from sglang.srt.layers.quantization.fp8_format import rocm_fp8_supported

FP4_BLOCK = 32
logger = logging.getLogger(__name__)


def mxfp4_experts_supported(device: torch.device) -> bool:
    """Whether routed experts stored MXFP4 stay packed on `device`: NVIDIA GPUs, ROCm gfx942 / gfx950."""
    return device.type == "cuda" and (not plat.is_hip() or rocm_fp8_supported())


def scaled_dot_supported() -> bool:
    """Whether the MoE's general kernels take tl.dot_scaled for 16-bit activations: NVIDIA GPUs and gfx950 (MXFP4
    MFMA); not gfx942, which has none (its in-register dequantization instead)."""
    return not plat.is_hip() or plat.gfx_arch() == "gfx950"


class Mxfp4RoutedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        if hidden_size % FP4_BLOCK or intermediate_size % FP4_BLOCK:
            raise ValueError(f"MXFP4 experts need hidden ({hidden_size}) and intermediate ({intermediate_size}) sizes "
                             f"that are multiples of {FP4_BLOCK}")
        e, d, i = num_experts, hidden_size, intermediate_size
        self.intermediate_size, self.limit = i, limit

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)

        from sgl_kernel.dsv4_moe import CHUNK, chunked_empty

        def scales(rows, groups):
            if groups % CHUNK:
                return param(e, rows, groups)
            return nn.Parameter(chunked_empty(e, rows, groups), requires_grad=False)

        self.w13, self.w13_scale = param(e, 2 * i, d // 2), scales(2 * i, d // FP4_BLOCK)
        self.w2, self.w2_scale = param(e, d, i // 2), scales(d, i // FP4_BLOCK)
        self.scale_range = (256, -1)  # (min, max) scale byte loaded: the decode kernels' parity planes need it in range
        self.aiter = None  # AITER's fused MoE (aiter_ops.AiterMoeApi) once the tensors are in its layout (use_aiter)

    def use_aiter(self, api, dtype: torch.dtype, expert_parallel: bool) -> bool:
        """Hand this layer to AITER's fused MoE (`api`: aiter_ops.aiter_moe_api()) where it serves it: widths
        multiples of 256, bf16 / fp16 activations (`dtype`), every expert here (no ids of -1: its sort has no such
        id); the tensors are then rewritten in place into its layout. Returns whether it did."""
        from sglang.srt.layers.moe import aiter_moe

        if api is None or expert_parallel or dtype not in (torch.bfloat16, torch.float16) or self.aiter is not None:
            return self.aiter is not None
        if not aiter_moe.widths_supported(self.w2.shape[1], self.intermediate_size):
            return False
        aiter_moe.to_aiter_layout(self)
        self.aiter = api
        return True

    def load_expert(self, which: str, expert: int, tensor: torch.Tensor, is_scale: bool) -> str:
        """Copy the checkpoint's packed `which` (w1 / w2 / w3) codes or scale bytes of one expert; returns the name
        of the parameter written."""
        i = self.intermediate_size
        name = ("w2" if which == "w2" else "w13") + ("_scale" if is_scale else "")
        target = self._rows(getattr(self, name))[expert]
        if which == "w1":
            target = target[:i]
        elif which == "w3":
            target = target[i:]
        # chunked scale bytes: the checkpoint's [rows, groups] land in [rows, groups / 8, 8]
        want = tuple(target.shape) if target.dim() == 2 else (target.shape[0], target.shape[1] * target.shape[2])
        if tuple(tensor.shape) != want:
            raise ValueError(f"expert {expert} {which}{' scale' if is_scale else ''}: shape {tuple(tensor.shape)}, "
                             f"expected {want}")
        with torch.no_grad():
            if self.aiter is not None:  # AITER's layout: the expert's rows permuted (aiter_moe)
                from sglang.srt.layers.moe.aiter_moe import write_expert_rows

                whole = getattr(self, name)[expert]
                write_expert_rows(whole, tensor.view(torch.uint8).reshape(target.shape), i if which == "w3" else 0,
                                  name.startswith("w13"), is_scale)
            else:
                target.copy_(tensor.view(torch.uint8).reshape(target.shape))
        if is_scale:  # one read at load: forwards must not sync
            lo, hi = self.scale_range
            loaded = tensor.view(torch.uint8)
            self.scale_range = (min(lo, int(loaded.min())), max(hi, int(loaded.max())))
        return name

    @property
    def scales_fit_planes(self) -> bool:
        """Every scale byte loaded lies within the exact range of sgl_kernel's parity planes (the fast decode path of
        dsv4_moe_mxfp4); real checkpoints' do (multipliers near 2^-8; the range is 2^-116 .. 2^17)."""
        from sgl_kernel.dsv4_moe import scale_bytes_fit_planes

        return scale_bytes_fit_planes(*self.scale_range)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                add: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The routed experts' sum, plus `add` (the shared expert's output) added by the fused MoE's last kernel (after
        AITER's, where it serves the layer)."""
        if self.aiter is not None:
            from sglang.srt.layers.moe.aiter_moe import fused_experts

            if x.shape[0] == 0:
                return torch.zeros_like(x) if add is None else add.clone()
            out = fused_experts(self.aiter, x, topk_ids, topk_weights, self.w13, self.w13_scale, self.w2,
                                self.w2_scale, self.limit)
            return out if add is None else out + add
        from sgl_kernel.dsv4_moe import dsv4_moe_mxfp4

        return dsv4_moe_mxfp4(x, topk_ids, topk_weights, self.w13, self._rows(self.w13_scale), self.w2,
                              self._rows(self.w2_scale), self.limit, scales_fit_planes=self.scales_fit_planes,
                              gemv=envs.SGLANG_DSV4_MOE_DECODE.get() == "auto", add=add,
                              scaled_dot=scaled_dot_supported())

    @staticmethod
    def _rows(param: torch.Tensor) -> torch.Tensor:
        """A parameter as [E, rows, ...]: chunked scale storage [E, G/8, R, 8] seen as [E, R, G/8, 8]."""
        from sgl_kernel.dsv4_moe import as_rows

        return as_rows(param) if param.dim() == 4 else param


def serve_experts_with_aiter(models, dtype: torch.dtype, expert_parallel: bool) -> tuple:
    """After loading: hand each MXFP4 experts layer of `models` that AITER's fused MoE serves (aiter_moe_api, and
    the layer's own conditions: Mxfp4RoutedExperts.use_aiter) to it, and log the choice once. Returns (layers served,
    MXFP4 layers)."""
    from sglang.srt.layers.aiter_ops import aiter_moe_api

    layers = [m for model in models if model is not None for m in model.modules() if isinstance(m, Mxfp4RoutedExperts)]
    api = aiter_moe_api() if layers and plat.is_hip() else None
    if api is None:
        return 0, len(layers)
    served = sum(m.use_aiter(api, dtype, expert_parallel) for m in layers)
    logger.info("AITER fused MoE (A8W4, its layout) serves %d of %d MXFP4 expert layers; our Triton MoE the rest%s",
                served, len(layers), " (expert parallelism: AITER not used)" if expert_parallel else "")
    return served, len(layers)
