"""The DeepSeek-V4 memory pool (DESIGN section 4, arch section 9): chunk equivalence of the stored entries,
quantized entry formats, exhaustion and admission, window release, and that every slot comes back.

Chunk equivalence ("prefill of any length in chunks of any size, then decode, gives the same entries as one
full pass"): the ModelRunner is driven by hand, one fresh request per schedule, teacher-forced on a fixed
token sequence, `release_window(alloc, n - (W - 1))` after every forward as the scheduler does. Compared at
the end, by entry index: every compressed KV entry w < floor(n/m) of every compressed layer (addressed through
the page table exactly as DESIGN section 4 writes it), every indexer key of every CSA layer, and the window KV
of the last W-1 positions of every layer.

Tolerances, measured on CPU fp32:
* dense (fp32) entries: max |diff| 4.7e-6 ("tiny", 90 tokens) and 7.6e-6 ("hca128", 300 tokens); asserted
  <= 1e-5. Bytes are not identical: different chunkings round the fp32 matmuls differently.
* quantized formats (FP8 main KV + FP4 or FP8 index keys): the stored bytes are identical except where that
  ~1e-6 float noise moves a value across a rounding boundary: 35 (FP4 index keys) and 91 (FP8 index keys,
  whose fp32 block scales also carry the noise) of ~1.8e4 compared bytes differ, at worst 254 (1.4%) over
  the seeds tried; asserted <= 2%. A flipped rounding is one quantization step of the format at that value
  (e4m3: 2^(floor(log2 |q|) - 3) * scale; e2m1: the grid spacing * scale; bf16 rope dims:
  2^(floor(log2 |x|) - 7)), e.g. 0.0156 for an FP8 main-KV value with scale 2^-6 or 0.087 for an FP8 index
  key with scale amax/448; the flipped entry then feeds the FP8-cached attention of later layers, which moves
  their values by up to 3.9e-3 beyond one step ("tiny", seeds 3, 4, 5; "hca128": <= 5.5e-4, <= 66 of 33932
  bytes differ, seeds 3, 4). Asserted per value: |diff| <= one step + QUANT_CASCADE_TOL (1e-2).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from oracle import DEVICE, engine, random_ids
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import PoolExhaustedError
from sglang.srt.mem_cache.kv_formats import DenseFormat, Fp4IndexKeyFormat, Fp8IndexKeyFormat, Fp8KVFormat
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams

DENSE_TOL = 1e-5
QUANT_CASCADE_TOL = 1e-2  # downstream effect of one flipped rounding (measured <= 3.9e-3)
# differing stored bytes: measured <= 1.4% on CPU, <= 2.6% on an H100 (fp32 GEMMs whose summation order follows the
# chunk's shape; each flipped FP8 rounding moves later layers' inputs, which flip more)
QUANT_BYTE_FRACTION = 0.02 if DEVICE == "cpu" else 0.04
SEQ_LEN = {"tiny": 90, "hca128": 300}


def uneven(n: int) -> list:
    chunks = [5, 3, 9, 1, 1, 1, 2]
    while sum(chunks) < n:
        chunks.append(min(37, n - sum(chunks)))
    return chunks


def random_chunks(n: int, seed: int, hi: int) -> list:
    g = torch.Generator().manual_seed(seed)
    chunks = []
    while sum(chunks) < n:
        chunks.append(min(int(torch.randint(1, hi, (1,), generator=g)), n - sum(chunks)))
    return chunks


def schedules(name: str) -> dict:
    n = SEQ_LEN[name]
    out = {"ones": [1] * n, "uneven": uneven(n), "37+decode": [37] + [1] * (n - 37),
           "random": random_chunks(n, seed=7, hi=24)}
    if name == "hca128":  # chunk edges on, just before and just after the 128-token windows
        out["hca_edges"] = [127, 1, 1, 126, 1, 44]
    return out


@functools.lru_cache(maxsize=None)
def pool_engine(name: str, kv_cache_dtype: str = "auto", fp4_indexer: bool = False):
    # the window-release rules are checked without the prefix cache (which keeps a page boundary's tail longer)
    return engine(name, chunked_prefill_size=-1, disable_radix_cache=True, kv_cache_dtype=kv_cache_dtype,
                  enable_deepseek_v4_fp4_indexer=fp4_indexer)


# ---- driving the runner by hand ---------------------------------------------------------------------
def run_schedule(runner, ids: list, chunks: list, extra_release: int = 0) -> dict:
    """Teacher-forced forwards over `ids` in `chunks` on a fresh request; returns its entries by index:
    key -> (dequantized values, stored rows), then frees the request."""
    allocator, window = runner.token_allocator, runner.model_config.sliding_window
    assert sum(chunks) == len(ids)
    alloc = allocator.alloc_req()
    try:
        done = 0
        for n in chunks:
            full = allocator.extend(alloc, done + n)
            mode = ForwardMode.DECODE if n == 1 and done > 0 else ForwardMode.EXTEND
            forward_batch = ForwardBatch.build(mode, ids[done:done + n], [alloc.req_pool_idx], [done], [n], full,
                                               runner.device)
            runner.forward(forward_batch)
            done += n
            allocator.release_window(alloc, done - (window - 1) + extra_release)
            if not extra_release:
                check_live_window(allocator, alloc, done, window)
        return snapshot(runner, alloc, len(ids), window - 1 - extra_release)
    finally:
        allocator.free_req(alloc)


def check_live_window(allocator, alloc, seq_len: int, window: int) -> None:
    """After a step exactly the positions a later query can still see hold window slots."""
    live = min(window - 1, seq_len)
    assert len(alloc.window_slots) == live and alloc.window_start == seq_len - live
    row = allocator.req_to_token_pool.req_to_token[alloc.req_pool_idx, :seq_len].long()
    mapped = allocator.full_to_swa[row]
    assert (mapped[:seq_len - live] == -1).all() and (mapped[seq_len - live:] > 0).all()
    assert mapped[seq_len - live:].tolist() == alloc.window_slots
    assert allocator.swa_slots.size - 1 - allocator.swa_slots.available() == live  # nothing else held


def snapshot(runner, alloc, n: int, live: int) -> dict:
    allocator, pool, config = runner.token_allocator, runner.token_to_kv_pool, runner.model_config
    page = allocator.page_size
    row = allocator.req_to_token_pool.req_to_token[alloc.req_pool_idx].long()
    page_table = row[::page] // page
    out = {}
    compressed = [i for i in range(config.num_hidden_layers) if config.compress_ratio(i) > 0]
    assert sorted(pool.compressed_kv) == compressed
    assert sorted(pool.index_k) == [i for i in compressed if config.compress_ratio(i) == 4]
    for layer in compressed:
        m = config.compress_ratio(layer)
        per_page = page // m
        w = torch.arange(n // m, device=row.device)
        slots = page_table[w // per_page] * per_page + w % per_page
        out["kv", layer] = (pool.get_compressed_kv(layer, slots), pool.compressed_kv[layer][slots].clone())
        if layer in pool.index_k:
            out["index", layer] = (pool.get_index_k(layer, slots), pool.index_k[layer][slots].clone())
    pos = torch.arange(max(0, n - live), n, device=row.device)
    swa = allocator.full_to_swa[row[pos]]
    assert (swa > 0).all()
    for layer in range(pool.num_layers):
        out["window", layer] = (pool.get_window_kv(layer, swa), pool.window_kv[layer][swa].clone())
    return out


# ---- quantization steps -------------------------------------------------------------------------------
def _e4m3_step(q: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3 values at magnitude q (3 mantissa bits, subnormal spacing 2^-9)."""
    e = torch.floor(torch.log2(q.clamp(min=2.0 ** -6)))
    return torch.pow(2.0, e - 3)


