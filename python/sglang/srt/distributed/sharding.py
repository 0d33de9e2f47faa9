"""How DeepSeek-V4's parameters split over ranks (docs: next-features.md section 3): the contract tensor / expert
parallelism loads by, matched by the model each rank builds (which the capacity planner counts; test_check_capacity
checks the two agree).

Ranks: `tp` GPUs in all (SGLang's --tp-size). Attention runs tensor-parallel over `attn_tp` = tp ranks, or, with
--enable-dp-attention, data-parallel over `dp` groups of attn_tp = tp / dp ranks each (the DeepSeek serving layout:
each DP group attends to its own requests). The MoE runs over all tp ranks: routed experts split over `ep` ranks
(E / ep each), each expert's intermediate dim over moe_tp = tp / ep; the shared expert tensor-parallel over tp.

Per parameter (by native name; FP8 block scales and packed FP4 codes and scales split the same way):
- query heads split: `attn.wq_b` rows, grouped `attn.wo_a` rows (whole groups), `attn.wo_b` columns (row-parallel,
  all-reduced), `attn.attn_sink` over attn_tp; the shared K=V head (`attn.wkv`), the low-rank `attn.wq_a`, norms,
  compressors and the lightning indexer are replicated (every rank selects the same entries);
- routed experts: dim 0 over ep, the intermediate dim over moe_tp; shared expert w1/w3 rows and w2 columns over tp;
- embedding and LM head rows (vocabulary) over attn_tp (each DP group holds the whole vocabulary: it embeds and
  samples its own requests); router, mHC weights and everything else replicated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    ep: int = 1
    dp: int = 1
    dp_attention: bool = False

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp if self.dp_attention else self.tp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def validate(self, config) -> None:
        """Raise ValueError naming the sizes that do not divide. Only what this layout splits is checked, in any
        stored format: a width that no rank splits may be anything (a packed-MXFP4 checkpoint's own blocks of 32 are
        the loader's format check); whether quantized experts can stay packed when split is
        `experts_split_whole_blocks` (they are dequantized at load where not)."""
        problems = []
        for name, value in (("--tp", self.tp), ("--ep", self.ep), ("--dp", self.dp)):
            if value < 1:
                problems.append(f"{name} must be >= 1, got {value}")
        if problems:
            raise ValueError("; ".join(problems))
        if self.tp % self.ep:
            problems.append(f"--ep {self.ep} must divide --tp {self.tp}")
        if self.dp > 1 and not self.dp_attention:
            problems.append("--dp > 1 needs --enable-dp-attention")
        if self.dp_attention and self.tp % self.dp:
            problems.append(f"--dp {self.dp} must divide --tp {self.tp}")
        if not problems:
            a = self.attn_tp
            if config.num_attention_heads % a:
                problems.append(f"{config.num_attention_heads} attention heads do not split over {a} ranks")
            if config.o_groups % a:
                problems.append(f"o_groups {config.o_groups} (the grouped output projection) does not split over "
                                f"{a} ranks")
            if config.n_routed_experts % self.ep:
                problems.append(f"{config.n_routed_experts} routed experts do not split over --ep {self.ep}")
            if config.moe_intermediate_size % self.tp:
                problems.append(f"moe_intermediate_size {config.moe_intermediate_size} does not split over --tp "
                                f"{self.tp} ranks (each holds 1/{self.tp} of the shared expert's intermediate width"
                                + (f" and 1/{self.moe_tp} of every routed expert's" if self.moe_tp > 1 else "") + ")")
        if problems:
            raise ValueError("; ".join(problems))


# Inputs per scale of the routed experts' stored formats kept quantized: MXFP4 codes share one E8M0 scale per 32 inputs,
# FP8 experts one multiplier per 128 x 128 block.
EXPERT_BLOCKS = {"fp4": 32, "fp8": 128}


def experts_split_whole_blocks(config, pc: ParallelConfig, experts: str) -> bool:
    """Whether every MoE tensor-parallel rank's part of the routed experts' intermediate width is whole scale blocks
    of the kept format `experts` ("fp4" / "fp8"), so its scales split with it. One rank holds whole experts (any
    width the checkpoint stores); a part cutting through blocks cannot stay quantized (the loader dequantizes the
    experts instead: model_builder.kept_formats)."""
    return pc.moe_tp == 1 or config.moe_intermediate_size % (EXPERT_BLOCKS[experts] * pc.moe_tp) == 0


# (name pattern, per dim: which parallel size divides it) for the split parameters; the rest are replicated.
_RULES = [
    (re.compile(r"(^|\.)attn\.(wq_b|wo_a)\.(weight|weight_scale_inv)$"), ("attn_tp", None)),
    (re.compile(r"(^|\.)attn\.wo_b\.(weight|weight_scale_inv)$"), (None, "attn_tp")),
    (re.compile(r"(^|\.)attn\.attn_sink$"), ("attn_tp",)),
    (re.compile(r"\.ffn\.experts\.(w1|w3|w13)(_scale)?$"), ("ep", "moe_tp", None)),
    (re.compile(r"\.ffn\.experts\.w2(_scale)?$"), ("ep", None, "moe_tp")),
    (re.compile(r"\.ffn\.shared_experts\.(w1|w3)\.(weight|weight_scale_inv)$"), ("tp", None)),
    (re.compile(r"\.ffn\.shared_experts\.w2\.(weight|weight_scale_inv)$"), (None, "tp")),
    (re.compile(r"^(embed|head)\.weight$"), ("attn_tp", None)),
]


def shard_shape(name: str, shape: tuple, pc: ParallelConfig) -> tuple:
    """The shape of one rank's part of parameter `name` (ceil division: the largest part)."""
    for pattern, dims in _RULES:
        if pattern.search(name) and len(dims) == len(shape):
            return tuple(math.ceil(n / getattr(pc, d)) if d else n for n, d in zip(shape, dims))
    return tuple(shape)


def splits_whole_blocks(name: str, shape: tuple, pc: ParallelConfig, block: int = 128) -> bool:
    """Whether every rank's part of FP8 weight `name` (stored `shape`) is whole block x block tiles along each split
    dim, so its block multipliers split with it (unsplit dims may end in a partial block, as on one rank). A part that
    cuts through blocks (a small model's 384-row wq_b over 2 ranks) cannot stay FP8: the loader dequantizes that
    linear instead (model_builder.kept_formats)."""
    part = shard_shape(name, shape, pc)
    return all(p == n or (n % p == 0 and p % block == 0) for p, n in zip(part, shape))


# The same rules for the tensors the checkpoint loader streams (native names; experts one tensor per expert, their
# index renumbered on the rank that holds them). `weight_scale_inv` (FP8 128x128 block multipliers) splits by blocks.
_TENSOR_RULES = [
    (re.compile(r"\.ffn\.experts\.\d+\.(w1|w3)\.weight(_scale)?$"), ("moe_tp", None)),
    (re.compile(r"\.ffn\.experts\.\d+\.w2\.weight(_scale)?$"), (None, "moe_tp")),
    *[(p, d) for p, d in _RULES if "ffn\\.experts" not in p.pattern],  # the stacked routed-expert rules
]
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<e>\d+)\.(?P<rest>.*)$")
_PADDED = re.compile(r"^(embed|head)\.weight$")  # vocabulary rows: the last rank's part is zero-padded


