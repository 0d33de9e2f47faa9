"""Disaggregated prefill and decode in one process (CPU, fp32): a prefill engine (PrefillSide) prefills, its request's
regions are copied into the decode engine's pools region by region (a memmove over the paired addresses, what
LocalCopyTransfer does), and the decode engine (DecodeSide) continues. Greedy and seeded outputs, logprobs and top
logprobs equal a co-located engine's, for prompts shorter and longer than the window and not a multiple of the
compression ratios, with speculative decoding (the same drafts accepted: the MTP state travelled), with FP8 KV and
FP4 indexer keys, and with a grammar; the regions hold exactly the bytes the formula of docs/disaggregation.md gives;
a failed prefill, an abort on either side and a refused pre-allocation free every slot, and a request aborted on the
prefill server while its pages are being written keeps them until the write ends; the regions also travel over the
real NIXL engine (UCX in this process). About 50 s on one CPU core (eight engines; the grammar test, on the built-in
model with the real vocabulary, 13 s)."""

from __future__ import annotations

import ctypes

import pytest

from oracle import DEVICE, engine, random_ids
from sglang.srt.disaggregation.decode_side import DecodeSide
from sglang.srt.disaggregation.kv_state import (
    check_same_layout, pair_regions, region_addresses, transfer_buffers)
from sglang.srt.disaggregation.prefill_side import PrefillSide
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import PoolExhaustedError
from sglang.srt.sampling.sampling_params import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
SEEDED = {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 10, "ignore_eos": True, "seed": 5}
SPEC = dict(speculative_algorithm="EAGLE", speculative_num_steps=2)
# shorter than the window (16), longer, and neither a multiple of 4 nor of 8 nor of the page (16)
PROMPTS = [random_ids(11, seed=1), random_ids(45, seed=2), random_ids(70, seed=3)]


class Pair:
    """A prefill engine and a decode engine on the same checkpoint."""

    def __init__(self, make=lambda **kw: engine("tiny", **kw), **kwargs) -> None:
        self.pre, self.dec = make(**kwargs), make(**kwargs)
        self.prefill, self.decode = PrefillSide(self.pre.scheduler), DecodeSide(self.dec.scheduler)
        self.next_room = 0

    def run(self, prompts: list, params: list, **req_kwargs) -> list:
        """Generate disaggregated; returns the decode side's finished Reqs (and checks the transferred bytes)."""
        decoded, rooms = [], []
        for ids, p in zip(prompts, params):
            room, self.next_room = self.next_room, self.next_room + 1
            dec_req = Req(f"d{room}", list(ids), SamplingParams.from_dict(p), **req_kwargs)
            dst = self.decode.prealloc(dec_req, room)
            self.prefill.add_request(Req(f"p{room}", list(ids), SamplingParams.from_dict(p), **req_kwargs), room)
            decoded.append(dec_req)
            rooms.append((room, dst))
        exports = []
        while len(exports) < len(prompts):
            self.pre.scheduler.step()
            exports += self.prefill.pop_exports()
        dests = dict(rooms)
        for ex in exports:
            assert ex.error is None
            plan = self.copy(ex.regions, dests[ex.room])
            assert plan.nbytes == expected_bytes(self.pre, len(prompts[ex.room - rooms[0][0]]),
                                                 not params[ex.room - rooms[0][0]].get("temperature") == 0)
            self.prefill.finish_transfer(ex.room)
            self.decode.install(ex.room, ex.result)
        finished = self.pre.scheduler.step()
        assert all(r.finished and r.finished_reason.type == "length" for r in finished) and len(finished) == len(
            prompts)
        while not all(r.finished for r in decoded):
            self.dec.scheduler.step()
        self.check_free()
        return decoded

    def copy(self, src: list, dst: list):
        plan = pair_regions(region_addresses(self.prefill.buffers(), src),
                            region_addresses(self.decode.buffers(), dst))
        for s, d, n in zip(plan.src_addrs, plan.dst_addrs, plan.lengths):
            ctypes.memmove(d, s, n)
        return plan

    def check_free(self) -> None:
        for eng in (self.pre, self.dec):
            while eng.scheduler.has_work():
                eng.scheduler.step()
            eng.model_runner.token_allocator.check_all_free()
            assert eng.model_runner.token_allocator.is_all_free()


