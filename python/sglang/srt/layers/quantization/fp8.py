"""FP8 block-scaled linears that stay FP8 on the GPU (the hub's e4m3 weights, one multiplier per 128x128 block).

`Fp8BlockLinear` replaces an `nn.Linear` whose checkpoint tensor is stored FP8 (model_loader.loader.fp8_linear_names):
it holds `weight` (e4m3 [out, in]) and `weight_scale_inv` (fp32 [ceil(out / 128), ceil(in / 128)]). `fp8_path`
picks the kernel per call from the rows, the weight's shape and whether a CUDA graph is being captured or warmed up
for (utils/graph_capture), as measured fastest on an H200 (every path at Flash's shapes, 1-4,096 rows:
benchmark/RESULTS.md, 2026-12-03):
- "w8a8": up to SKINNY_ROWS rows (decode, verify), and in graphs grouped weights (wo_a) up to GROUPED_W8A8_MAX_ROWS:
  W8A8 as DeepSeek's reference and the hub's `activation_scheme: dynamic` define it (activations quantized per token
  and 128 channels to e4m3 with power-of-two multipliers), sgl_kernel's dsv4_fp8_block_gemm: FP8 tiles straight into
  the FP8 MMA, split over K when the row tiles alone would leave SMs idle (1.2-1.8x W8A16 on the wide weights).
- "cublas_w8a8": the same W8A8 through cuBLAS's blockwise-scaled GEMM (torch._scaled_mm, sm90 with CUDA >= 12.9;
  bit-equal to the Triton kernel, and faster): in graphs (decode batches above SKINNY_ROWS) for wide weights
  (CUBLAS_MIN_N outputs per group and more: wq_b, wo_b, the indexer's wq_b) and from CUBLAS_MIN_ROWS rows for any;
  eagerly (prefill chunks) from CUBLAS_EAGER_MIN_ROWS rows only: eager calls at 256 rows took 4-13x their graph
  replays (host time or cuBLAS's choices outside graphs, not told apart), and engine prefills of 1,024-row chunks
  were slower with it.
- "dequant": the rest above SKINNY_ROWS rows: the weight dequantized in one pass (sgl_kernel's dsv4_fp8_dequant) for
  the vendor bf16 GEMM. Also wherever cuBLAS lacks the recipe, with SGLANG_DSV4_FP8_PREFILL=dequant, and for fp32
  activations.
- "w8a16": fp32 activations (an engine run with --dtype float32, the oracle checks) up to SKINNY_ROWS rows, and
  GPUs without FP8 MMA (before sm89): the FP8 tiles converted in registers, the dequantized model's function.
`groups` > 1 is DeepSeek-V4's grouped low-rank output projection (wo_a): input [T, G * in], one weight slice per group.

Where the W8A8 paths run, the kernel producing a linear's input may quantize it as it writes it (`Fp8Activation`:
the engine's RMSNorm before wq_kv_a and wq_b, the inverse RoPE before wo_a), which saves the linear's own activation
quantization, a launch that reads the whole input again; `Fp8BlockLinear.w8a8_input_layout` says when and how.

Where FP8 stays: NVIDIA GPUs and ROCm's gfx942 / gfx950 (`fp8_linears_supported`), in the platform's e4m3 encoding
(fp8_format: e4m3fnuz on gfx942, its checkpoint bytes kept and block multipliers doubled at load). On ROCm the W8A8
and W8A16 paths run the same Triton kernels (FP8 MFMA), wider rows the one-pass dequantization: cuBLAS's blockwise
recipe is NVIDIA's (`cublas_blockwise_ok` is False on ROCm). CPU and other AMD GPUs dequantize at load (the HF
oracle stays exact on CPU), so no module is replaced there.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from sglang.srt import platform as plat
from sglang.srt.environ import envs
from sglang.srt.layers.quantization.fp8_format import ROCM_FP8_ARCHS, fp8_format, rocm_fp8_supported
from sglang.srt.utils.graph_capture import in_graph_capture

BLOCK = 128
logger = logging.getLogger(__name__)


def fp8_linears_supported(device: torch.device) -> bool:
    """Whether FP8 linears stay FP8 on `device`: NVIDIA GPUs, ROCm gfx942 / gfx950 (--quantization none dequantizes
    them anywhere)."""
    return device.type == "cuda" and (not plat.is_hip() or rocm_fp8_supported())


SKINNY_ROWS = 64  # decode / verify rows: sgl_kernel's FP8 GEMM (W8A8, or W8A16 for fp32 / no FP8 MMA)
CUBLAS_MIN_N = 4096  # in graphs: outputs per group from which cuBLAS's W8A8 is fastest above SKINNY_ROWS rows
CUBLAS_MIN_ROWS = 2048  # in graphs: rows from which it is fastest (or even) for narrower weights too
GROUPED_W8A8_MAX_ROWS = 512  # in graphs, grouped wo_a: the Triton W8A8 up to here (cuBLAS runs one GEMM per group)
CUBLAS_EAGER_MIN_ROWS = 4096  # eager: rows from which cuBLAS's W8A8 beat dequantize + GEMM in the engine's prefill


def fp8_mma_supported(device: torch.device) -> bool:
    """FP8 tensor-core MMA: NVIDIA sm89 and later, AMD gfx942 / gfx950 (ROCm's torch reports gfx90a, without FP8
    MFMA, as capability 9.0: the architecture is asked instead)."""
    if device.type != "cuda":
        return False
    if plat.is_hip():
        return plat.gfx_arch() in ROCM_FP8_ARCHS
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _FP8_MMA:
        _FP8_MMA[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _FP8_MMA[index]


_FP8_MMA: dict = {}


def fp8_path(m: int, n: int, k: int, groups: int, dtype: torch.dtype, device: torch.device, graph: bool) -> str:
    """The kernel for `m` rows of `dtype` activations through an FP8 weight of `groups` x [n, k], in a CUDA graph
    being captured (`graph`) or eagerly (module docstring): "w8a8", "cublas_w8a8", "dequant" or "w8a16"."""
    if dtype == torch.float32:
        return "w8a16" if m <= SKINNY_ROWS else "dequant"
    mma = fp8_mma_supported(device)
    if m <= SKINNY_ROWS:
        return "w8a8" if mma else "w8a16"
    cublas = cublas_blockwise_ok(device, n, k)
    if not graph:
        return "cublas_w8a8" if cublas and m >= CUBLAS_EAGER_MIN_ROWS else "dequant"
    if cublas and (n >= CUBLAS_MIN_N or m >= CUBLAS_MIN_ROWS):
        return "cublas_w8a8"
    if groups > 1 and m <= GROUPED_W8A8_MAX_ROWS and mma and envs.SGLANG_DSV4_FP8_PREFILL.get() == "auto":
        return "w8a8"
    return "dequant"


def dequantize_weight(w: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [N, K] with block multipliers [ceil(N / 128), ceil(K / 128)] -> [N, K] in `dtype` (exact: an e4m3 value
    times a power of two)."""
    n, k = w.shape
    out = w.to(dtype)  # the one full-size allocation; scaled in place
    if n % BLOCK == 0 and k % BLOCK == 0:  # the real models' shapes: broadcast over blocks
        out.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK).mul_(w_scale.to(dtype)[:, None, :, None])
        return out
    return out.mul_(w_scale.to(dtype).repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k])


