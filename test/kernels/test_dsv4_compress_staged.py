"""dsv4_compress_staged: the compressor's pool + store and its staging writes (ring, prefix-cache boundary rows) in one
launch, on the engine's capacity-static decode plans (decode_metadata.decode_compress_plan, what a CUDA graph
replays). It must write exactly what dsv4_compress followed by dsv4_update_ring (ring, then boundary) writes: the
same entry rows (bit for bit: the same per-entry code), the same ring and boundary rows. The backend takes the one
launch only where no ring row written is one the pool reads (backend_base._ring_writes_unread), which the test
checks on the plans themselves.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_kernel.dsv4_compress import (
    dsv4_compress, dsv4_compress_staged, dsv4_compress_staged_ref, dsv4_update_ring)
from sglang.srt.layers.attention.dsv4.backend_base import _ring_writes_unread
from sglang.srt.layers.attention.dsv4.decode_metadata import decode_compress_plan
from sglang.srt.mem_cache import kv_formats as kf
from sglang.srt.mem_cache.deepseek_v4_pool import ring_size

CUDA = torch.cuda.is_available()
PAGE = 16


def _static_plan(ratio: int, overlap: bool, starts: list, rows_per_req: int, num_draft: int, padded: int):
    """A capacity-static plan: request b (pool index b + 1) at positions starts[b] .. + rows_per_req - 1, then
    `padded` padded requests (index 0, position 0)."""
    b = len(starts) + padded
    req_to_token = torch.arange(8 * 256).view(8, 256)
    req = torch.tensor([i + 1 for i in range(len(starts))] + [0] * padded)
    pos = torch.tensor([s + j for s in starts for j in range(rows_per_req)] + [0] * (padded * rows_per_req))
    ring = ring_size(ratio, overlap, num_draft)
    num_ring_rows = 9 * ring
    plan = decode_compress_plan(req_to_token, req, pos, ratio, overlap, PAGE, num_draft, num_ring_rows,
                                boundary=overlap)
    fb = SimpleNamespace(capacity_static=True, positions=pos, req_pool_indices=req)
    return plan, num_ring_rows, b * rows_per_req, fb


def _args(plan, d, rope, out_format, compute_dtype, g):
    fmt = {"dense": kf.DenseFormat(d, torch.float32), "fp8_kv": kf.Fp8KVFormat(d, rope),
           "fp4_index": kf.Fp4IndexKeyFormat(d)}[out_format]
    return fmt, dict(ratio=plan.ratio, overlap=plan.overlap, head_dim=d, norm_weight=torch.rand(d, generator=g) + 0.5,
                     eps=1e-6, positions=plan.entry_positions,
                     inv_freq=1.0 / 10000.0 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope), rope_dim=rope,
                     out_slots=plan.entry_slots, out_format=out_format, hadamard=out_format == "fp4_index",
                     compute_dtype=compute_dtype)


PLANS = [  # ratio, overlap, request start positions, rows per request, drafts, padded requests
    (4, True, [3, 7, 30, 0, 13], 1, 0, 2),  # CSA decode: rows completing a window and rows that do not
    (4, True, [2, 11, 60], 3, 2, 1),  # CSA speculative verify: 3 rows per request, the doubled ring
    (8, False, [7, 15, 20, 63], 1, 0, 1),  # HCA-like (no overlap, no boundary rows)
]


@pytest.mark.parametrize("case", PLANS, ids=["csa-decode", "csa-verify", "hca-decode"])
@pytest.mark.parametrize("out_format,compute_dtype", [("dense", torch.float32), ("fp8_kv", torch.bfloat16),
                                                      ("fp4_index", torch.bfloat16)])
def test_one_launch_writes_what_compress_then_ring_updates_write(case, out_format, compute_dtype):
    ratio, overlap, starts, rows_per_req, num_draft, padded = case
    plan, num_ring_rows, t, fb = _static_plan(ratio, overlap, starts, rows_per_req, num_draft, padded)
    assert _ring_writes_unread(plan, fb)
    g = torch.Generator().manual_seed(len(starts) + ratio)
    d, rope = (64, 0) if out_format == "fp4_index" else (96, 32)
    c = 2 * d if overlap else d
    ring, fresh = torch.randn(num_ring_rows, 2, c, generator=g), torch.randn(t, 2, c, generator=g)
    boundary = torch.randn(9 * 2 * ratio, 2, c, generator=g) if overlap else None
    fmt, args = _args(plan, d, rope, out_format, compute_dtype, g)
    stage = dict(ring_dst=plan.ring_dst, ring_src=plan.ring_src, boundary_dst=plan.boundary_dst,
                 boundary_src=plan.boundary_src)
    out = {}
    for name in ("two-pass", "staged", "reference"):
        r, b, cache = ring.clone(), None if boundary is None else boundary.clone(), fmt.allocate(256)
        if name == "two-pass":
            dsv4_compress(r, fresh, plan.source_rows, out_cache=cache, **args)
            dsv4_update_ring(r, plan.ring_dst, fresh, plan.ring_src)
            if b is not None:
                dsv4_update_ring(b, plan.boundary_dst, fresh, plan.boundary_src)
        else:
            fn = dsv4_compress_staged if name == "staged" else dsv4_compress_staged_ref
            fn(r, fresh, plan.source_rows, boundary=b, out_cache=cache, **stage, **args)
        out[name] = (r, b, cache)
    # the dump entry (slot 0) is written by every row completing nothing, in any order: not compared
    real = torch.unique(plan.entry_slots[plan.entry_slots != 0])
    assert real.numel() > 0
    for name in ("staged", "reference"):
        r, b, cache = out[name]
        assert torch.equal(r, out["two-pass"][0]), name
        assert b is None or torch.equal(b, out["two-pass"][1]), name
    assert torch.equal(out["staged"][2][real].view(torch.uint8), out["two-pass"][2][real].view(torch.uint8))
    assert not torch.equal(out["staged"][0], ring)  # the ring was written


def test_ring_writes_unread_only_where_the_ring_is_long_enough():
    plan, _, _, fb = _static_plan(4, True, [3, 9], 1, 0, 0)
    assert _ring_writes_unread(plan, fb)  # ring 2m + 1 = 9 >= 2m - 1 + 1
    plan, _, _, fb = _static_plan(4, True, [3, 9], 2, 0, 0)  # 2 rows per request in a ring of 9: 7 + 2 = 9
    assert _ring_writes_unread(plan, fb)
    plan, _, _, fb = _static_plan(4, True, [3, 9], 3, 0, 0)  # 7 + 3 = 10 > 9: a written slot may be read
    assert not _ring_writes_unread(plan, fb)
    fb.capacity_static = False  # a general plan (prefill): two launches, the ring after the pool
    assert not _ring_writes_unread(plan, fb)


def test_ring_writes_unread_matches_the_plans_rows():
    """The rule against the plans' own index sets: no written ring row among the ring rows read."""
    for ratio, overlap, starts, rows_per_req, num_draft, padded in PLANS + [(4, True, [5, 17], 2, 0, 1)]:
        plan, num_ring_rows, _, fb = _static_plan(ratio, overlap, starts, rows_per_req, num_draft, padded)
        src = plan.source_rows
        read = set(src[(src >= 0) & (src < num_ring_rows)].tolist())
        written = set(plan.ring_dst[plan.ring_dst >= plan.ring].tolist())  # request 0 (padding) rows: never read
        assert _ring_writes_unread(plan, fb) and not read & written


