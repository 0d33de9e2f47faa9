"""IndexerLogitsWorkspace: one fixed-size block for the lightning indexer's prefill logits, reused by every layer
and every forward of the process.

A fresh [rows, context/4] fp32 tensor per layer per forward grows with the context and strands blocks in the
caching allocator (on MI355X it ends in HSA_STATUS_ERROR_OUT_OF_RESOURCES under long agentic workloads). Instead
the prefill logits are views into one block of `budget` bytes, allocated once; prefill processes query rows in
chunks of `logits_rows_per_chunk(width)` and finishes each chunk's top-k before the block is reused. Decode keeps a
plain allocation (its size is bounded by the batch and, under CUDA graphs, lives in the graph pool).
Budget: SGLANG_DSV4_FP4_LOGITS_BUDGET_MB (FP4 keys, default 2048) or SGLANG_DSV4_INDEXER_LOGITS_BUDGET_MB
(otherwise, default 512).
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.environ import envs


def logits_budget_var(index_format_name: str):
    """The budget variable for index keys in this format ("fp4" keys: the FP4 budget; "fp8" or dense: the other).
    arg_groups/platform_defaults.py prints the same choice at start."""
    return envs.SGLANG_DSV4_FP4_LOGITS_BUDGET_MB if "fp4" in index_format_name \
        else envs.SGLANG_DSV4_INDEXER_LOGITS_BUDGET_MB


def logits_budget_bytes(index_format_name: str) -> int:
    mb = logits_budget_var(index_format_name).get()
    if mb <= 0:
        raise ValueError(f"indexer logits budget must be positive, got {mb} MiB")
    return mb << 20


class IndexerLogitsWorkspace:
    def __init__(self, budget_bytes: int, device, pooled: Optional[bool] = None) -> None:
        self.budget_bytes = budget_bytes
        self.device = device
        self.pooled = (not envs.SGLANG_DSV4_DISABLE_LOGITS_POOL.get()) if pooled is None else pooled
        self._block: Optional[torch.Tensor] = None
        self.num_allocations = 0  # of the pooled block (stays 1; tests check it)

    def device_is_capturing(self) -> bool:
        return torch.device(self.device).type == "cuda" and torch.cuda.is_current_stream_capturing()

    def logits_rows_per_chunk(self, width: int) -> int:
        """Query rows whose fp32 logits over `width` candidates fit the block (at least 1); a multiple of 16 where
        16 fit, so each chunk's slices of the int64 row maps start 16 bytes aligned as whole batches do (Triton
        compiles a variant per pointer alignment: an odd chunk start would compile one inside a request)."""
        rows = max(1, self.budget_bytes // (4 * max(width, 1)))
        return rows - rows % 16 if rows >= 16 else rows

    def view(self, rows: int, width: int) -> torch.Tensor:
        """A [rows, width] fp32 view of the pooled block (rows <= logits_rows_per_chunk(width))."""
        if not self.pooled:
            return torch.empty(rows, width, dtype=torch.float32, device=self.device)
        need = rows * width
        if self._block is None:
            if self.device_is_capturing():
                # A block made during capture would live in the graph's private pool, not the process's.
                raise RuntimeError("the pooled indexer-logits block must be created outside CUDA graph capture "
                                   "(decode uses plain allocations; prefill is never captured)")
            # One row must always fit, even when a single row is wider than the budget.
            self._block = torch.empty(max(self.budget_bytes // 4, width), dtype=torch.float32, device=self.device)
            self.num_allocations += 1
        if need > self._block.numel():
            raise ValueError(f"{rows} rows x {width} candidates exceed the logits block; "
                             f"use logits_rows_per_chunk({width}) = {self.logits_rows_per_chunk(width)} rows at a time")
        return self._block[:need].view(rows, width)
