"""Benchmark of the lightning indexer: dsv4_index_logits and dsv4_topk_slots on Flash shapes, against their
torch references (`baseline_us`).

* index logits: nI 64, dI 128, bf16 queries, fp8 (132 B) and fp4 (68 B) key rows. Decode: batch 1..64, each
  row its own request with E = 4K..256K candidates laid out in 64-entry pages at random pool pages (the pool
  holds T * E distinct rows, so keys come from HBM, not L2). Prefill: one 2048-row chunk of one request.
  bytes_moved = every candidate key row read once (per request) + q read + the fp32 logits written.
* top-k: k 512 (Flash) / 1024 (Pro) over 16K..256K candidates, batch 1 and 64, a quarter of each row masked.
  bytes_moved = the logits read once + the int64 slots written.
* capacity (`--capacity`: these cases only): logits + top-k as a decode graph runs them, lists of a 1M-token
  capacity (262,144 CSA entries) of which each row sees 256 (a 1K-token context) or 32,768 (128K), batch 1, 32,
  128, fp8 keys, k 512: the engine's call (nothing written or read past a row's visible entries) against the
  lists' whole width (-inf written there, then read: `baseline_us`). bytes_moved = the visible keys read once.

    python benchmark/kernels/bench_dsv4_indexer.py [--capacity]
"""

from __future__ import annotations

import os
import sys

import torch

from sgl_kernel.dsv4_index_logits import dsv4_index_logits, dsv4_index_logits_ref
from sgl_kernel.dsv4_topk import dsv4_topk_slots, dsv4_topk_slots_ref

try:
    from .common import BenchRow, time_cuda_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import BenchRow, time_cuda_us

