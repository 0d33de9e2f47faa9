"""Clamped-SwiGLU experts: the routed experts (stacked weights) and the always-on shared expert.

Expert(x) = w2 . (silu(min(w1 x, L)) * clamp(w3 x, -L, L)), L = swiglu_limit; the clamp is asymmetric and applies
to routed and shared experts alike (arch section 6). Routed weights are stored stacked [E, ...] under the
names `experts.w1|w2|w3`; the loader maps the checkpoint's per-expert tensors into slices.

Shared-experts fusion (`append_shared_expert`, after loading): the shared expert becomes routed expert E, which
every token selects with weight 1, so one grouped pass computes both. Because DeepSeek-V4 clamps shared and
routed experts with the same swiglu_limit, the fused result equals the unfused one (upstream keeps fusion off by
default on CUDA because some fused implementations clamp the shared expert differently).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit
        self.w13 = None  # kept FP8: w1 and w3 as one linear after loading (models/deepseek_v4.join_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(clamped_swiglu(gate, up, self.limit))
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class RoutedExperts(nn.Module):
    """E experts; forward sums each token's k selected experts weighted by the router.

    Rows sorted by expert go through torch's grouped GEMM where it exists (CPU, Hopper bf16); elsewhere every expert
    runs on every token. Fused MoE kernels (quantized experts) replace both later.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.limit = limit

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], topk_ids/topk_weights [T, k] -> [T, D]: one grouped GEMM per projection over rows sorted by expert
        when torch offers it for this device and dtype, else the dense fallback (neither reads the device). An id of
        -1 is another rank's expert (expert parallelism): that pair adds nothing and is not computed. torch's grouped
        GEMM takes rows of whole 16-byte units only: a hidden or (per-rank) intermediate width that is not (a
        checkpoint's odd moe_intermediate_size, or its part on one rank) runs the dense path."""
        if grouped_mm_supported(x) and all(n * x.element_size() % 16 == 0 for n in (x.shape[1], self.w1.shape[1])):
            return self._forward_grouped(x, topk_ids, topk_weights)
        return self._forward_dense(x, topk_ids, topk_weights)

    def _forward_dense(self, x, topk_ids, topk_weights) -> torch.Tensor:
        """Every expert on every token, weighted by the router (0 for experts not picked): fixed shapes, no host read
        (CUDA-graph safe). The fallback where torch has no grouped GEMM for this device and dtype (fp32 on a GPU,
        GPUs before Hopper): E times the work, meant for small models and tests."""
        num_experts = self.w1.shape[0]
        coef = torch.zeros(x.shape[0], num_experts + 1, dtype=x.dtype, device=x.device)  # column E: other ranks'
        coef.scatter_add_(1, torch.where(topk_ids < 0, num_experts, topk_ids), topk_weights.to(x.dtype))
        coef = coef[:, :num_experts]  # [T, E]
        h = clamped_swiglu(torch.einsum("td,eid->eti", x, self.w1), torch.einsum("td,eid->eti", x, self.w3),
                           self.limit)
        return torch.einsum("te,etd->td", coef, torch.einsum("eti,edi->etd", h, self.w2))

    def _forward_grouped(self, x, topk_ids, topk_weights) -> torch.Tensor:
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
        offs = torch.cumsum(counts[:num_experts], dim=0, dtype=torch.int32)  # end row of each expert's group
        xs = x[rows.clamp(max=num_tokens - 1)]
        # rows past offs[-1] (other ranks' pairs) are no group's: the GEMMs skip them, their outputs are garbage that
        # index_add_ sends to the dropped row
        h = clamped_swiglu(torch._grouped_mm(xs, self.w1.transpose(1, 2), offs=offs),
                           torch._grouped_mm(xs, self.w3.transpose(1, 2), offs=offs), self.limit)
        y = torch._grouped_mm(h, self.w2.transpose(1, 2), offs=offs) * weights
        out = torch.zeros(num_tokens + 1, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, rows, y)
        return out[:num_tokens]


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs on CPU (torch >= 2.9) and on NVIDIA Hopper or newer for bf16; elsewhere (fp32 on a
    GPU, older GPUs, ROCm without support) the dense fallback is used."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return _cpu_grouped_mm_works()
    return x.dtype == torch.bfloat16 and _cuda_grouped_mm_works(x.device)


@functools.lru_cache(maxsize=None)
def _cpu_grouped_mm_works() -> bool:
    return _probe(torch.device("cpu"), torch.float32)


@functools.lru_cache(maxsize=None)
def _cuda_grouped_mm_works(device: torch.device) -> bool:
    if torch.version.hip is None and torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return _probe(device, torch.bfloat16)


def _probe(device, dtype) -> bool:
    """One tiny grouped GEMM against the plain product: the op exists in many builds but not on every backend."""
    try:
        a = torch.ones(4, 16, dtype=dtype, device=device)
        b = torch.ones(2, 16, 8, dtype=dtype, device=device)
        out = torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32, device=device))
        return bool((out == 16).all())
    except (RuntimeError, NotImplementedError):
        return False


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
