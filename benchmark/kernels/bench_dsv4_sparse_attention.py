"""Benchmark of dsv4_sparse_attention (window + compressed entries with the sink) on DeepSeek-V4-Flash decode.

Cases: batch 1, 8, 32, 128 x context 4K, 64K, 1M, one query row per request, H = 64, D = 512, rope 64, W = 128:
* CSA layer: 128 window keys + min(512, ctx / 4) indexer-chosen compressed entries (per-row lists),
* HCA layer: 128 window keys + ctx / 128 compressed entries (per-request lists, row_map + len),
FP8 cache (584 B rows) everywhere, plus one bf16-cache case (1024 B rows).
bytes_moved = q + every gathered key row once + output (bf16): the decode roofline numerator; flops = 4 H D keys.
`baseline_us` = the torch reference on a few cases.
"""

from __future__ import annotations

import os
import sys

import torch

from sgl_kernel.dsv4_sparse_attention import dsv4_sparse_attention, dsv4_sparse_attention_ref
from sgl_kernel.dsv4_store_kv import fp8_kv_row_bytes

try:
    from .common import BenchRow, time_cuda_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import BenchRow, time_cuda_us

H, D, ROPE, W = 64, 512, 64, 128
BATCHES = (1, 8, 32, 128)
CONTEXTS = (4096, 65536, 1 << 20)
MAX_POOL_ROWS = 1 << 22  # CSA pools are capped (the slots stay random; only locality changes)
BASELINE_CASES = {("csa", 1, 65536), ("hca", 1, 65536), ("csa", 32, 65536)}


def _random_cache(rows: int, fp8: bool, device) -> torch.Tensor:
    """Valid rows without quantizing: e4m3 codes below NaN, scale bytes 2^-7, bf16 rope values."""
    if not fp8:
        return torch.randn(rows, D, dtype=torch.bfloat16, device=device)
    nope = D - ROPE
    cache = torch.randint(0, 0x7E, (rows, fp8_kv_row_bytes(D, ROPE)), dtype=torch.uint8, device=device)
    cache[:, :nope] |= torch.randint(0, 2, (rows, nope), dtype=torch.uint8, device=device) << 7
    cache[:, nope: nope + 2 * ROPE] = torch.randn(rows, ROPE, device=device).bfloat16().view(torch.uint8)
    cache[:, nope + 2 * ROPE:] = 0
    cache[:, nope + 2 * ROPE: nope + 2 * ROPE + nope // 64] = 120
    return cache


def _args(layer: str, batch: int, ctx: int, fp8: bool, device) -> dict:
    window_slots = torch.arange(batch * W, device=device).view(batch, W)
    kw = dict(window_cache=_random_cache(batch * W, fp8, device), window_slots=window_slots)
    if layer == "csa":
        entries = min(512, ctx // 4)
        pool = min(batch * ctx // 4, MAX_POOL_ROWS)
        kw["extra_cache"] = _random_cache(pool, fp8, device)
        kw["extra_slots"] = torch.randint(0, pool, (batch, entries), device=device)
    else:
        entries = ctx // 128
        kw["extra_cache"] = _random_cache(batch * entries, fp8, device)
        kw["extra_slots"] = torch.arange(batch * entries, device=device).view(batch, entries)
        kw["extra_row_map"] = torch.arange(batch, device=device)
        kw["extra_len"] = torch.full((batch,), entries, dtype=torch.int32, device=device)
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device=device)
    sink = torch.randn(H, device=device)
    return dict(q=q, sink=sink, softmax_scale=D ** -0.5, fp8_rope_dim=ROPE if fp8 else 0, **kw), W + entries


def _row(layer: str, batch: int, ctx: int, fp8: bool) -> BenchRow:
    args, keys = _args(layer, batch, ctx, fp8, "cuda")
    out = torch.empty_like(args["q"])
    us = time_cuda_us(lambda: dsv4_sparse_attention(**args, out=out))
    baseline = None
    if (layer, batch, ctx) in BASELINE_CASES and fp8:
        baseline = time_cuda_us(lambda: dsv4_sparse_attention_ref(**args), iters=10, warmup=2)
    row_bytes = fp8_kv_row_bytes(D, ROPE) if fp8 else 2 * D
    moved = 2 * batch * H * D * 2 + batch * keys * row_bytes
    return BenchRow(kernel="dsv4_sparse_attention", case=f"{layer} bs={batch} ctx={ctx} {'fp8' if fp8 else 'bf16'}",
                    time_us=us, bytes_moved=moved, flops=4.0 * batch * H * D * keys, baseline_us=baseline,
                    note=f"{keys} keys/row")


def bench() -> list:
    rows = []
    for layer in ("csa", "hca"):
        for batch in BATCHES:
            for ctx in CONTEXTS:
                rows.append(_row(layer, batch, ctx, fp8=True))
                torch.cuda.empty_cache()
    rows.append(_row("csa", 32, 65536, fp8=False))
    return rows


if __name__ == "__main__":
    for r in bench():
        print(f"{r.case:32s} {r.time_us:9.1f} us {r.gbps():7.0f} GB/s  ref {r.baseline_us or 0:9.1f} us  {r.note}")
