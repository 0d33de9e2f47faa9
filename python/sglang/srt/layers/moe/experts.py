"""Clamped-SwiGLU experts: the routed experts (stacked weights) and the always-on shared expert.

Expert(x) = w2 . (silu(min(w1 x, L)) * clamp(w3 x, -L, L)), L = swiglu_limit; the clamp is asymmetric and applies
to routed and shared experts alike (arch section 6). Routed weights are stored stacked [E, ...] under the
names `experts.w1|w2|w3`; the loader maps the checkpoint's per-expert tensors into slices.

The clamped SwiGLU on GPUs (`swiglu`: the shared expert's, the grouped GEMM path's): sgl_kernel's one launch
(dsv4_swiglu) in place of torch's four. Where the shared expert's w2 is an FP8 linear that would quantize its input
itself (a W8A8 path) the same launch writes that input quantized (an Fp8Activation), so w2 skips its activation
quantization. Its output is computed before the routed
experts', whose last kernel adds it (their `add`), in place of the `routed + shared` launch.

Shared-experts fusion (`append_shared_expert`, after loading): the shared expert becomes routed expert E, which
every token selects with weight 1, so one grouped pass computes both. Because DeepSeek-V4 clamps shared and
routed experts with the same swiglu_limit, the fused result equals the unfused one (upstream keeps fusion off by
default on CUDA because some fused implementations clamp the shared expert differently).
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.gpu_kernels import sgl_kernel_op
from sglang.srt.layers.moe.dispatch import FUSED, GROUPED, moe_device, packed_line, routed_line, routed_path
from sglang.srt.layers.quantization.fp8 import Fp8Activation, w8a8_input_path
from sglang.srt.layers.quantization.fp8_format import fp8_format

logger = logging.getLogger(__name__)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _fused(gate: torch.Tensor):
    """sgl_kernel's one-launch clamped SwiGLU where `gate` is on a GPU (and Triton / sgl_kernel is installed), else
    None: the torch path."""
    ok = gate.is_cuda and gate.dim() == 2 and gate.stride(-1) == 1
    return sgl_kernel_op("dsv4_swiglu", "dsv4_clamped_swiglu") if ok else None


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """clamped_swiglu, by sgl_kernel's one launch on GPUs (torch's takes four)."""
    fused = _fused(gate)
    return clamped_swiglu(gate, up, limit) if fused is None else fused(gate, up, limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit
        self.w13 = None  # kept FP8: w1 and w3 as one linear after loading (models/deepseek_v4.join_projections)

    def forward(self, x: Union[torch.Tensor, Fp8Activation]) -> torch.Tensor:
        if self.w13 is not None:
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(self.activation(gate, up))

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> Union[torch.Tensor, Fp8Activation]:
        """The clamped SwiGLU as w2 reads it: where w2 would quantize these rows itself (an FP8 linear's W8A8 paths),
        quantized by the SwiGLU's own launch (sgl_kernel's dsv4_clamped_swiglu_fp8: the codes and multipliers w2's
        quantization would give); else by sgl_kernel's one launch on GPUs; else torch's (the CPU path, the
        reference)."""
        path = w8a8_input_path(self.w2, gate) if gate.dim() == 2 and gate.stride(-1) == 1 else None
        if path is not None:
            from sgl_kernel.dsv4_swiglu import dsv4_clamped_swiglu_fp8

            q, s = dsv4_clamped_swiglu_fp8(gate, up, self.limit, cublas_layout=path == "cublas_w8a8",
                                           fp8_dtype=fp8_format().dtype)
            return Fp8Activation(q, s, gate.shape[0], gate.dtype, path)
        return swiglu(gate, up, self.limit)


class RoutedExperts(nn.Module):
    """E experts; forward sums each token's k selected experts weighted by the router, on the path dispatch.routed_path
    picks for the device, dtype and widths:
    - torch's grouped GEMM over the pairs sorted by expert (`_forward_grouped`): the CPU with torch >= 2.9, bf16 on
      NVIDIA Hopper+ (and ROCm builds where it runs), rows of whole 16-byte units;
    - sgl_kernel's fused Triton MoE for unquantized weights (`_forward_fused`): every other GPU case (fp32 / fp16 on a
      GPU, bf16 before Hopper, rows that are not whole 16-byte units such as a width of 42);
    - one GEMM per expert over the sorted pairs (`_forward_loop`): every other CPU case (odd widths, a torch without
      the op).
    No path runs an expert on a token that did not pick it. The GPU paths read nothing back (graph-capturable).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.limit = limit

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                add: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, D], topk_ids/topk_weights [T, k] -> [T, D], plus `add` [T, D] (x's dtype: the shared expert's output)
        if given, as `out + add` adds it (the fused path's last kernel does). An id of -1 is another rank's expert
        (expert parallelism): that pair adds nothing and is not computed."""
        path = routed_path(moe_device(x), x.dtype, x.shape[1], self.w1.shape[1])
        if path.kernel == FUSED:
            return self._forward_fused(x, topk_ids, topk_weights, add)
        if path.kernel == GROUPED:
            out = self._forward_grouped(x, topk_ids, topk_weights)
        else:
            out = self._forward_loop(x, topk_ids, topk_weights)
        return out if add is None else out + add

    def _forward_fused(self, x, topk_ids, topk_weights, add=None) -> torch.Tensor:
        from sgl_kernel.dsv4_moe import dsv4_moe_dense

        return dsv4_moe_dense(x, topk_ids, topk_weights, self.w1, self.w3, self.w2, self.limit, add=add)

    def _sorted_pairs(self, x, topk_ids, topk_weights) -> tuple:
        """The (token, slot) pairs sorted by expert, other ranks' last: (token row per pair, num_tokens for other
        ranks' pairs; router weight per pair in x's dtype; pairs per expert [E + 1], int32, other ranks' last)."""
        num_experts, num_tokens = self.w1.shape[0], x.shape[0]
        flat_ids = topk_ids.flatten()
        flat_ids = torch.where(flat_ids < 0, num_experts, flat_ids)  # other ranks' pairs sort last, in no group
        order = torch.argsort(flat_ids, stable=True)
        sorted_ids = flat_ids[order]
        # the token of each sorted (token, expert) pair; other ranks' pairs land in a dropped row past the tokens
        rows = torch.where(sorted_ids < num_experts, order // topk_ids.shape[1], num_tokens)
        weights = topk_weights.flatten()[order, None].to(x.dtype)
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))  # bincount would sync
        return rows, weights, counts

    def _forward_grouped(self, x, topk_ids, topk_weights) -> torch.Tensor:
        num_experts, num_tokens = self.w1.shape[0], x.shape[0]
        rows, weights, counts = self._sorted_pairs(x, topk_ids, topk_weights)
        offs = torch.cumsum(counts[:num_experts], dim=0, dtype=torch.int32)  # end row of each expert's group
        xs = x[rows.clamp(max=num_tokens - 1)]
        # rows past offs[-1] (other ranks' pairs) are no group's: the GEMMs skip them, their outputs are garbage that
        # index_add_ sends to the dropped row
        h = swiglu(torch._grouped_mm(xs, self.w1.transpose(1, 2), offs=offs),
                   torch._grouped_mm(xs, self.w3.transpose(1, 2), offs=offs), self.limit)
        y = torch._grouped_mm(h, self.w2.transpose(1, 2), offs=offs) * weights
        out = torch.zeros(num_tokens + 1, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, rows, y)
        return out[:num_tokens]

    def _forward_loop(self, x, topk_ids, topk_weights) -> torch.Tensor:
        """The grouped GEMM's function, one expert's rows at a time (the counts read back: CPU only, no graphs);
        the outputs added in the same sorted order."""
        rows, weights, counts = self._sorted_pairs(x, topk_ids, topk_weights)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts[:-1].tolist()):
            if n:
                tokens, xe = rows[start:start + n], x[rows[start:start + n]]
                h = clamped_swiglu(xe @ self.w1[e].T, xe @ self.w3[e].T, self.limit)
                out.index_add_(0, tokens, (h @ self.w2[e].T) * weights[start:start + n])
            start += n
        return out