# ----------------------------------------------------------------------------- GPU, Flash shapes


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 32, 128])
def test_gpu_flash_decode_staged_equals_two_pass_and_replays(batch):
    from graph_replays import assert_replays_equal

    starts = [(37 * i + 3) % 2000 for i in range(batch)]
    req_to_token = torch.arange((batch + 1) * 2048, device="cuda").view(batch + 1, 2048)
    req = torch.arange(1, batch + 1, device="cuda")
    pos = torch.tensor(starts, device="cuda")
    ring_rows = (batch + 1) * ring_size(4, True)
    plan = decode_compress_plan(req_to_token, req, pos, 4, True, 256, 0, ring_rows, boundary=True)
    g = torch.Generator(device="cuda").manual_seed(batch)
    d, rope = 512, 64
    ring = torch.randn(ring_rows, 2, 2 * d, device="cuda", generator=g)
    fresh = torch.randn(batch, 2, 2 * d, device="cuda", generator=g)
    boundary = torch.randn((batch + 1) * 8, 2, 2 * d, device="cuda", generator=g)
    fmt = kf.Fp8KVFormat(d, rope)
    args = dict(ratio=4, overlap=True, head_dim=d, norm_weight=torch.rand(d, device="cuda") + 0.5, eps=1e-6,
                positions=plan.entry_positions, rope_dim=rope, out_slots=plan.entry_slots, out_format="fp8_kv",
                inv_freq=1.0 / 160000.0 ** (torch.arange(0, rope, 2, dtype=torch.float32, device="cuda") / rope),
                compute_dtype=torch.bfloat16)
    stage = dict(ring_dst=plan.ring_dst, ring_src=plan.ring_src, boundary_dst=plan.boundary_dst,
                 boundary_src=plan.boundary_src)
    entries = (batch + 1) * 2048 // 4  # every compressed entry the page table maps: plan.entry_slots index these
    caches = [fmt.allocate(entries, "cuda") for _ in range(2)]
    rings, bounds = [ring.clone(), ring.clone()], [boundary.clone(), boundary.clone()]
    dsv4_compress(rings[0], fresh, plan.source_rows, out_cache=caches[0], **args)
    dsv4_update_ring(rings[0], plan.ring_dst, fresh, plan.ring_src)
    dsv4_update_ring(bounds[0], plan.boundary_dst, fresh, plan.boundary_src)
    dsv4_compress_staged(rings[1], fresh, plan.source_rows, boundary=bounds[1], out_cache=caches[1], **stage, **args)
    real = plan.entry_slots[plan.entry_slots != 0]
    assert torch.equal(caches[0][real], caches[1][real])
    # request 0's boundary rows (the first 2 * ratio) take every row not at a page's end: a dump several rows write in
    # launch order, never read; the requests' own rows must agree
    assert torch.equal(rings[0], rings[1]) and torch.equal(bounds[0][8:], bounds[1][8:])

    live = torch.empty_like(fresh)

    def run():
        r, c = ring.clone(), fmt.allocate(entries, "cuda")
        dsv4_compress_staged(r, live, plan.source_rows, boundary=boundary.clone(), out_cache=c, **stage, **args)
        return torch.cat((r.flatten().view(torch.uint8), c[real].flatten()))

    assert_replays_equal(run, run, (live,), lambda s: (torch.randn(fresh.shape, device="cuda",
                                                                   generator=torch.Generator("cuda").manual_seed(s)),),
                         seeds=range(3))
