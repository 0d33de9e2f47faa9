"""A CSA layer's compressor and indexer front on Flash widths, fused against the torch path it replaces (GPU time,
CUPTI, same run):

* proj: dsv4_compressor_proj (both compressors' fp32 projections + ape, the indexer's head weights; one launch) vs
  x.float(), two fp32 F.linear, two ape gathers + adds, weights_proj + .float() + scale (10 launches).
* stage: dsv4_compress_staged (pool + store + ring + boundary rows; one launch) vs dsv4_compress + two
  dsv4_update_ring (three launches), the attention compressor's decode step (every row completes a window).
The copy bandwidth of the same run is printed first; `floor` is the bytes each must move over that bandwidth.

    python benchmark/kernels/bench_dsv4_compressor_front.py
"""

from __future__ import annotations

import os
import sys

import torch

from sgl_kernel.dsv4_compress import dsv4_compress, dsv4_compress_staged, dsv4_update_ring
from sgl_kernel.dsv4_compressor_proj import dsv4_compressor_proj, dsv4_compressor_proj_ref
from sglang.srt.layers.attention.dsv4.decode_metadata import decode_compress_plan
from sglang.srt.mem_cache import kv_formats as kf
from sglang.srt.mem_cache.deepseek_v4_pool import ring_size

try:
    from .common import copy_bandwidth_gbps, time_cuda_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import copy_bandwidth_gbps, time_cuda_us

D, WIDTHS, NI = 4096, (1024, 256), 64  # hidden, CSA compressor widths (attention 2 x 512, indexer 2 x 128), heads


def _row(name: str, batch: int, fused_us: float, torch_us: float, nbytes: float, gbps: float) -> None:
    floor = nbytes / (gbps * 1e3)
    print(f"{name:6s} B={batch:4d}  fused {fused_us:8.2f} us  torch {torch_us:8.2f} us  floor {floor:7.2f} us  "
          f"fused/floor {floor / fused_us:5.2f}")


def bench_proj(batch: int, gbps: float) -> None:
    x = torch.randn(batch, D, device="cuda", dtype=torch.bfloat16)
    offset = torch.randint(0, 4, (batch,), device="cuda")
    weights = [torch.randn(2 * w, D, device="cuda") for w in WIDTHS]
    apes = [torch.randn(4, w, device="cuda") for w in WIDTHS]
    wi = torch.randn(NI, D, device="cuda", dtype=torch.bfloat16)
    fused = time_cuda_us(lambda: dsv4_compressor_proj(x, offset, weights, apes, wi, 0.01))
    ref = time_cuda_us(lambda: dsv4_compressor_proj_ref(x, offset, weights, apes, wi, 0.01))
    nbytes = sum(w.numel() * 4 for w in weights) + wi.numel() * 2 + batch * (D * 2 + 4 * (2 * sum(WIDTHS) + NI))
    _row("proj", batch, fused, ref, nbytes, gbps)


def bench_stage(batch: int, gbps: float) -> None:
    d, rope = 512, 64
    req_to_token = torch.arange((batch + 1) * 4096, device="cuda").view(batch + 1, 4096)
    pos = torch.full((batch,), 1023, device="cuda")  # every row completes a window
    ring_rows = (batch + 1) * ring_size(4, True)
    plan = decode_compress_plan(req_to_token, torch.arange(1, batch + 1, device="cuda"), pos, 4, True, 256, 0,
                                ring_rows, boundary=True)
    ring = torch.randn(ring_rows, 2, 2 * d, device="cuda")
    boundary = torch.randn((batch + 1) * 8, 2, 2 * d, device="cuda")
    fresh = torch.randn(batch, 2, 2 * d, device="cuda")
    cache = kf.Fp8KVFormat(d, rope).allocate(4096 * (batch + 1) // 4, "cuda")
    args = dict(ratio=4, overlap=True, head_dim=d, norm_weight=torch.ones(d, device="cuda"), eps=1e-6,
                positions=plan.entry_positions, rope_dim=rope, out_cache=cache, out_slots=plan.entry_slots,
                inv_freq=torch.rand(rope // 2, device="cuda"), out_format="fp8_kv", compute_dtype=torch.bfloat16)

    def two_pass():
        dsv4_compress(ring, fresh, plan.source_rows, **args)
        dsv4_update_ring(ring, plan.ring_dst, fresh, plan.ring_src)
        dsv4_update_ring(boundary, plan.boundary_dst, fresh, plan.boundary_src)

    fused = time_cuda_us(lambda: dsv4_compress_staged(
        ring, fresh, plan.source_rows, ring_dst=plan.ring_dst, ring_src=plan.ring_src, boundary=boundary,
        boundary_dst=plan.boundary_dst, boundary_src=plan.boundary_src, **args))
    nbytes = batch * (8 * 2 * d * 4 + 584 + 2 * 2 * 2 * d * 4)  # 8 half-rows read, entry row, 2 staging rows
    _row("stage", batch, fused, time_cuda_us(two_pass), nbytes, gbps)


def main() -> None:
    gbps = copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {gbps:.0f} GB/s")
    for batch in (1, 2, 4, 8, 32, 128):
        bench_proj(batch, gbps)
    for batch in (1, 32, 128):
        bench_stage(batch, gbps)


if __name__ == "__main__":
    main()
