"""Benchmark of dsv4_compress (fused compressor pool + RMSNorm + RoPE [+ Hadamard] + quantized store) on Flash
shapes, against its torch reference (`baseline_us`).

Cases (DeepSeek-V4-Flash: head_dim 512, rope 64, indexer head_dim 128):
* decode: batch B = 1..128 with one new entry per request: for CSA (ratio 4) the step after a window completes
  (every 4th step), for HCA (ratio 128) every 128th step; sources are B's staged ring rows plus its fresh token.
* prefill: one 8K-token chunk: 2048 CSA / indexer entries, 64 HCA entries, sources mostly fresh rows.
bytes_moved = the source half-rows read once (content + gate, fp32) + source_rows / positions / slots indices +
the output rows written (fp8_kv 584 B, fp4 index key 68 B).
"""

from __future__ import annotations

import os
import sys

import torch

from sgl_kernel.dsv4_compress import dsv4_compress, dsv4_compress_ref
from sgl_kernel.dsv4_formats_ref import row_width

try:
    from .common import BenchRow, time_cuda_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import BenchRow, time_cuda_us

# name -> (ratio, overlap, head_dim, rope_dim, out_format, hadamard)
LAYERS = {
    "csa": (4, True, 512, 64, "fp8_kv", False),
    "indexer": (4, True, 128, 64, "fp4_index", True),
    "hca": (128, False, 512, 64, "fp8_kv", False),
}
DECODE_BATCHES = (1, 8, 32, 128)
PREFILL_TOKENS = 8192


def _decode_sources(ratio: int, overlap: bool, batch: int, device) -> tuple:
    """Request b's window of S slots: S - 1 staged rows of its ring, then its fresh token (row Rr + b)."""
    s = 2 * ratio if overlap else ratio
    ring_rows = (batch + 1) * s
    slot = torch.arange(s, device=device)
    rows = torch.arange(batch, device=device)[:, None] * s + slot[None, :]
    rows[:, -1] = ring_rows + torch.arange(batch, device=device)
    return rows, ring_rows, batch


def _prefill_sources(ratio: int, overlap: bool, tokens: int, device) -> tuple:
    """Windows of a chunk starting at a window boundary; CSA's first window takes its A slots from the ring."""
    s = 2 * ratio if overlap else ratio
    n = tokens // ratio
    pos = torch.arange(n, device=device)[:, None] * ratio + torch.arange(s, device=device)[None, :] - (s - ratio)
    ring_rows = 2 * s
    rows = torch.where(pos < 0, pos + ring_rows, ring_rows + pos)
    return rows, ring_rows, tokens


def _args(layer: str, rows: torch.Tensor, ring_rows: int, fresh_rows: int) -> dict:
    ratio, overlap, d, rope, out_format, hadamard = LAYERS[layer]
    device = rows.device
    c = 2 * d if overlap else d
    n = rows.shape[0]
    out = torch.zeros(4 * n, row_width(out_format, d, rope), dtype=torch.uint8, device=device)
    return dict(ring=torch.randn(ring_rows, 2, c, device=device), fresh=torch.randn(fresh_rows, 2, c, device=device),
                source_rows=rows, ratio=ratio, overlap=overlap, head_dim=d,
                norm_weight=torch.ones(d, dtype=torch.bfloat16, device=device), eps=1e-6,
                positions=torch.arange(n, device=device) * ratio,
                inv_freq=1.0 / 160000.0 ** (torch.arange(0, rope, 2, device=device, dtype=torch.float32) / rope),
                rope_dim=rope, out_cache=out, out_slots=torch.randperm(4 * n, device=device)[:n],
                out_format=out_format, hadamard=hadamard, compute_dtype=torch.bfloat16)


def _bytes_moved(args: dict) -> float:
    n, s = args["source_rows"].shape
    read = n * s * 2 * args["head_dim"] * 4 + n * s * 8 + n * 16
    return float(read + n * args["out_cache"].shape[1])


def bench() -> list[BenchRow]:
    device = "cuda"
    out = []
    for layer, (ratio, overlap, *_rest) in LAYERS.items():
        cases = [(f"decode bs={b}", _decode_sources(ratio, overlap, b, device)) for b in DECODE_BATCHES]
        cases.append((f"prefill {PREFILL_TOKENS} tokens", _prefill_sources(ratio, overlap, PREFILL_TOKENS, device)))
        for case, (rows, ring_rows, fresh_rows) in cases:
            args = _args(layer, rows, ring_rows, fresh_rows)
            us = time_cuda_us(lambda: dsv4_compress(**args))
            base = time_cuda_us(lambda: dsv4_compress_ref(**args), iters=10)
            out.append(BenchRow(kernel="dsv4_compress", case=f"{layer} {case} N={rows.shape[0]}", time_us=us,
                                bytes_moved=_bytes_moved(args), baseline_us=base,
                                note=f"{args['out_format']}{' +hadamard' if args['hadamard'] else ''}, bf16 compute"))
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    for row in bench():
        print(row)