def _e2m1_step(q: torch.Tensor) -> torch.Tensor:
    return torch.where(q < 2, 0.5, torch.where(q < 4, 1.0, 2.0))


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, torch.floor(torch.log2(x.clamp(min=2.0 ** -126))) - 7)


def _ue8m0(b: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, b.float() - 127)


def one_step(fmt, rows_a: torch.Tensor, rows_b: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per value, one quantization step of `fmt` at max(|a|, |b|) with the larger of the two scales."""
    mag = torch.maximum(a.abs(), b.abs())
    if isinstance(fmt, DenseFormat):
        return torch.zeros_like(mag)
    if isinstance(fmt, Fp8KVFormat):
        sl = slice(fmt.scale_offset, fmt.scale_offset + fmt.num_blocks)
        s = torch.maximum(_ue8m0(rows_a[..., sl]), _ue8m0(rows_b[..., sl]))
        s = s.repeat_interleave(fmt.block, dim=-1)
        nope = _e4m3_step(mag[..., :fmt.nope_dim] / s) * s
        return torch.cat([nope, _bf16_step(mag[..., fmt.nope_dim:])], dim=-1)
    if isinstance(fmt, Fp8IndexKeyFormat):
        sa = rows_a[..., fmt.dim:fmt.bytes_per_entry].contiguous().view(torch.float32)
        sb = rows_b[..., fmt.dim:fmt.bytes_per_entry].contiguous().view(torch.float32)
        s = torch.maximum(sa, sb).repeat_interleave(fmt.block, dim=-1)[..., :fmt.dim]
        return _e4m3_step(mag / s) * s
    if isinstance(fmt, Fp4IndexKeyFormat):
        sl = slice(fmt.dim // 2, fmt.dim // 2 + fmt.num_blocks)
        s = torch.maximum(_ue8m0(rows_a[..., sl]), _ue8m0(rows_b[..., sl])).repeat_interleave(fmt.block, dim=-1)
        return _e2m1_step(mag / s) * s
    raise TypeError(fmt)


def compare(runner, ref: dict, got: dict, what: str) -> tuple:
    """Assert equivalence; returns (max |diff|, differing bytes, compared bytes)."""
    pool = runner.token_to_kv_pool
    worst, diff_bytes, total_bytes = 0.0, 0, 0
    assert ref.keys() == got.keys()
    for key, (a, rows_a) in ref.items():
        b, rows_b = got[key]
        assert a.shape == b.shape, (what, key)
        fmt = pool.index_format if key[0] == "index" else pool.kv_format
        err = (a - b).abs()
        dense = isinstance(pool.kv_format, DenseFormat) and isinstance(pool.index_format, DenseFormat)
        bound = one_step(fmt, rows_a, rows_b, a, b) + (DENSE_TOL if dense else QUANT_CASCADE_TOL)
        bad = err > bound
        assert not bad.any(), (what, key, err.max().item(), a[bad][:4], b[bad][:4])
        worst = max(worst, err.max().item() if err.numel() else 0.0)
        rb_a, rb_b = rows_a.contiguous().view(torch.uint8), rows_b.contiguous().view(torch.uint8)
        diff_bytes += int((rb_a != rb_b).sum())
        total_bytes += rb_a.numel()
    return worst, diff_bytes, total_bytes


# ---- chunk equivalence ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SEQ_LEN))
def test_chunk_equivalence_dense(name):
    runner = pool_engine(name).model_runner
    ids = random_ids(SEQ_LEN[name], seed=3)
    ref = run_schedule(runner, ids, [len(ids)])
    for label, chunks in schedules(name).items():
        worst, _, _ = compare(runner, ref, run_schedule(runner, ids, chunks), label)
        assert worst <= DENSE_TOL, (label, worst)
    runner.token_allocator.check_all_free()


def test_release_one_more_breaks_equivalence():
    """Negative control: freeing one more window position than release_window's rule changes the entries,
    so the W-1 positions it keeps are all needed (together with the live-count check: exactly those)."""
    runner = pool_engine("tiny").model_runner
    ids = random_ids(SEQ_LEN["tiny"], seed=3)
    ref = run_schedule(runner, ids, [len(ids)])
    got = run_schedule(runner, ids, [37] + [1] * (len(ids) - 37), extra_release=1)
    assert max((ref[k][0] - got[k][0]).abs().max().item() for k in ref if k[0] != "window") > 1e-3
    runner.token_allocator.check_all_free()


# FP8 main KV with FP4 index keys, then with FP8 ones; and the HCA-128 config with FP8 + FP4.
QUANT = [("tiny", "fp8_e4m3", True), ("tiny", "fp8_e4m3", False), ("hca128", "fp8_e4m3", True)]


@pytest.mark.parametrize("name,kv_cache_dtype,fp4_indexer", QUANT)
def test_quantized_formats_generate_and_chunk_equivalence(name, kv_cache_dtype, fp4_indexer):
    eng = pool_engine(name, kv_cache_dtype, fp4_indexer)
    runner = eng.model_runner
    pool = runner.token_to_kv_pool
    assert isinstance(pool.kv_format, Fp8KVFormat)
    assert isinstance(pool.index_format, Fp4IndexKeyFormat if fp4_indexer else Fp8IndexKeyFormat)
    assert pool.index_keys_rotated

    out = eng.generate(input_ids=random_ids(50, seed=4),
                       sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
                       return_logprob=True, logprob_start_len=0)
    assert len(out["output_ids"]) == 12
    assert all(math.isfinite(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"])
    assert all(math.isfinite(lp) for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:])
    runner.token_allocator.check_all_free()

    ids = random_ids(SEQ_LEN[name], seed=3)
    ref = run_schedule(runner, ids, [len(ids)])
    for label, chunks in schedules(name).items():
        if name == "hca128" and label in ("ones", "random"):
            continue  # time: the long single-token schedules are covered by the dense test
        _, diff_bytes, total_bytes = compare(runner, ref, run_schedule(runner, ids, chunks), label)
        assert diff_bytes <= QUANT_BYTE_FRACTION * total_bytes, (label, diff_bytes, total_bytes)
    runner.token_allocator.check_all_free()


# ---- exhaustion ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def small_engine(prefix_cache: bool = False):
    """2 pages of 16 tokens; window pool = 1 request x W (16) + one chunk (8) = 24 slots. The allocator's exact
    accounting is checked without the prefix cache (whose optional tails count as available); requests through
    the scheduler with it too."""
    return engine("tiny", max_total_tokens=32, max_running_requests=1, chunked_prefill_size=8,
                  disable_radix_cache=not prefix_cache)


def allocator_state(allocator, alloc) -> tuple:
    return (allocator.available_pages(), allocator.available_window_slots(), allocator.full_to_swa.clone(),
            allocator.req_to_token_pool.req_to_token.clone(), list(alloc.pages), alloc.num_tokens,
            alloc.window_start, list(alloc.window_slots))


def assert_same_state(before: tuple, after: tuple) -> None:
    assert before[:2] == after[:2]
    assert torch.equal(before[2], after[2]) and torch.equal(before[3], after[3])
    assert before[4:] == after[4:]


def test_extend_exhaustion_leaves_state_unchanged():
    allocator = small_engine().model_runner.token_allocator
    assert allocator.total_pages() == 2 and allocator.available_window_slots() == 24
    assert allocator.is_all_free() and allocator.token_usage() == 0 and allocator.available_req_slots() == 1
    alloc = allocator.alloc_req()
    assert not allocator.is_all_free() and allocator.available_req_slots() == 0
    with pytest.raises(PoolExhaustedError, match="request pool exhausted"):  # max_running_requests = 1
        allocator.alloc_req()
    try:
        for new_len, pool_name in ((33, "KV page"), (25, "window KV")):  # 3 pages > 2; 25 window slots > 24
            before = allocator_state(allocator, alloc)
            with pytest.raises(PoolExhaustedError) as err:
                allocator.extend(alloc, new_len)
            assert err.value.pool == pool_name and str(err.value).startswith(f"{pool_name} pool exhausted")
            assert_same_state(before, allocator_state(allocator, alloc))

        allocator.extend(alloc, 20)  # 2 pages, 20 window slots: 0 pages and 4 window slots left
        assert allocator.token_usage() == 1 and allocator.available_pages() == 0
        for new_len, pool_name in ((33, "KV page"), (30, "window KV")):
            before = allocator_state(allocator, alloc)
            with pytest.raises(PoolExhaustedError, match=pool_name):
                allocator.extend(alloc, new_len)
            assert_same_state(before, allocator_state(allocator, alloc))

        allocator.release_window(alloc, 20 - 15)  # the window slid: 5 slots back
        assert allocator.available_window_slots() == 9
        allocator.extend(alloc, 29)
        assert allocator.available_window_slots() == 0 and allocator.available_pages() == 0
    finally:
        allocator.free_req(alloc)
    allocator.check_all_free()
    assert allocator.is_all_free() and allocator.token_usage() == 0


def test_extend_batch_equals_one_request_at_a_time_and_is_all_or_nothing():
    """A step's allocation in one call (one host -> device copy) gives exactly the slots and device maps that
    extending the requests one by one gives; when the step does not fit as a whole, nothing changes."""
    lens = [[5, 17, 1], [9, 18, 3]]  # two steps of three requests (new total lengths)

    def run(batched: bool):
        allocator = engine("tiny", max_total_tokens=64, max_running_requests=3,
                           chunked_prefill_size=8).model_runner.token_allocator
        allocs = [allocator.alloc_req() for _ in range(3)]
        slots = []
        for step in lens:
            if batched:
                slots.append(allocator.extend_batch(allocs, step).tolist())
            else:
                slots.append(torch.cat([allocator.extend(a, n) for a, n in zip(allocs, step)]).tolist())
        return allocator, allocs, slots

    allocator, allocs, slots = run(batched=True)
    ref_allocator, ref_allocs, ref_slots = run(batched=False)
    assert slots == ref_slots and len(slots[1]) == 4 + 1 + 2
    for a, b in zip(allocs, ref_allocs):
        assert_same_state(allocator_state(allocator, a), allocator_state(ref_allocator, b))
    before = [allocator_state(allocator, a) for a in allocs]  # 4 pages: 1 + 2 + 1 held, none left
    with pytest.raises(PoolExhaustedError, match="KV page"):
        allocator.extend_batch(allocs, [10, 18, 17])  # the first two fit, the third needs a new page
    for a, b in zip(allocs, before):
        assert_same_state(b, allocator_state(allocator, a))
    for a in allocs:
        allocator.free_req(a)
    assert allocator.is_all_free()


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_request_that_never_fits(prefix_cache):
    eng = small_engine(prefix_cache)
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        eng.generate(input_ids=random_ids(32, seed=1), sampling_params=params)  # 32 + a decode step > 32
    eng.model_runner.token_allocator.check_all_free()
    # The second of a batch can never fit: nothing of the first stays held either.
    with pytest.raises(ValueError):
        eng.generate(input_ids=[random_ids(10, seed=1), random_ids(40, seed=2)], sampling_params=params)
    eng.model_runner.token_allocator.check_all_free()
    assert not eng.scheduler.waiting and not eng.scheduler.running
    # A prompt that fits with max_new_tokens beyond the pool: clipped to the pool (as upstream), a "length" finish.
    out = eng.generate(input_ids=random_ids(30, seed=1), sampling_params=params)
    assert len(out["output_ids"]) == 2 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    # A fitting request still runs afterwards (prompt 20 > chunk 8 and > window 16).
    out = eng.generate(input_ids=random_ids(20, seed=3), sampling_params=params)
    assert len(out["output_ids"]) == 10
    eng.model_runner.token_allocator.check_all_free()


@functools.lru_cache(maxsize=None)
def busy_engine():
    return engine("tiny", max_running_requests=2, chunked_prefill_size=16)


def _drive(eng, reqs: list, limit: int) -> int:
    """Add all requests, step the scheduler to completion; returns the most requests ever running."""
    sched = eng.scheduler
    for req in reqs:
        sched.add_request(req)
    most = 0
    while sched.has_work():
        sched.step()
        most = max(most, len(sched.running))
        assert len(sched.running) <= limit
    return most


def _greedy_req(rid: str, ids: list, max_new: int, **extra) -> Req:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True, **extra}
    return Req(rid=rid, origin_input_ids=list(ids), sampling_params=SamplingParams.from_dict(params))


def _solo(eng, ids: list, max_new: int) -> list:
    return eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": max_new,
                                                         "ignore_eos": True})["output_ids"]


def test_requests_beyond_limits_wait_and_complete():
    # Concurrency limit: 5 requests, 2 running at a time.
    eng = busy_engine()
    prompts = [random_ids(n, seed=20 + i) for i, n in enumerate((9, 23, 40, 5, 17))]
    reqs = [_greedy_req(f"c{i}", p, 6) for i, p in enumerate(prompts)]
    assert _drive(eng, reqs, limit=2) == 2
    for req, p in zip(reqs, prompts):
        assert req.finished and req.output_ids == _solo(eng, p, 6)
    eng.model_runner.token_allocator.check_all_free()

    # Page limit: each request reserves one 16-token page of the two, so at most 2 run at once.
    eng2 = engine("tiny", max_total_tokens=32, max_running_requests=4, chunked_prefill_size=8)
    prompts = [random_ids(n, seed=30 + i) for i, n in enumerate((9, 4, 10, 7, 3))]
    reqs = [_greedy_req(f"p{i}", p, 16 - len(p)) for i, p in enumerate(prompts)]
    assert _drive(eng2, reqs, limit=4) == 2
    for req, p in zip(reqs, prompts):
        assert req.finished and req.output_ids == _solo(eng2, p, 16 - len(p))
    eng2.model_runner.token_allocator.check_all_free()


def test_mixed_requests_return_every_slot():
    eng = busy_engine()
    probe_ids = random_ids(21, seed=41)
    probe = _solo(eng, probe_ids, 12)
    k = next(i for i in range(1, len(probe)) if probe[i] not in probe[:i])  # first repeat-free stop point
    params = [
        {"temperature": 0, "max_new_tokens": 0},
        {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "stop_token_ids": [probe[k]]},
        {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True},
        {"temperature": 0.8, "max_new_tokens": 9, "ignore_eos": True, "seed": 3},
    ]
    prompts = [random_ids(13, seed=40), random_ids(1, seed=42), probe_ids, random_ids(50, seed=43),
               random_ids(33, seed=44)]
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert outs[0]["output_ids"] == [] and outs[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(outs[1]["output_ids"]) == 1
    assert outs[2]["output_ids"] == probe[:k + 1]
    assert outs[2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": probe[k]}
    assert len(outs[3]["output_ids"]) == 7 and len(outs[4]["output_ids"]) == 9
    eng.model_runner.token_allocator.check_all_free()


def test_double_free_raises():
    allocator = pool_engine("tiny").model_runner.token_allocator
    alloc = allocator.alloc_req()
    allocator.extend(alloc, 40)
    pages, slots = list(alloc.pages), list(alloc.window_slots)
    allocator.free_req(alloc)
    with pytest.raises(RuntimeError, match="double free"):
        allocator.free_req(alloc)
    with pytest.raises(RuntimeError, match="double free"):
        allocator.pages.free(pages[:1])
    with pytest.raises(RuntimeError, match="double free"):
        allocator.swa_slots.free(slots[-1:])
    with pytest.raises(RuntimeError, match="invalid id 0"):
        allocator.pages.free([0])  # the reserved dummy page
    allocator.check_all_free()  # the failed frees changed nothing


def test_release_window_frees_exactly_the_slid_out_positions():
    allocator = pool_engine("tiny").model_runner.token_allocator
    window = pool_engine("tiny").model_runner.model_config.sliding_window
    alloc = allocator.alloc_req()
    try:
        done = 0
        for n in (1, 3, 7, 1, 20, 1, 1, 16, 2):
            allocator.extend(alloc, done + n)
            assert len(alloc.window_slots) == min(window - 1, done) + n  # the new tokens before the step ends
            done += n
            allocator.release_window(alloc, done - (window - 1))
            check_live_window(allocator, alloc, done, window)
            allocator.release_window(alloc, done - (window - 1))  # idempotent
            check_live_window(allocator, alloc, done, window)
    finally:
        allocator.free_req(alloc)
    allocator.check_all_free()
