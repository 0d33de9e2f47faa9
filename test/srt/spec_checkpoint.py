"""A checkpoint whose MTP draft predicts the target exactly, to measure real acceptance.

The target ignores its context: every attention output (`wo_b`) and every expert's `w2` (routed and shared) is zero,
so the residual streams stay proportional to the token's embedding u_x, and the head maps u_x to the successor token:
head[y] = u_{y-1}, so greedy decoding counts x, x+1, x+2, ... (random embeddings of dim >= 256 are nearly orthogonal,
so the self product wins by a wide margin). The MTP layer gets h_proj = 0, e_proj = I and the same zeroed attention
and experts, so its output is the embedding of x_{p+1} and its logits predict x_{p+1} + 1: exactly the target's next
token. With the MTP left random the draft is wrong almost always.

The edits apply to the drawn values before they are stored, so the same writer stores them in the hub's formats too
(`quantize`): an all-zero FP8 block or MXFP4 group gets a finite power-of-two scale and zero codes, and I in FP8 is
exact (1 = 256 x 2^-8 per diagonal block).
"""

from __future__ import annotations

from typing import Callable

import torch

ONES = ("norm.weight", "enorm.weight", "hnorm.weight")  # the final norms and the MTP's input norms


def predictable_edit(name: str, value: torch.Tensor, draw: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """tiny_checkpoint's `edit` that makes the draft predict the target (this module's docstring)."""
    if name == "head.weight":
        return torch.roll(draw("embed.weight"), shifts=1, dims=0)  # head[y] = u_{y-1}
    if name.endswith("attn.wo_b.weight") or name.endswith(".w2.weight") or name.endswith(".h_proj.weight"):
        return torch.zeros_like(value)
    if name.endswith(".e_proj.weight"):
        return torch.eye(value.shape[0], device=value.device)
    if name == "norm.weight" or (name.startswith("mtp.") and name.split(".", 2)[2] in ONES):
        return torch.ones_like(value)
    return value


def make_predictable_checkpoint(out_dir: str, config: dict, quantize: bool = False, dtype: str = "float32",
                                device: str = "cpu", shard_gb=None) -> str:
    """Write the predictable variant of the random checkpoint of `config` (seed 0) to `out_dir`."""
    from sglang.srt.model_loader.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(out_dir, config, seed=0, quantize=quantize, dtype=dtype, shard_gb=shard_gb,
                                device=device, edit=predictable_edit)