def cublas_blockwise_ok(device: torch.device, n: int, k: int) -> bool:
    """Whether torch._scaled_mm runs DeepSeek's recipe (activations per 1x128, weights per 128x128; cuBLAS >= 12.9
    on sm90) for an [n, k] weight: whole 128-blocks, and ceil(k / 128) a multiple of 4 (the weight multipliers'
    leading dimension cuBLAS wants). Probed once per device with a small GEMM."""
    if n % BLOCK or k % BLOCK or (k // BLOCK) % 4 or envs.SGLANG_DSV4_FP8_PREFILL.get() != "auto":
        return False
    if plat.is_hip():  # DeepSeek's blockwise recipe is cuBLAS's; ROCm runs the Triton W8A8 / dequantization
        return False
    key = str(device)
    if key not in _CUBLAS_OK:
        try:
            a = torch.zeros(4, 512, dtype=torch.float8_e4m3fn, device=device)
            w = torch.zeros(128, 512, dtype=torch.float8_e4m3fn, device=device)
            torch._scaled_mm(a, w.t(), scale_a=torch.ones(4, 4, device=device).t().contiguous().t(),
                             scale_b=torch.ones(1, 4, device=device).t(), out_dtype=torch.bfloat16)
            _CUBLAS_OK[key] = True
        except (RuntimeError, TypeError, ValueError) as e:
            logger.info("FP8 prefill GEMMs dequantize the weights: torch._scaled_mm has no blockwise scaling here "
                        "(%s)", str(e).splitlines()[0][:200])
            _CUBLAS_OK[key] = False
    return _CUBLAS_OK[key]


_CUBLAS_OK: dict = {}


@dataclass
class Fp8Activation:
    """Activation rows already quantized as the W8A8 paths take them (e4m3 per token and 128 channels, power-of-two
    multipliers: sgl_kernel's act quant) by the kernel that produced them, for the path `path`."""
    q: torch.Tensor  # e4m3 [M (padded to a multiple of 16 for cuBLAS: fp8_act_buffers), K]
    scale: torch.Tensor  # fp32 [M (padded likewise), ceil(K / 128)]: row-major for "w8a8", cuBLAS's layout else
    rows: int  # M
    dtype: torch.dtype  # the unquantized rows' dtype, the output's
    path: str  # "w8a8" or "cublas_w8a8"


def cublas_w8a8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """W8A8 as DeepSeek's reference computes it: activations quantized per token and 128 channels (power-of-two
    multipliers, sgl_kernel's act quant), then cuBLAS's blockwise-scaled FP8 GEMM, one per group."""
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant

    a, a_scale = dsv4_fp8_act_quant(x, groups, cublas_layout=True)
    return cublas_scaled_mm(a, a_scale, x.shape[0], w, w_scale, groups, x.dtype)


def cublas_scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, m: int, w: torch.Tensor, w_scale: torch.Tensor,
                     groups: int, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's blockwise-scaled FP8 GEMM of quantized rows (the cuBLAS layout of sgl_kernel's fp8_act_buffers), one
    per group; the first `m` rows of the result."""
    k, n = a.shape[1] // groups, w.shape[0] // groups
    kb, nb = k // BLOCK, n // BLOCK
    outs = [torch._scaled_mm(a[:, g * k:(g + 1) * k], w[g * n:(g + 1) * n].t(),
                             scale_a=a_scale[:, g * kb:(g + 1) * kb], scale_b=w_scale[g * nb:(g + 1) * nb].t(),
                             out_dtype=out_dtype) for g in range(groups)]
    out = outs[0] if groups == 1 else torch.stack(outs, 1).flatten(1)
    return out[:m]


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int = 1,
               path: Optional[str] = None) -> torch.Tensor:
    """x [M, G * K] (contiguous rows) -> [M, G * N] in x's dtype, by the kernel `fp8_path` picks (or `path`)."""
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_block_gemm, dsv4_fp8_dequant

    if path is None:
        graph = x.is_cuda and in_graph_capture()  # graph warm-ups too: they compile what the capture records
        path = fp8_path(x.shape[0], w.shape[0] // groups, w.shape[1], groups, x.dtype, x.device, graph)
    if path in ("w8a8", "w8a16"):
        return dsv4_fp8_block_gemm(x, w, w_scale, groups, out_dtype=x.dtype, quantize_act=path == "w8a8")
    if path == "cublas_w8a8":
        return cublas_w8a8(x, w, w_scale, groups)
    wd = dsv4_fp8_dequant(w, w_scale, x.dtype) if x.is_cuda else dequantize_weight(w, w_scale, x.dtype)
    if groups == 1:
        return x @ wd.T
    xg = x.view(x.shape[0], groups, -1).transpose(0, 1)  # [G, M, K] @ [G, K, N] -> [M, G * N]
    return torch.bmm(xg, wd.view(groups, -1, wd.shape[1]).transpose(1, 2)).transpose(0, 1).flatten(1)


class Fp8BlockLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, groups: int = 1) -> None:
        super().__init__()
        if out_features % groups:
            raise ValueError(f"{out_features} outputs do not split into {groups} groups")
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=fp8_format().dtype),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(math.ceil(out_features / BLOCK), math.ceil(in_features / BLOCK), dtype=torch.float32),
            requires_grad=False)

    def w8a8_input_layout(self, m: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
        """The path ("w8a8": multipliers row-major; "cublas_w8a8": cuBLAS's layout) when this linear would quantize
        `m` rows of `dtype` activations itself, so their producer may hand it an Fp8Activation; else None. (On CPU
        never, but where tests declare FP8 MMA present and run the GPU's Triton kernels interpreted.)"""
        path = fp8_path(m, self.out_features // self.groups, self.in_features, self.groups, dtype, device,
                        in_graph_capture())
        return path if path in ("w8a8", "cublas_w8a8") else None

    def forward(self, x: Union[torch.Tensor, Fp8Activation]) -> torch.Tensor:
        """x [..., groups * in_features] -> [..., out_features] in x's dtype; or quantized rows -> [M, out_features]."""
        if isinstance(x, Fp8Activation):
            return self._forward_quantized(x)
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return fp8_linear(rows, self.weight, self.weight_scale_inv, self.groups).view(*lead, self.out_features)

    def _forward_quantized(self, x: Fp8Activation) -> torch.Tensor:
        if x.q.shape[1] != self.groups * self.in_features:
            raise ValueError(f"quantized rows of {x.q.shape[1]} channels for a linear of {self.groups} x "
                             f"{self.in_features} inputs")
        if x.q.dtype != self.weight.dtype:  # the FP8 MMA takes one encoding (fp8_format)
            raise ValueError(f"quantized rows in {x.q.dtype} for a weight in {self.weight.dtype}")
        if x.path == "cublas_w8a8":
            return cublas_scaled_mm(x.q, x.scale, x.rows, self.weight, self.weight_scale_inv, self.groups, x.dtype)
        from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_scaled_gemm

        return dsv4_fp8_scaled_gemm(x.q, x.scale, self.weight, self.weight_scale_inv, self.groups, x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}, "
                f"{str(self.weight.dtype).replace('torch.float8_', '')}")