def log_moe_paths(models, dtype: torch.dtype) -> list:
    """Log, once per kind of MoE layer in `models` (those not None), the path its routed experts take
    (dispatch.routed_path for unquantized experts; the fused MoE's kernels for packed ones), with how many layers;
    returns the lines. `dtype`: the activations' (the model's compute dtype)."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.quantization.fp8 import Fp8RoutedExperts
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4RoutedExperts

    counts: dict = {}
    for module in (m for model in models if model is not None for m in model.modules()):
        if isinstance(module, RoutedExperts):
            w = module.w1
            path = routed_path(moe_device(w), w.dtype, w.shape[2], w.shape[1])
            line = routed_line(path, w.dtype)
        elif isinstance(module, Mxfp4RoutedExperts) and module.aiter is not None:
            line = "routed experts: AITER fused_moe (A8W4: MXFP8 activations, MXFP4 weights in its layout)"
        elif isinstance(module, (Mxfp4RoutedExperts, Fp8RoutedExperts)):
            fp4 = isinstance(module, Mxfp4RoutedExperts)
            line = packed_line("fp4" if fp4 else "fp8", module.w13.device, dtype, module.w2.shape[1],
                               module.intermediate_size, module.limit, fp4 and module.scales_fit_planes,
                               envs.SGLANG_DSV4_MOE_DECODE.get() == "auto")
        else:
            continue
        counts[line] = counts.get(line, 0) + 1
    lines = [f"{line} in {n} layer{'s' if n > 1 else ''}" for line, n in counts.items()]
    for line in lines:
        logger.info("%s", line)
    return lines


def append_shared_expert(routed: RoutedExperts, shared: SharedExpert) -> int:
    """Append the shared expert's weights to the routed stacks as expert E; returns E (its id)."""
    if routed.limit != shared.limit:  # the fused pass applies the routed clamp to it
        raise ValueError(f"shared-experts fusion needs one swiglu_limit, got routed {routed.limit} and shared "
                         f"{shared.limit}")
    shared_id = routed.w1.shape[0]
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            stacked, extra = getattr(routed, name), getattr(shared, name).weight
            fused = torch.cat((stacked.data, extra.data.to(stacked.dtype).unsqueeze(0)), dim=0)
            setattr(routed, name, nn.Parameter(fused, requires_grad=stacked.requires_grad))
    return shared_id


def replace_routed_experts(model: nn.Module, cls) -> int:
    """Swap every RoutedExperts of `model` for `cls(num_experts, hidden, intermediate, limit)` (a quantized layout,
    before the model is materialised); returns how many."""
    found = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, RoutedExperts):
            e, i, d = module.w1.shape
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, cls(e, d, i, module.limit))
            found += 1
    return found
