"""Copy native-named checkpoint tensors into a model's parameters.

The checkpoint loader (model_loader/loader.py) already checks names, shapes and dtypes against the config's
tensor spec; this second check guards the model side: every parameter must be filled exactly once.
"""

from __future__ import annotations

import re

import torch
from torch import nn

# The projections computed in fp32 from weights that may be kept bf16 (model_builder.bf16_projection_names): the
# compressors' wkv / wgate and the router's gate.
BF16_PROJECTION = re.compile(r"(compressor\.w(kv|gate)|(^|\.)ffn\.gate)\.weight$")
_EXPERT = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight(?P<scale>_scale)?$")


def load_native_weights(model: nn.Module, weights) -> None:
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    params = {k: v for k, v in params.items() if not k.endswith("inv_freq")}
    modules = dict(model.named_modules())
    filled: set = set()
    expert_slices: dict = {}  # stacked parameter -> the (expert, projection) slices written
    joined_parts: dict = {}  # joined parameter -> the native tensors written into it
    for name, tensor in weights:
        m = _EXPERT.match(name)
        if m:
            e, experts = int(m["e"]), modules.get(m["prefix"])
            if hasattr(experts, "load_expert"):  # packed layouts (MXFP4): the module places the slice
                if e >= experts.w13.shape[0]:
                    raise ValueError(f"checkpoint tensor '{name}': expert {e} >= {experts.w13.shape[0]}")
                target_name = f"{m['prefix']}.{experts.load_expert(m['w'], e, tensor, bool(m['scale']))}"
                expert_slices.setdefault(target_name, set()).add((e, m["w"]))
                continue
            target_name = f"{m['prefix']}.{m['w']}"
            target = params.get(target_name)
            if target is None or m["scale"]:
                raise KeyError(f"checkpoint tensor '{name}' has no model parameter '{target_name}'")
            if e >= target.shape[0] or tuple(tensor.shape) != tuple(target.shape[1:]):
                raise ValueError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(target.shape[1:])} for expert < {target.shape[0]}")
            with torch.no_grad():
                target[e].copy_(tensor)
            expert_slices.setdefault(target_name, set()).add((e, m["w"]))
            continue
        target = params.get(name)
        if target is None and (joined := _joined_target(modules, name)) is not None:
            target_name, index = joined  # joined after the first load (fused_linear.join_linears): a slice of it
            target = params[target_name][index]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(target.shape)} (its part of '{target_name}')")
            check_bf16_values(name, tensor, target)
            with torch.no_grad():
                target.copy_(tensor)
            if isinstance(index, int):  # a fused shared expert: one more expert of the stack
                expert_slices.setdefault(target_name, set()).add((index, target_name.rpartition(".")[2]))
            else:
                joined_parts.setdefault(target_name, set()).add(name)
            continue
        if target is None:
            raise KeyError(f"checkpoint tensor '{name}' does not match any model parameter")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        check_bf16_values(name, tensor, target)
        with torch.no_grad():
            target.copy_(tensor)
        filled.add(name)
    for name, parts in joined_parts.items():
        if len(parts) == _joined_count(modules, name):
            filled.add(name)
    for name, slices in expert_slices.items():  # w13 holds two projections per expert
        if len(slices) == params[name].shape[0] * (2 if name.split(".")[-1].startswith("w13") else 1):
            filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise KeyError(f"{len(missing)} model parameters were not in the checkpoint: {shown}")


def check_bf16_values(name: str, tensor: torch.Tensor, target) -> None:
    """A projection kept bf16 (BF16_PROJECTION) takes only bf16 values: one it would round (a weight update from a
    checkpoint storing true fp32 values where the served one stored bf16) raises instead. `target`: the parameter,
    or its rows of the joined one."""
    if not BF16_PROJECTION.search(name) or target.dtype != torch.bfloat16 or tensor.dtype == torch.bfloat16:
        return
    if not torch.allclose(tensor.to(torch.bfloat16).to(tensor.dtype), tensor, rtol=0, atol=0, equal_nan=True):
        raise ValueError(f"checkpoint tensor '{name}' holds values that are not bf16 values, but the model keeps it "
                         "bf16 (loaded from a checkpoint storing it bf16): restart the server to load it in fp32")


def _joined_target(modules: dict, name: str):
    """(the joined parameter's model name, the index of this tensor's slice in it) for a native name whose module
    was joined into another after the first load (an owner's `joined_parts`), or None."""
    parts = name.split(".")
    for cut in range(len(parts) - 2, -1, -1):
        owner = modules.get(".".join(parts[:cut]))
        where = getattr(owner, "joined_parts", {}).get(".".join(parts[cut:-1]))
        if where is not None and parts[-1] in where:
            path, index = where[parts[-1]]
            return ".".join(parts[:cut] + [path]), index
    return None


def _joined_count(modules: dict, target_name: str) -> int:
    """How many native tensors a joined parameter (rows of several) is made of."""
    count = 0
    for owner_name, owner in modules.items():
        for where in getattr(owner, "joined_parts", {}).values():
            for path, index in where.values():
                if ".".join(p for p in (owner_name, path) if p) == target_name and isinstance(index, slice):
                    count += 1
    return count


def find_weight(model: nn.Module, name: str):
    """The tensor the checkpoint tensor `name` (a native name) was loaded into, as a view, or None: a parameter or
    buffer, its slice of a joined one, or one expert's slice of a stacked (unpacked) expert parameter. Packed
    expert layouts (MXFP4, FP8 experts) are not mapped back."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    if name in params:
        return params[name]
    modules = dict(model.named_modules())
    joined = _joined_target(modules, name)
    if joined is not None:
        return params[joined[0]][joined[1]]
    m = _EXPERT.match(name)
    if m and not m["scale"] and not hasattr(modules.get(m["prefix"]), "load_expert"):
        stacked = params.get(f"{m['prefix']}.{m['w']}")
        if stacked is not None and int(m["e"]) < stacked.shape[0]:
            return stacked[int(m["e"])]
    return None