def replace_fp8_linears(model: nn.Module, weight_names: frozenset, groups_of=lambda name: 1) -> int:
    """Swap each `nn.Linear` whose `<name>.weight` is in `weight_names` for an Fp8BlockLinear of the same logical
    shape (before the model is materialised, e.g. on the meta device); `groups_of(module name)` gives its groups and
    in_features is then per group. Returns how many were replaced; a name matching no linear raises."""
    found = 0
    for name, module in list(model.named_modules()):
        if f"{name}.weight" not in weight_names:
            continue
        if not isinstance(module, nn.Linear):
            raise TypeError(f"'{name}' is stored FP8 but is a {type(module).__name__}, not a linear")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        groups = groups_of(name)
        setattr(parent, attr, Fp8BlockLinear(module.in_features, module.out_features, groups))
        found += 1
    if found != len(weight_names):
        raise KeyError(f"{len(weight_names) - found} FP8 checkpoint tensors match no linear of the model")
    return found


class Fp8RoutedExperts(nn.Module):
    """Routed experts of an FP8-converted checkpoint kept FP8 (e4m3 with fp32 multipliers per 128x128 block of each
    projection), computed by sgl_kernel's fused dsv4_moe_fp8 (the MXFP4 MoE's kernels with FP8 tiles, W8A16):
    w13 [E, 2I, D] (w1 rows, then w3 rows), w13_scale [E, 2, ceil(I/128), ceil(D/128)], w2 [E, D, I],
    w2_scale [E, 1, ceil(D/128), ceil(I/128)]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        e, d, i = num_experts, hidden_size, intermediate_size
        self.intermediate_size, self.limit = i, limit

        def param(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        nb = lambda n: math.ceil(n / BLOCK)  # noqa: E731
        fp8 = fp8_format().dtype  # the checkpoint's e4m3fn, or e4m3fnuz on gfx942 (converted at load)
        self.w13 = param(e, 2 * i, d, dtype=fp8)
        self.w13_scale = param(e, 2, nb(i), nb(d), dtype=torch.float32)
        self.w2 = param(e, d, i, dtype=fp8)
        self.w2_scale = param(e, 1, nb(d), nb(i), dtype=torch.float32)

    def load_expert(self, which: str, expert: int, tensor: torch.Tensor, is_scale: bool) -> str:
        """Copy one expert's `which` (w1 / w2 / w3) e4m3 weight or fp32 block grid; returns the parameter written."""
        i = self.intermediate_size
        name = ("w2" if which == "w2" else "w13") + ("_scale" if is_scale else "")
        target = getattr(self, name)[expert]
        if is_scale:
            target = target[1 if which == "w3" else 0]
        elif which != "w2":
            target = target[:i] if which == "w1" else target[i:]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {expert} {which}{' scale' if is_scale else ''}: shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        return name

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                add: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The routed experts' sum, plus `add` (the shared expert's output) added by the fused MoE's last kernel."""
        from sgl_kernel.dsv4_moe import dsv4_moe_fp8

        return dsv4_moe_fp8(x, topk_ids, topk_weights, self.w13, self.w13_scale, self.w2, self.w2_scale, self.limit,
                            add=add)


def w8a8_input_path(linear: Optional[nn.Module], x: torch.Tensor) -> Optional[str]:
    """Where `linear` is an FP8 linear that would quantize the M rows of `x` [M, ...] itself (W8A8), the path their
    producer should quantize them for (Fp8BlockLinear.w8a8_input_layout); else None."""
    if not isinstance(linear, Fp8BlockLinear) or linear.in_features % BLOCK:  # whole blocks in each group
        return None
    return linear.w8a8_input_layout(x.shape[0], x.dtype, x.device)