def expected_bytes(eng, n: int, sampled: bool) -> int:
    """What a prompt of n tokens sends: window rows of its last W - 1 positions in every layer, one compressed entry
    (and CSA: one index key) per complete window, the staging rows of the open window (CSA: and the one before),
    the CSA boundary rows of [P - m, n) when n lies in the last m of its page, and under speculative decoding the
    draft token, its streams and (sampled) its distribution."""
    pool, config = eng.model_runner.token_to_kv_pool, eng.model_runner.model_config
    ps, kv, idx = pool.shape.page_size, pool.kv_format.bytes_per_entry, pool.index_format.bytes_per_entry
    total = pool.num_layers * min(n, config.sliding_window - 1) * kv
    for layer in range(config.num_hidden_layers):
        m = config.compress_ratio(layer)
        if m == 0:
            continue
        csa = config.is_csa(layer)
        total += n // m * (kv + (idx if csa else 0))
        for width in ([2 * config.head_dim, 2 * config.index_head_dim] if csa else [config.head_dim]):
            row = 2 * width * 4  # fp32 (content, gate logit)
            total += (n - max(0, n // m * m - (m if csa else 0))) * row
            if csa and pool.shape.num_state_slots:
                total += max(0, n - ((n // ps + 1) * ps - m)) * row
    if eng.scheduler.worker.speculative:
        total += 8 + config.hc_mult * config.hidden_size * 4 + (config.vocab_size * 4 if sampled else 0)
    return total


@pytest.fixture(scope="module")
def plain():
    return Pair()


def _reference(eng, prompts: list, params: list, **kwargs) -> list:
    return eng.generate(input_ids=prompts, sampling_params=params, **kwargs)


def _assert_same(decoded: list, ref: list, tol: float = 1e-5) -> None:
    for req, out in zip(decoded, ref):
        assert req.output_ids == out["output_ids"]
        got = req.output_token_logprobs
        assert max(abs(a - b[0]) for a, b in zip(got, out["meta_info"]["output_token_logprobs"])) <= tol
        assert req.spec_accept_length == out["meta_info"].get("spec_accept_length")


def test_greedy_seeded_and_top_logprobs_equal_colocated(plain):
    params = [GREEDY, SEEDED, GREEDY]
    ref = _reference(plain.dec, PROMPTS, params, return_logprob=True, top_logprobs_num=2)
    decoded = plain.run(PROMPTS, params, return_logprob=True, top_logprobs_num=2)
    _assert_same(decoded, ref)
    for req, out in zip(decoded, ref):
        got = [[(round(lp, 4), t) for lp, t in top] for top in req.output_top_logprobs]
        want = [[(round(lp, 4), t) for lp, t, _ in top] for top in out["meta_info"]["output_top_logprobs"]]
        assert got == want


def test_speculative_decode_side_accepts_the_same_drafts(plain):
    pair = Pair(**SPEC)
    with pytest.raises(ValueError, match="exists here only"):  # the MTP layer's window and the draft state
        check_same_layout(pair.decode.layout(), plain.prefill.layout())
    params = [GREEDY, SEEDED, GREEDY]
    ref = _reference(pair.dec, PROMPTS, params, return_logprob=True)
    _assert_same(pair.run(PROMPTS, params, return_logprob=True), ref)


class NixlPair(Pair):
    """A Pair whose regions travel over NIXL (UCX, in this process): each side's pool buffers registered with its
    own agent, the prefill agent writing into the decode agent's memory as the servers' transfer does."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        from sglang.srt.disaggregation.transfer import create_transfer_backend

        self.src, self.dst = create_transfer_backend("nixl", "127.0.0.1"), create_transfer_backend("nixl", "127.0.0.1")
        self.src.register(self.prefill.buffers())
        self.dst.register(self.decode.buffers())
        self.writes = 0

    def copy(self, src: list, dst: list):
        plan = pair_regions(region_addresses(self.prefill.buffers(), src),
                            region_addresses(self.decode.buffers(), dst))
        self.src.write(self.dst.session_id, plan.src_addrs, plan.dst_addrs, plan.lengths, timeout_s=60.0)
        self.writes += 1
        return plan


def test_regions_travel_over_nixl_under_speculative_decoding():
    """The real NIXL engine moves every region (KV, index keys, staging rows, the MTP draft state): the same outputs
    and accepted drafts as a co-located engine."""
    pytest.importorskip("nixl_cu12._api", reason="the test extra installs nixl-cu12")
    pair = NixlPair(**SPEC)
    params = [GREEDY, SEEDED, GREEDY]
    ref = _reference(pair.dec, PROMPTS, params, return_logprob=True)
    _assert_same(pair.run(PROMPTS, params, return_logprob=True), ref)
    assert pair.writes == len(PROMPTS)
    pair.src.close()
    pair.dst.close()


def test_fp8_kv_and_fp4_index_keys(plain):
    pair = Pair(kv_cache_dtype="fp8_e4m3", enable_deepseek_v4_fp4_indexer=True)
    assert pair.pre.model_runner.token_to_kv_pool.index_format.name == "fp4"
    ref = _reference(pair.dec, PROMPTS[1:], [GREEDY, GREEDY], return_logprob=True)
    _assert_same(pair.run(PROMPTS[1:], [GREEDY, GREEDY], return_logprob=True), ref)
    with pytest.raises(ValueError, match="rows are"):  # servers that pool differently are told why
        check_same_layout(pair.prefill.layout(), plain.prefill.layout())


def test_grammar_on_the_decode_side():
    """A regex-constrained request: the prefill side samples the first token under the grammar, the decode side
    compiles it meanwhile and installs the request once both the bytes and the grammar are ready."""
    import sglang

    def make(**kw):
        return sglang.Engine(model_path="tiny-deepseek-v4", device=DEVICE, dtype="float32", log_level="warning",
                             max_running_requests=4, context_length=256, **kw)

    pair = Pair(make)
    prompts, params = [[5, 17, 300], random_ids(40, seed=4)], [{"temperature": 0, "max_new_tokens": 24,
                                                                  "regex": r"(yes|no) [0-9]{2}-[a-c]{1,3}!"}, GREEDY]
    ref = _reference(pair.dec, prompts, params, return_logprob=True)
    decoded = pair.run(prompts, params, return_logprob=True)
    _assert_same(decoded, ref)
    assert decoded[0].finished_reason.type == "stop" and decoded[0].grammar is not None


def test_first_token_ends_the_request(plain):
    """max_new_tokens 1: the prefill side finishes it and sends no KV; the decode side returns the token."""
    params = {**GREEDY, "max_new_tokens": 1}
    ref = _reference(plain.dec, PROMPTS[1], params)
    dec_req = Req("one", list(PROMPTS[1]), SamplingParams.from_dict(params))
    plain.decode.prealloc(dec_req, 1000)
    plain.prefill.add_request(Req("one-p", list(PROMPTS[1]), SamplingParams.from_dict(params)), 1000)
    exports = []
    while not exports:
        plain.pre.scheduler.step()
        exports += plain.prefill.pop_exports()
    assert exports[0].regions == [] and exports[0].result.finished
    assert plain.decode.install(1000, exports[0].result) is dec_req
    assert dec_req.output_ids == ref["output_ids"] and dec_req.finished_reason.type == "length"
    assert dec_req in plain.dec.scheduler.step()
    plain.check_free()


def test_failures_and_aborts_free_every_slot(plain):
    ids = PROMPTS[2]
    dec_alloc = plain.dec.model_runner.token_allocator
    # the prefill server died: the decode side frees the room and fails the request with a 5xx
    req = Req("dead", list(ids), SamplingParams.from_dict(GREEDY))
    plain.decode.prealloc(req, 2000)
    assert not dec_alloc.is_all_free()
    created = plain.decode.rooms[2000].created_time
    assert plain.decode.expired_rooms(30.0, now=created + 10) == [] and plain.decode.expired_rooms(
        30.0, now=created + 31) == [2000]  # no bytes within the timeout: the caller fails the room
    plain.decode.fail(2000, "the prefill server stopped responding", status_code=502)
    assert req.finished_reason.status_code == 502 and req in plain.dec.scheduler.step()
    assert dec_alloc.is_all_free()
    # unknown and reused rooms are refused, nothing held
    with pytest.raises(ValueError, match="not pre-allocated"):
        plain.decode.install(2000, None)
    plain.decode.prealloc(Req("a", list(ids), SamplingParams.from_dict(GREEDY)), 2001)
    with pytest.raises(ValueError, match="already in use"):
        plain.decode.prealloc(Req("b", list(ids), SamplingParams.from_dict(GREEDY)), 2001)
    # an abort before the bytes arrived
    assert plain.dec.scheduler.abort_request("a").finished_reason.type == "abort"
    assert dec_alloc.is_all_free()
    # rooms until the pool (or the running limit) cannot take one more: the refused one holds nothing
    long_params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": 20})
    with pytest.raises(PoolExhaustedError):
        for i in range(20):
            plain.decode.prealloc(Req(f"big{i}", random_ids(1000, seed=9), long_params), 2100 + i)
    held = list(plain.decode.rooms)
    assert held and dec_alloc.req_to_token_pool.available_size() == dec_alloc.req_to_token_pool.size - len(held)
    assert dec_alloc.pages.size - 1 - dec_alloc.pages.available() - dec_alloc.cache.num_pages == 63 * len(held)
    for room in held:
        plain.decode.fail(room, "the prefill server stopped responding")
    plain.dec.scheduler.step()
    assert dec_alloc.is_all_free()
    # the prefill side: an abort while its request waits for the transfer frees its slots and tells the decode side
    plain.prefill.add_request(Req("held", list(ids), SamplingParams.from_dict(GREEDY)), 2003)
    while "held" not in [r.rid for r in plain.prefill.held.values()]:
        plain.pre.scheduler.step()
    assert plain.prefill.pop_exports()[0].regions
    assert plain.pre.scheduler.abort_request("held").finished_reason.type == "abort"
    assert plain.prefill.pop_exports()[0].error == "request aborted on the prefill server"
    # ... and a transfer that failed
    plain.prefill.add_request(Req("lost", list(ids), SamplingParams.from_dict(GREEDY)), 2004)
    while not plain.prefill.held:
        plain.pre.scheduler.step()
    plain.prefill.pop_exports()
    plain.prefill.finish_transfer(2004, error="peer unreachable")
    (lost,) = plain.pre.scheduler.step()
    assert lost.finished_reason.status_code == 500 and "peer unreachable" in lost.finished_reason.message
    plain.check_free()


def test_a_request_aborted_during_its_write_keeps_its_pages_until_the_write_ends(plain):
    """The prefill server's manager: an abort while the request's pages are being written frees them (and fails the
    room for the decode side) only once the write has ended, never under it."""
    import threading

    from sglang.srt.disaggregation.bootstrap import BootstrapClient, BootstrapServer
    from sglang.srt.disaggregation.kv_state import encode_layout
    from sglang.srt.disaggregation.messages import BootstrapInfo
    from sglang.srt.disaggregation.prefill_manager import PrefillKVManager

    class HeldWrite:
        session_id = "held:1"

        def __init__(self) -> None:
            self.started, self.release = threading.Event(), threading.Event()

        def register(self, buffers) -> None:
            pass

        def write(self, *args) -> None:
            self.started.set()
            self.release.wait(30)

        def close(self) -> None:
            pass

    sched, backend = plain.pre.scheduler, HeldWrite()
    server = BootstrapServer("127.0.0.1", 0)
    client = BootstrapClient("held:2")
    mgr = PrefillKVManager(sched, backend, server)
    try:
        info = BootstrapInfo("127.0.0.1", server.port, 3000)
        assert mgr.claim_room(info.room, "w") is None
        mgr.add(Req("w", list(PROMPTS[1]), SamplingParams.from_dict(GREEDY)), info)
        while not mgr.waiting:
            sched.step()
            mgr.poll()
        addrs = region_addresses(mgr.buffers, mgr.waiting[3000].regions)
        client.register(info, "w", [a for a, _ in addrs], [n for _, n in addrs], encode_layout(mgr.layout))
        while not backend.started.is_set():
            mgr.poll()
        # as the scheduler process routes an abort
        assert (mgr.abort("w") if mgr.owns("w") else sched.abort_request("w")) is None
        for _ in range(3):
            mgr.poll()
        assert not sched.allocator.is_all_free()  # the write still reads them
        backend.release.set()
        while mgr.has_pending():
            mgr.poll()
        (aborted,) = sched.step()
        assert aborted.rid == "w" and aborted.finished
        results = []
        while not results:
            results = client.poll()
        assert not results[0].ok and "aborted" in results[0].error
    finally:
        backend.release.set()
        mgr.close()
        client.close()
        sched.disagg = plain.prefill
    plain.check_free()


def test_a_failed_rooms_pages_stay_held_while_a_late_write_may_land(plain):
    """The decode server's manager: a room that failed after its registration (a 5xx: the prefill side's write may
    have timed out with bytes still in flight) fails its request at once but keeps its pages from reuse for the
    hold; a refused room (4xx: never written) frees them at once."""
    import time

    from sglang.srt.disaggregation.bootstrap import RoomResult
    from sglang.srt.disaggregation.decode_manager import DecodeKVManager
    from sglang.srt.disaggregation.messages import BootstrapInfo

    class Quiet:
        session_id = "quiet:1"

        def __init__(self) -> None:
            self.results = []

        def register(self, *args, **kwargs) -> None:
            pass

        def poll(self) -> list:
            results, self.results = self.results, []
            return results

        def close(self) -> None:
            pass

    sched, dec_alloc, client = plain.dec.scheduler, plain.dec.model_runner.token_allocator, Quiet()
    mgr = DecodeKVManager(sched, Quiet(), client, room_timeout_s=30.0, late_write_hold_s=0.5)
    try:
        for room, rid in ((4000, "late"), (4001, "refused")):
            mgr.add(Req(rid, list(PROMPTS[1]), SamplingParams.from_dict(GREEDY)), BootstrapInfo("h", 1, room))
        client.results = [RoomResult(4000, "late", ok=False, status_code=504, error="write timed out"),
                          RoomResult(4001, "refused", ok=False, status_code=400, error="layout differs")]
        mgr.poll()
        failed = {r.rid: r.finished_reason.status_code for r in sched.step()}
        assert failed == {"late": 504, "refused": 400}
        assert not dec_alloc.is_all_free() and mgr.has_pending() and len(mgr.side.held) == 1
        assert dec_alloc.req_to_token_pool.available_size() == dec_alloc.req_to_token_pool.size - 1
        mgr.poll()
        assert len(mgr.side.held) == 1  # not before the hold has passed
        time.sleep(0.6)
        mgr.poll()
        assert dec_alloc.is_all_free() and not mgr.has_pending()
    finally:
        mgr.close()
        sched.disagg = plain.decode
    plain.check_free()


def test_region_pairing_cuts_and_merges():
    # source contiguous, destination in two pieces: two copies; adjacent on both sides: merged
    plan = pair_regions([(1000, 96)], [(5000, 32), (7000, 64)])
    assert (plan.src_addrs, plan.dst_addrs, plan.lengths) == ([1000, 1032], [5000, 7000], [32, 64])
    plan = pair_regions([(0, 8), (8, 8), (100, 4)], [(50, 16), (66, 4)])
    assert (plan.src_addrs, plan.dst_addrs, plan.lengths) == ([0, 100], [50, 66], [16, 4])
    with pytest.raises(ValueError, match="pool differently"):
        pair_regions([(0, 8)], [(0, 12)])


def test_buffers_cover_every_pool_buffer(plain):
    pool = plain.pre.model_runner.token_to_kv_pool
    names = [b.name for b in transfer_buffers(pool)]
    assert len([n for n in names if n.startswith("window_kv.")]) == pool.num_layers
    assert {int(n.split(".")[1]) for n in names if n.startswith("compressed_kv.")} == set(pool.compressed_kv)
    assert {int(n.split(".")[1]) for n in names if n.startswith("index_k.")} == set(pool.index_k)
    assert all(b.nbytes > 0 and b.data_ptr for b in transfer_buffers(pool))
