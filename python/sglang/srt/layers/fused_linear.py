"""Linears that read the same input, concatenated after loading into one (SGLang's fused_qkv_a_proj_with_mqa for
DeepSeek): one GEMM instead of several, and for FP8 weights one quantization of the activations. Each output column
is computed as before (its own dot product), so the function does not change; kernels may pick another tile or path
for the wider output, within their rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.quantization.fp8 import BLOCK, Fp8BlockLinear


def concat_linears(parts: list) -> Optional[nn.Module]:
    """One linear whose outputs are `parts`' outputs side by side, or None where they cannot be joined: different
    types, dtypes, devices or inputs, a bias, FP8 groups, or an FP8 part (but the last) whose outputs do not fill whole
    128-row scale blocks (its last block's multiplier would then cover the next part's rows)."""
    first = parts[0]
    if any(type(p) is not type(first) or p.in_features != first.in_features for p in parts):
        return None
    if isinstance(first, Fp8BlockLinear):
        if any(p.groups != 1 for p in parts) or any(p.out_features % BLOCK for p in parts[:-1]):
            return None
        tensors = {"weight": [p.weight for p in parts], "weight_scale_inv": [p.weight_scale_inv for p in parts]}
        with torch.device("meta"):
            fused = Fp8BlockLinear(first.in_features, sum(p.out_features for p in parts))
    elif type(first) is nn.Linear:
        if any(p.bias is not None for p in parts):
            return None
        tensors = {"weight": [p.weight for p in parts]}
        with torch.device("meta"):
            fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=False)
    else:
        return None
    for name, ts in tensors.items():
        if len({(t.dtype, t.device) for t in ts}) != 1:
            return None
        setattr(fused, name, nn.Parameter(torch.cat([t.detach() for t in ts]), requires_grad=False))
    return fused


def join_linears(owner: nn.Module, names: list, fused_name: str) -> bool:
    """Join `owner`'s linears `names` (dotted paths below it) into `owner.<fused_name>` with `concat_linears`; the
    parts become None and `owner.joined_parts` records where each part's parameters now are (rows of the joined
    ones), so a later weight update (`update_weights_from_disk`) can copy checkpoint tensors in place. False where
    they cannot be joined (then nothing changes)."""
    parts = [owner.get_submodule(n) for n in names]
    fused = concat_linears(parts)
    if fused is None:
        return False
    setattr(owner, fused_name, fused)
    starts: dict = {}
    for name, part in zip(names, parts):
        where = {}
        for pname, p in part.named_parameters(recurse=False):
            start = starts.get(pname, 0)
            where[pname] = (f"{fused_name}.{pname}", slice(start, start + p.shape[0]))
            starts[pname] = start + p.shape[0]
        record_joined(owner, name, where)
        parent, _, attr = name.rpartition(".")
        setattr(owner.get_submodule(parent) if parent else owner, attr, None)
    return True


def record_joined(owner: nn.Module, part: str, where: dict) -> None:
    """Note on `owner` that its former submodule `part` now lives elsewhere: {parameter name: (the parameter's path
    below owner, the index of its slice there)} (weight_loading.load_native_weights follows it)."""
    if not hasattr(owner, "joined_parts"):
        owner.joined_parts = {}
    owner.joined_parts[part] = where
