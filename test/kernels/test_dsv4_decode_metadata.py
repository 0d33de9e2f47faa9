"""sgl_kernel.dsv4_decode_metadata (a capacity-static step's attention metadata in one launch) and dsv4_write_slots
against their torch references: batches of 1, 3 and 7 requests, 1 and 4 rows per request (DECODE; a speculative
verify), the tiny config's ratios (4 with overlap, 8), Flash's (4, 128 at its window 128), three ratios (two launches),
none (a draft forward: the window alone), positions around window, ratio and page boundaries, padded requests
(request 0 at position 0, window slot -1), the prefix cache's boundary rows, and every entry block of a long page
table. CPU: the Triton interpreter; GPU (skipped without CUDA): Flash shapes at a 4K-token table, and a CUDA-graph
replay equal to a plain launch."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_decode_metadata import BLOCK_E, dsv4_decode_metadata, dsv4_write_slots
from sgl_kernel.dsv4_decode_metadata_ref import DecodeRatioSpec, dsv4_decode_metadata_ref, write_slots_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = [DecodeRatioSpec(4, True, 16, 8 * 16, boundary=True), DecodeRatioSpec(8, False, 9, 8 * 9)]
FLASH = [DecodeRatioSpec(4, True, 9, 9 * 9, boundary=True), DecodeRatioSpec(128, False, 129, 9 * 129)]


def _tables(num_slots: int, ctx: int, page: int, seed: int) -> tuple:
    """(req_to_token, full_to_swa): request slots 1.. hold random distinct pages, slot 0 (reserved) page 0; a window
    map with released slots (-1)."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(4 * num_slots * (ctx // page), generator=g)[:num_slots * (ctx // page)] + 1
    pos = torch.arange(ctx)
    table = (pages.view(num_slots, -1)[:, pos // page] * page + pos % page).to(torch.int32)
    table[0] = 0
    num_full = int(table.max()) + 1
    full_to_swa = torch.randint(0, 10 * num_full, (num_full,), generator=g)
    full_to_swa[torch.rand(num_full, generator=g) < 0.2] = -1
    full_to_swa[0] = -1
    return table, full_to_swa


def _rows(table: torch.Tensor, num_reqs: int, padded: int, per_req: int, seed: int) -> tuple:
    """(positions, req_pool_indices, out_cache_loc) of `num_reqs` real requests padded to `padded` requests (request
    0 at position 0, full slot 0) of `per_req` rows each; starts near window / ratio / page boundaries."""
    g = torch.Generator().manual_seed(seed)
    ctx = table.shape[1]
    reqs = torch.randperm(table.shape[0] - 1, generator=g)[:num_reqs] + 1
    near = torch.tensor([0, 1, 3, 4, 7, 8, 15, 16, 127, 128, 255, 511, ctx - per_req])
    starts = near[torch.randint(0, len(near), (num_reqs,), generator=g)] + torch.randint(-1, 2, (num_reqs,),
                                                                                          generator=g)
    starts = starts.clamp(0, ctx - per_req)
    positions = (starts[:, None] + torch.arange(per_req)[None, :]).flatten()
    out_loc = table[reqs.repeat_interleave(per_req), positions].to(torch.int64)
    pad = (padded - num_reqs) * per_req
    return (torch.cat((positions, torch.zeros(pad, dtype=torch.int64))),
            torch.cat((reqs, torch.zeros(padded - num_reqs, dtype=torch.int64))),
            torch.cat((out_loc, torch.zeros(pad, dtype=torch.int64))))


def _inputs(num_reqs: int, padded: int, per_req: int, ctx: int, page: int, seed: int, device="cpu") -> tuple:
    """(positions, req_pool_indices, out_cache_loc, req_to_token, full_to_swa)."""
    table, full_to_swa = _tables(padded + 2, ctx, page, seed)
    rows = _rows(table, num_reqs, padded, per_req, seed)
    return tuple(x.to(device) for x in rows + (table, full_to_swa))


def _assert_same(got, want) -> None:
    assert torch.equal(got.window_slots, want.window_slots)
    assert torch.equal(got.out_swa_loc, want.out_swa_loc)
    assert len(got.ratios) == len(want.ratios)
    for g, w in zip(got.ratios, want.ratios):
        for name in w.__dataclass_fields__:
            a, b = getattr(g, name), getattr(w, name)
            if isinstance(b, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), (w.ratio, name)
            else:
                assert a == b, (w.ratio, name)


@pytest.mark.parametrize("num_reqs,padded", [(1, 1), (3, 4), (7, 7)])
@pytest.mark.parametrize("per_req", [1, 4])
@pytest.mark.parametrize("specs,window,page", [(TINY, 8, 16), (FLASH, 128, 128)], ids=["tiny", "flash"])
def test_decode_metadata_equals_reference(num_reqs, padded, per_req, specs, window, page):
    args = _inputs(num_reqs, padded, per_req, ctx=512, page=page, seed=num_reqs * 10 + per_req)
    _assert_same(dsv4_decode_metadata(*args, window, page, specs), dsv4_decode_metadata_ref(*args, window, page, specs))


def test_three_ratios_and_none():
    """Three ratios: a second launch for the third (no window part); none (a draft forward): the window alone."""
    args = _inputs(3, 5, 2, ctx=96, page=16, seed=5)
    three = TINY + [DecodeRatioSpec(16, False, 17, 8 * 17, boundary=True)]
    for specs in (three, [], TINY[1:]):
        _assert_same(dsv4_decode_metadata(*args, 8, 16, specs), dsv4_decode_metadata_ref(*args, 8, 16, specs))


def test_entry_lists_span_blocks():
    """A page table wider than BLOCK_E entries of ratio 4: several entry programs per request, requests whose last
    entry sits at a block edge, -1 up to the capacity."""
    ctx, page = 4 * BLOCK_E * 2 + 64, 16
    table, f2s = _tables(4, ctx, page, seed=9)
    reqs = torch.tensor([2, 1, 3])
    positions = torch.tensor([4 * BLOCK_E - 1, 4 * BLOCK_E, ctx - 1])
    out_loc = table[reqs, positions].to(torch.int64)
    got = dsv4_decode_metadata(positions, reqs, out_loc, table, f2s, 8, page, TINY)
    want = dsv4_decode_metadata_ref(positions, reqs, out_loc, table, f2s, 8, page, TINY)
    _assert_same(got, want)
    counts = (got.ratios[0].entry_slots >= 0).sum(1)
    assert counts.tolist() == [BLOCK_E, BLOCK_E, ctx // 4]


def test_padded_rows_touch_nothing_real():
    """Padded requests: no window keys, no own window slot, no entries, the dump entry, request 0's ring rows."""
    args = _inputs(2, 5, 1, ctx=96, page=16, seed=3)
    md = dsv4_decode_metadata(*args, 8, 16, TINY)
    assert (md.window_slots[2:] == -1).all() and (md.out_swa_loc[2:] == -1).all()
    for rm in md.ratios:
        assert (rm.entry_slots[2:] == -1).all() and (rm.new_entry_slots[2:] == 0).all()
        assert (rm.ring_dst[2:] < TINY[0].ring).all()


def test_rejects_rows_not_per_request():
    args = list(_inputs(2, 2, 2, ctx=96, page=16, seed=1))
    args[0], args[2] = args[0][:3], args[2][:3]
    with pytest.raises(ValueError, match="static rows"):
        dsv4_decode_metadata(*args, 8, 16, TINY)
    ring_of_1 = [DecodeRatioSpec(4, True, 1, 16)]
    with pytest.raises(ValueError, match="ring of 1"):
        dsv4_decode_metadata(*_inputs(2, 2, 2, ctx=96, page=16, seed=1), 8, 16, ring_of_1)


def _slot_writes(device="cpu", seed=0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 500, (6, 40), generator=g, dtype=torch.int32)
    f2s = torch.randint(-1, 90, (700,), generator=g)
    # rows 0..4: real writes; 5..6: padded (request 0, position 0, full slot 0, window slot -1)
    rows = torch.tensor([3, 3, 1, 5, 2, 0, 0])
    positions = torch.tensor([7, 8, 39, 0, 21, 0, 0])
    full = torch.tensor([650, 651, 17, 300, 2, 0, 0])
    swa = torch.tensor([5, 6, 7, -1, 9, -1, -1])
    return tuple(x.to(device) for x in (table, f2s, rows, positions, full, swa))


def test_write_slots_equals_reference():
    got, want = _slot_writes(), _slot_writes()
    dsv4_write_slots(*got)
    write_slots_ref(*want)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0][3, 8] == 651 and got[1][651] == 6 and got[1][0] == -1
    dsv4_write_slots(*(x[:0] if i >= 2 else x for i, x in enumerate(got)))  # nothing to write: no launch


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("per_req", [1, 4])
def test_gpu_decode_metadata_and_graph_replay(per_req):
    from graph_replays import assert_replays_equal

    ctx, page, window = 4096, 128, 128
    live = _inputs(29, 32, per_req, ctx=ctx, page=page, seed=1, device="cuda")
    _assert_same(dsv4_decode_metadata(*live, window, page, FLASH),
                 dsv4_decode_metadata_ref(*live, window, page, FLASH))

    def flat(md):
        parts = [md.window_slots.flatten(), md.out_swa_loc]
        for rm in md.ratios:
            parts += [rm.entry_slots.flatten(), rm.row_visible, rm.window_offset, rm.new_entry_slots,
                      rm.entry_positions, rm.source_rows.flatten(), rm.ring_dst, rm.ring_src, rm.boundary_dst
                      if rm.boundary_dst is not None else rm.ring_src]
        return torch.cat(parts)

    run = lambda: flat(dsv4_decode_metadata(*live, window, page, FLASH))  # noqa: E731
    run()  # compile outside the capture
    # new positions and requests each replay; the tables stay (they are the pools, written in place)
    table = live[3].cpu()
    assert_replays_equal(run, run, live[:3], lambda seed: [x.cuda() for x in _rows(table, 29, 32, per_req, seed + 1)],
                         seeds=(1, 2))


@pytest.mark.gpu
@needs_cuda
def test_gpu_write_slots():
    got, want = _slot_writes("cuda"), _slot_writes("cuda")
    dsv4_write_slots(*got)
    write_slots_ref(*want)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_engine_takes_the_kernel_on_a_gpu(monkeypatch):
    """The static path's metadata and the graph's slot writes run the kernels where the tensors are on a GPU (here the
    simulated one) and the torch references elsewhere; both give the engine's DSV4Metadata, equal."""
    from types import SimpleNamespace

    from sgl_kernel import dsv4_decode_metadata as kernels
    from sglang.srt.layers.attention.dsv4 import decode_metadata
    from sglang.srt.layers.gpu_kernels import sgl_kernel_op
    from sglang.srt.mem_cache import deepseek_v4_allocator
    from sglang.srt.platform import simulate_platform

    calls = []
    spy = lambda fn: lambda *a, **k: calls.append(fn.__name__) or fn(*a, **k)  # noqa: E731
    monkeypatch.setattr(kernels, "dsv4_decode_metadata", spy(kernels.dsv4_decode_metadata))
    monkeypatch.setattr(kernels, "dsv4_write_slots", spy(kernels.dsv4_write_slots))
    sgl_kernel_op.cache_clear()  # looked up afresh: the spies
    positions, reqs, out_loc, table, f2s = _inputs(3, 4, 2, ctx=96, page=16, seed=2)
    fb = SimpleNamespace(positions=positions, req_pool_indices=reqs, out_cache_loc=out_loc,
                         req_to_token_pool=SimpleNamespace(req_to_token=table))
    try:
        plain = decode_metadata.build_decode_metadata(fb, 8, f2s, 16, TINY)
        writes = _slot_writes()
        deepseek_v4_allocator.write_slots_on_device(*writes)
        assert calls == []
        with simulate_platform("cuda"):
            fused = decode_metadata.build_decode_metadata(fb, 8, f2s, 16, TINY)
            deepseek_v4_allocator.write_slots_on_device(*_slot_writes())
        assert calls == ["dsv4_decode_metadata", "dsv4_write_slots"]
    finally:
        sgl_kernel_op.cache_clear()
    assert torch.equal(fused.window_slots, plain.window_slots) and torch.equal(fused.out_swa_loc, plain.out_swa_loc)
    for ratio, rm in plain.ratios.items():
        got = fused.ratios[ratio]
        assert torch.equal(got.entry_slots, rm.entry_slots) and torch.equal(got.window_offset, rm.window_offset)
        assert torch.equal(got.plan.source_rows, rm.plan.source_rows) and got.plan.num_new == rm.plan.num_new


_SM90 = r"""  # after sm90_compile.SM90_PREAMBLE
from sgl_kernel import dsv4_decode_metadata as m

def compile_(kernel, consts, types, num_warps):
    sig = {n: "constexpr" if n in consts else types(n) for n in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(n),): v
                                                                          for n, v in consts.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return list(usage(c.asm["cubin"])) + [c.metadata.shared]

def meta_type(n):
    if n == "r2t_ptr":
        return "*i32"
    return "*i64" if n.endswith("_ptr") else "i64" if n in ("stride_r2t", "T") else "i32"

out = {}
for per_req in (1, 4):  # DECODE; a speculative verify of 3 draft steps
    consts = dict(PER_REQ=per_req, PAGE=128, WINDOW=128, BLOCK_W=128, ROWS=True, RATIO_A=4, OVERLAP_A=True,
                  BOUNDARY_A=True, BLOCK_SA=8, RATIO_B=128, OVERLAP_B=False, BOUNDARY_B=False, BLOCK_SB=128,
                  BLOCK_ENT=m.BLOCK_E)
    out[f"metadata R={per_req}"] = compile_(m._dsv4_decode_metadata_kernel, consts, meta_type, 4)
out["write_slots"] = compile_(m._dsv4_write_slots_kernel, dict(BLOCK=256),
                              lambda n: "*i32" if n == "r2t_ptr" else "*i64" if n.endswith("_ptr") else "i32", 4)
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90():
    """The Flash launches (window 128, ratios 4 with boundary rows and 128, page 128; 1 and 4 rows per request) and
    the slot writes compile for sm90 on the CPU without spilling: registers / stack bytes / shared memory printed."""
    from sm90_compile import SM90_PREAMBLE, compiled_facts

    found = compiled_facts(SM90_PREAMBLE + _SM90, timeout=900)
    for case, (regs, stack, shared) in found.items():
        print(f"{case}: {regs} registers, stack {stack} B, shared {shared} B")
    assert all(stack == 0 for _, stack, _ in found.values()), found
