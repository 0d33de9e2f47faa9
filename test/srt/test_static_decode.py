"""The static decode path (what CUDA graphs replay; eager on CPU): its device-derived, capacity-static metadata
equals the general metadata on every real row, padded rows touch nothing real, and engine outputs equal the general
(--disable-cuda-graph) path token for token: padded batches (3 in a bucket of 4), every bucket boundary, batches
above the largest bucket, requests joining and finishing between steps, staging rings and HCA windows wrapping,
greedy and seeded sampling, speculative decoding alongside. Server-args defaults of the capture list."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from host_reads import HostReadGuard
from oracle import engine, max_abs_diff, random_ids
from sglang.srt.layers.attention.dsv4.decode_metadata import (
    DUMP_ENTRY_SLOT, decode_compress_plan, decode_entry_slots, static_seq_lens)
from sglang.srt.layers.attention.dsv4.metadata import build_compress_plan, build_entry_slots

PAGE, CTX = 16, 96


def _page_table(num_reqs: int, seed: int) -> torch.Tensor:
    """Request r (>= 1) holds random distinct pages; row 0 (the reserved dummy request) is all zeros."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(200, generator=g)[:(num_reqs - 1) * (CTX // PAGE)].view(num_reqs - 1, CTX // PAGE) + 1
    table = torch.zeros(num_reqs, CTX, dtype=torch.int32)
    pos = torch.arange(CTX)
    table[1:] = (pages[:, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
    return table


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False), (16, False)])
@pytest.mark.parametrize("per_req", [1, 4])  # DECODE, and a speculative verify / draft-extend of 3 draft steps
@pytest.mark.parametrize("seed", range(4))
def test_static_metadata_equals_general_on_real_rows(ratio, overlap, per_req, seed):
    g = torch.Generator().manual_seed(seed)
    num_reqs, raw, padded = 8, 5, 8
    draft = per_req if per_req > 1 else 0
    table = _page_table(num_reqs, seed)
    reqs = (torch.randperm(num_reqs - 1, generator=g)[:raw] + 1).tolist()
    starts = torch.randint(0, CTX - per_req, (raw,), generator=g).tolist()  # each request's first new position
    positions = [c + i for c in starts for i in range(per_req)]
    num_ring_rows = num_reqs * 4 * ratio
    general = SimpleNamespace(
        seq_lens_cpu=[c + per_req for c in starts], extend_prefix_lens_cpu=starts,
        extend_seq_lens_cpu=[per_req] * raw, req_pool_indices_cpu=reqs, positions=torch.tensor(positions),
        req_pool_indices=torch.tensor(reqs), req_to_token_pool=SimpleNamespace(req_to_token=table))
    # static rows: the real ones, then padded requests (request 0, every row at position 0)
    s_reqs = torch.tensor(reqs + [0] * (padded - raw))
    s_pos = torch.tensor(positions + [0] * ((padded - raw) * per_req))
    num_real = raw * per_req

    entries = build_entry_slots(general, ratio, PAGE)
    static_entries = decode_entry_slots(table, s_reqs, static_seq_lens(s_pos, padded), ratio, PAGE,
                                        capacity=CTX // ratio)
    assert static_entries.shape == (padded, CTX // ratio)
    e_max = entries.shape[1]
    assert torch.equal(static_entries[:raw, :e_max], entries)
    assert (static_entries[:raw, e_max:] == -1).all() and (static_entries[raw:] == -1).all()

    plan = build_compress_plan(general, ratio, overlap, PAGE, draft, num_ring_rows)
    static = decode_compress_plan(table, s_reqs, s_pos, ratio, overlap, PAGE, draft, num_ring_rows)
    assert static.num_new == padded * per_req and static.ring == plan.ring
    done = [(p + 1) % ratio == 0 for p in positions]
    rows = [t for t in range(num_real) if done[t]]  # the general plan lists completed entries in row order
    assert plan.num_new == len(rows)
    assert torch.equal(static.entry_slots[rows], plan.entry_slots)
    assert torch.equal(static.entry_positions[rows], plan.entry_positions)
    assert torch.equal(static.source_rows[rows], plan.source_rows)
    others = [t for t in range(padded * per_req) if t >= num_real or not done[t]]
    assert (static.entry_slots[others] == DUMP_ENTRY_SLOT).all()
    assert (static.source_rows[others] == (num_ring_rows + torch.tensor(others))[:, None]).all()  # finite rows
    assert torch.equal(static.ring_dst[:num_real], plan.ring_dst)
    assert torch.equal(static.ring_src[:num_real], plan.ring_src)
    assert (static.ring_dst[num_real:] < static.ring).all()  # padded rows write request 0's staging rows only


def _run(eng, ids_list, params):
    return eng.generate(input_ids=ids_list, sampling_params=params, return_logprob=True)


def _workload(seed: int, n: int, lens: list, news: list, sampled: bool) -> tuple:
    ids = [random_ids(lens[i % len(lens)], seed=seed + i) for i in range(n)]
    params = [{"temperature": 0.8 if sampled and i % 2 else 0, "seed": 1000 + i, "top_p": 0.9,
               "max_new_tokens": news[i % len(news)], "ignore_eos": True} for i in range(n)]
    return ids, params


def _assert_same(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        lx = [lp for lp, _, _ in x["meta_info"]["output_token_logprobs"]]
        ly = [lp for lp, _, _ in y["meta_info"]["output_token_logprobs"]]
        assert max_abs_diff(lx, ly) <= 1e-4


@pytest.mark.parametrize("name,lens,news", [
    ("tiny", [5, 23, 40], [37, 9, 20, 3, 28]),  # rings of ratio 4 and 8 wrap many times
    ("hca128", [120, 250, 7], [20, 12, 30]),  # HCA windows of 128 completed during decode
])
def test_static_decode_equals_general_path(name, lens, news):
    ids, params = _workload(7, 5, lens, news, sampled=True)
    ref_eng = engine(name, disable_cuda_graph=True, max_running_requests=5)
    assert ref_eng.model_runner.graph_runner is None
    ref = _run(ref_eng, ids, params)
    # buckets 1, 2, 4: five running requests exceed the largest (general path), then 4, 3 (padded to 4), 2, 1
    eng = engine(name, cuda_graph_bs=[1, 2, 4], max_running_requests=5)
    runner = eng.model_runner.graph_runner
    sizes = []
    real_forward = runner.forward
    runner.forward = lambda ids_, slots, *a: sizes.append(slots.shape[1]) or real_forward(ids_, slots, *a)
    got = _run(eng, ids, params)
    _assert_same(got, ref)
    assert 3 in sizes and max(sizes) <= 4  # a padded batch ran, and 5 never took the static path
    eng.model_runner.token_allocator.check_all_free()


def test_mixed_extend_steps_general_decode_steps_static():
    """Mixed EXTEND steps (decode rows beside a prefill chunk) use the general path; DECODE steps the static one."""
    ids, params = _workload(11, 4, [30, 60], [6, 25], sampled=False)
    ref = _run(engine("tiny", disable_cuda_graph=True, chunked_prefill_size=32), ids, params)
    eng = engine("tiny", chunked_prefill_size=32)
    _assert_same(_run(eng, ids, params), ref)
    eng.model_runner.token_allocator.check_all_free()


def test_capture_list_defaults():
    from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
    from sglang.srt.server_args import ServerArgs

    from oracle import checkpoint

    def resolved(**kw):
        return resolve_server_args(ServerArgs(model_path=checkpoint("tiny"), device="cpu", page_size=16, **kw))

    args = resolved()
    assert args.cuda_graph_bs[:6] == [1, 2, 4, 8, 12, 16] and args.cuda_graph_bs[-1] == 256
    assert all(b - a == 8 for a, b in zip(args.cuda_graph_bs[5:], args.cuda_graph_bs[6:]))
    assert resolved(max_running_requests=20).cuda_graph_bs == [1, 2, 4, 8, 12, 16, 20]
    assert resolved(cuda_graph_max_bs=10).cuda_graph_bs == [1, 2, 4, 8, 10]
    assert resolved(cuda_graph_bs=[8, 3, 3]).cuda_graph_bs == [3, 8]
    assert resolved(cuda_graph_bs=[4, 64], max_running_requests=16).cuda_graph_bs == [4, 16]
    assert resolved(disable_cuda_graph=True).cuda_graph_bs is None
    assert resolved(speculative_algorithm="EAGLE").cuda_graph_bs == args.cuda_graph_bs  # whole cycles captured
    with pytest.raises(ValueError, match="cuda-graph-bs"):
        resolved(cuda_graph_bs=[0, 4])
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        resolved(cuda_graph_max_bs=0)


def test_decode_step_reads_the_device_once(monkeypatch):
    """A whole DECODE step on the static path (allocation, forward, sampling greedy, seeded and top-p, bookkeeping,
    window release, a request finishing) makes exactly one device -> host read, the sampler's read-back; any other
    Python-level read of a tensor (.item(), .tolist(), bool(), int(), float(), index use) is a violation. The CPU
    twin of test_gpu_cuda_graph.py's sync-debug-mode test."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.utils.device_readback import ReadBack
    from sglang.srt.sampling.sampling_params import SamplingParams

    eng = engine("tiny", cuda_graph_bs=[1, 2, 4])
    sched = eng.scheduler
    params = [dict(temperature=0), dict(temperature=0.7, top_p=0.9, seed=5), dict(temperature=0.9, top_k=20)]
    for i, (n, p) in enumerate(zip([30, 4, 20], params)):
        sched.add_request(Req(rid=f"s{i}", origin_input_ids=random_ids(30 + 7 * i, seed=i),
                              sampling_params=SamplingParams.from_dict({**p, "max_new_tokens": n, "ignore_eos": True})))
    while not all(r.prefill_done for r in sched.running) or len(sched.running) < 3:
        sched.step()
    guard = HostReadGuard()
    monkeypatch.setattr(ReadBack, "wait", guard.allowed(ReadBack.wait))
    with monkeypatch.context() as m:
        guard.install(m)
        bool(torch.tensor(1))  # the guard sees a read (positive control)
        per_step = []
        for _ in range(8):
            before = guard.reads
            sched.step()
            per_step.append(guard.reads - before)
    # one read per step; none in a step that only launches (overlap scheduling: the first, and after a batch change)
    assert set(per_step) <= {0, 1} and sum(per_step) >= 6 and guard.violations == ["__bool__"], (per_step,
                                                                                                guard.violations)
    assert len(sched.running) == 2  # the second request finished inside the guarded steps
    while sched.has_work():
        sched.step()
    eng.model_runner.token_allocator.check_all_free()