HEADS, HEAD_DIM, PAGE = 64, 128, 64
ROW_BYTES = {"fp8": HEAD_DIM + 4, "fp4": HEAD_DIM // 2 + HEAD_DIM // 32}
LOGIT_BATCHES = (1, 8, 64)
LOGIT_CANDIDATES = (4096, 32768, 262144)
PREFILL_ROWS, PREFILL_CANDIDATES = 2048, 16896  # a 2048-token chunk at ~66K context
TOPK_BATCHES = (1, 64)
TOPK_CANDIDATES = (16384, 65536, 262144)
TOPK_K = (512, 1024)


def _key_pool(kind: str, num_rows: int, device) -> torch.Tensor:
    """Valid rows without the engine: e4m3 codes of randn with scale 1.0, or random e2m1 nibbles with 2^0."""
    if kind == "fp8":
        codes = torch.randn(num_rows, HEAD_DIM, device=device).to(torch.float8_e4m3fn).view(torch.uint8)
        scale = torch.ones(num_rows, 1, device=device).view(torch.uint8)
        return torch.cat((codes, scale), dim=1)
    codes = torch.randint(0, 256, (num_rows, HEAD_DIM // 2), dtype=torch.uint8, device=device)
    scale = torch.full((num_rows, HEAD_DIM // 32), 127, dtype=torch.uint8, device=device)
    return torch.cat((codes, scale), dim=1)


def _paged_slots(lists: int, width: int, device) -> torch.Tensor:
    """[lists, width] slots: 64-entry pages, each list's pages at random places of a lists * width pool."""
    pages = torch.randperm(lists * width // PAGE, device=device).view(lists, width // PAGE)
    return (pages[:, :, None] * PAGE + torch.arange(PAGE, device=device)).view(lists, width)


def _logits_args(kind: str, rows: int, width: int, prefill: bool, device) -> dict:
    lists = 1 if prefill else rows
    cand = _paged_slots(lists, width, device)
    if prefill:  # causal rows of one request: the last row sees every entry
        visible = torch.div(torch.arange(rows, device=device) + 4 * width - rows + 1, 4, rounding_mode="floor")
    else:
        visible = torch.full((rows,), width, device=device)
    return dict(q=torch.randn(rows, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16),
                weights=torch.randn(rows, HEADS, device=device) * HEADS ** -0.5,
                key_cache=_key_pool(kind, lists * width, device), key_format=f"{kind}_index", cand_slots=cand,
                row_map=torch.zeros(rows, dtype=torch.int64, device=device) if prefill
                else torch.arange(rows, device=device),
                visible=visible, out=torch.empty(rows, width, device=device))


def _bench_logits(kind: str, rows: int, width: int, prefill: bool, device) -> BenchRow:
    args = _logits_args(kind, rows, width, prefill, device)
    us = time_cuda_us(lambda: dsv4_index_logits(**args))
    base = time_cuda_us(lambda: dsv4_index_logits_ref(**args), iters=3, warmup=1)
    lists = args["cand_slots"].shape[0]
    moved = lists * width * ROW_BYTES[kind] + args["q"].numel() * 2 + rows * width * 4
    case = f"{'prefill' if prefill else 'bs'}={rows} E={width} {kind}"
    return BenchRow(kernel="dsv4_index_logits", case=case, time_us=us, bytes_moved=float(moved),
                    flops=2.0 * rows * width * HEADS * HEAD_DIM, baseline_us=base)


def _bench_topk(rows: int, width: int, k: int, device) -> BenchRow:
    logits = torch.randn(rows, width, device=device)
    logits[:, width * 3 // 4:] = float("-inf")  # the invisible tail of a causal row
    cand = _paged_slots(rows, width, device)
    row_map = torch.arange(rows, device=device)
    us = time_cuda_us(lambda: dsv4_topk_slots(logits, cand, row_map, k))
    base = time_cuda_us(lambda: dsv4_topk_slots_ref(logits, cand, row_map, k), iters=10, warmup=2)
    return BenchRow(kernel="dsv4_topk_slots", case=f"bs={rows} E={width} k={k}", time_us=us,
                    bytes_moved=float(rows * width * 4 + rows * k * 8), baseline_us=base)


CAPACITY_WIDTH, CAPACITY_SEEN, CAPACITY_BATCHES = 262144, (256, 32768), (1, 32, 128)


def _bench_capacity(rows: int, seen: int, device) -> BenchRow:
    """Logits then top-k over capacity-wide lists where each row sees `seen` entries: the engine's call against
    the whole width's."""
    args = _logits_args("fp8", rows, CAPACITY_WIDTH, False, device)
    args["visible"] = torch.full((rows,), seen, device=device)
    cand, vis = args["cand_slots"], args["visible"]

    def engine():
        dsv4_index_logits(**args, fill_invisible=False)
        dsv4_topk_slots(args["out"], cand, None, 512, visible=vis)

    def whole_width():
        dsv4_index_logits(**args)
        dsv4_topk_slots(args["out"], cand, None, 512)

    engine()
    picked = dsv4_topk_slots(args["out"], cand, None, 512, visible=vis)
    whole_width()
    if not torch.equal(picked.sort(dim=1).values, dsv4_topk_slots(args["out"], cand, None, 512).sort(dim=1).values):
        raise AssertionError(f"bs={rows} seen={seen}: the two calls picked different entries")
    us, base = time_cuda_us(engine), time_cuda_us(whole_width)
    return BenchRow(kernel="index_logits+topk", case=f"bs={rows} E={CAPACITY_WIDTH} seen={seen} fp8 k=512",
                    time_us=us, bytes_moved=float(rows * seen * ROW_BYTES["fp8"]), baseline_us=base)


def bench_capacity() -> list[BenchRow]:
    rows = []
    for seen in CAPACITY_SEEN:
        for batch in CAPACITY_BATCHES:
            rows.append(_bench_capacity(batch, seen, "cuda"))
            torch.cuda.empty_cache()
    return rows


def bench() -> list[BenchRow]:
    device = "cuda"
    rows = []
    for kind in ("fp8", "fp4"):
        for batch in LOGIT_BATCHES:
            for width in LOGIT_CANDIDATES:
                rows.append(_bench_logits(kind, batch, width, False, device))
                torch.cuda.empty_cache()
        rows.append(_bench_logits(kind, PREFILL_ROWS, PREFILL_CANDIDATES, True, device))
    for batch in TOPK_BATCHES:
        for width in TOPK_CANDIDATES:
            for k in TOPK_K:
                rows.append(_bench_topk(batch, width, k, device))
    return rows


if __name__ == "__main__":
    for r in (bench_capacity() if "--capacity" in sys.argv[1:] else bench()):
        print(r)
