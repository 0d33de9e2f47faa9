"""Copy native-named checkpoint tensors into a model's parameters.

The checkpoint loader (model_loader/loader.py) already checks names, shapes and dtypes against the config's
tensor spec; this second check guards the model side: every parameter must be filled exactly once.
"""

from __future__ import annotations

import re

import torch
from torch import nn

_EXPERT = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")


def load_native_weights(model: nn.Module, weights) -> None:
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    params = {k: v for k, v in params.items() if not k.endswith("inv_freq")}
    filled: set = set()
    expert_slices: dict = {}
    for name, tensor in weights:
        m = _EXPERT.match(name)
        if m:
            target_name = f"{m['prefix']}.{m['w']}"
            target = params.get(target_name)
            if target is None:
                raise KeyError(f"checkpoint tensor '{name}' has no model parameter '{target_name}'")
            e = int(m["e"])
            if e >= target.shape[0] or tuple(tensor.shape) != tuple(target.shape[1:]):
                raise ValueError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(target.shape[1:])} for expert < {target.shape[0]}")
            with torch.no_grad():
                target[e].copy_(tensor)
            expert_slices.setdefault(target_name, set()).add(e)
            continue
        target = params.get(name)
        if target is None:
            raise KeyError(f"checkpoint tensor '{name}' does not match any model parameter")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        filled.add(name)
    for name, experts in expert_slices.items():
        if len(experts) == params[name].shape[0]:
            filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise KeyError(f"{len(missing)} model parameters were not in the checkpoint: {shown}")
