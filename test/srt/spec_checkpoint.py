"""A checkpoint whose MTP draft predicts the target exactly, to measure real acceptance.

The target ignores its context: every attention output (`wo_b`) and every expert's `w2` is zero, so the residual
streams stay proportional to the token's embedding u_x, and the head maps u_x to the successor token: head[y] =
u_{y-1}, so greedy decoding counts x, x+1, x+2, ... (random embeddings of dim 256 are nearly orthogonal, so the
self product wins by a wide margin). The MTP layer gets h_proj = 0, e_proj = I and the same zeroed attention and
experts, so its output is the embedding of x_{p+1} and its logits predict x_{p+1} + 1: exactly the target's next
token. With the MTP left random the draft is wrong almost always.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def make_predictable(src: str, dst: str) -> str:
    if os.path.exists(dst):
        return dst
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    vocab, d = config["vocab_size"], config["hidden_size"]
    embed = t["embed.weight"]
    t["head.weight"] = torch.roll(embed, shifts=1, dims=0).contiguous()  # head[y] = u_{y-1}
    for name in list(t):
        if name.endswith("attn.wo_b.weight") or name.endswith(".w2.weight"):
            t[name] = torch.zeros_like(t[name])
        elif name in ("norm.weight", "mtp.0.norm.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight"):
            t[name] = torch.ones_like(t[name])
    t["mtp.0.h_proj.weight"] = torch.zeros(d, d)
    t["mtp.0.e_proj.weight"] = torch.eye(d)
    assert embed.shape == (vocab, d)
    save_file(t, path)
    return dst