@dataclass(frozen=True)
class RankCoords:
    """This rank's index along each parallel kind (distributed/parallel_state.py derives them)."""
    tp: int = 0
    attn_tp: int = 0
    ep: int = 0
    moe_tp: int = 0


def local_expert_range(num_experts: int, pc: ParallelConfig, coords: RankCoords) -> range:
    per_rank = num_experts // pc.ep
    return range(coords.ep * per_rank, (coords.ep + 1) * per_rank)


def local_name(name: str, pc: ParallelConfig, coords: RankCoords, num_experts: int):
    """The name this rank loads checkpoint tensor `name` under (experts renumbered), or None when it is an expert
    another rank holds (the loader then does not read it)."""
    m = _EXPERT_TENSOR.match(name)
    if not m:
        return name
    experts = local_expert_range(num_experts, pc, coords)
    e = int(m["e"])
    return f"{m['prefix']}.{e - experts.start}.{m['rest']}" if e in experts else None


def rank_tensor(name: str, tensor, pc: ParallelConfig, coords: RankCoords, num_experts: int):
    """(the name this rank loads it under, its part) for one checkpoint tensor, or None when the tensor is an
    expert another rank holds. Raises ValueError for a split that does not divide (FP8 block scales included)."""
    name = local_name(name, pc, coords, num_experts)
    if name is None:
        return None
    for pattern, dims in _TENSOR_RULES:
        if pattern.search(name) and len(dims) == tensor.dim():
            for dim, kind in enumerate(dims):
                if kind is not None and getattr(pc, kind) > 1:
                    tensor = _part(name, tensor, dim, getattr(pc, kind), getattr(coords, kind))
            break
    return name, tensor


def _part(name: str, tensor, dim: int, parts: int, index: int):
    n = tensor.shape[dim]
    if n % parts == 0:
        size = n // parts
        return tensor.narrow(dim, index * size, size)
    if not _PADDED.search(name):
        raise ValueError(f"tensor '{name}': dim {dim} of size {n} does not split over {parts} ranks")
    size = math.ceil(n / parts)
    start, stop = min(index * size, n), min((index + 1) * size, n)
    out = tensor.new_zeros(tensor.shape[:dim] + (size,) + tensor.shape[dim + 1:])
    out.narrow(dim, 0, stop - start).copy_(tensor.narrow(dim, start, stop - start))
    return out
