"""The host tier under the prefix cache (mem_cache/host_tier.py, --enable-hierarchical-cache) is exact (CPU, fp32):
with a device pool too small for the sessions, greedy outputs and prompt logprobs equal the engine without a cache,
while later turns hit prefixes the device evicted, loaded back from the host (more cached tokens than the device
alone), for each write policy and io backend, with speculative decoding and under retraction; the host stays within
its bound and holds exactly the tree's copies, also over a soak with flat memory; copies run behind the scheduler
(mem_cache/tier_copy.py): no forward reads a load before it landed, a page under a write is not reused, a request
aborted while its load is in flight frees everything on both tiers; a flush empties both. The file tier
(mem_cache/file_tier.py) serves a second engine on the same directory, exactly; its files are checked, bounded and
written behind the scheduler; clearing the storage tier deletes them and leaves the other tiers.

One engine per configuration for the module: the reference without a cache, and the tiered engine (built by the
flags, write_back), whose host tier each test replaces (another policy, io backend or size, as the flags would
build it) after a flush; its device-only runs are the same engine with the tier detached. About 65 s of CPU time
(2 cores), 20 s of it the retraction references, shared with test_retraction.py when both run in one process."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import threading

import pytest
import torch

import test_retraction as retraction
from oracle import engine, random_ids
from sglang.srt.managers.io_struct import SchedulerStats
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.metrics.collector import MetricsCollector
from sglang.srt.mem_cache.file_tier import _HEADER as FILE_HEADER
from sglang.srt.mem_cache.file_tier import FileStore, FileTier, FileTierConfig, chain_hashes, node_hashes
from sglang.srt.mem_cache.host_tier import HostTier, HostTierStats, _page_rows
from sglang.srt.mem_cache.pool_sizing import plan_host_tier, plan_pools
from sglang.srt.mem_cache.radix_cache import CacheCallbacks, RadixCache, TreeNode
from sglang.srt.mem_cache.tier_copy import CpuCopyEngine
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from soak import soak
from test_prefix_cache import SPEC, _assert_same, _run_sessions

# 512 tokens of device pool (32 pages of 16): four sessions of 100-120 tokens evict each other every turn
SMALL = dict(max_total_tokens=512, chunked_prefill_size=64, max_running_requests=2)
SESSIONS = [random_ids(100, seed=30 + i) for i in range(4)]
SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _sessions(eng, turns: int = 2) -> list:
    """test_prefix_cache's multi-turn chats on SESSIONS, interleaved turn by turn."""
    return _run_sessions(eng, SESSIONS, turns, sampling_params=SP)


def _shared_prefix(eng) -> list:
    """A system prompt, then two batches of it with different questions, unrelated prompts filling the device pool
    after each batch."""
    system = random_ids(50, seed=7)
    outs = [eng.generate(input_ids=system + [5, 6], sampling_params=SP)]
    for round_ in range(2):
        outs += eng.generate(input_ids=[system + random_ids(6 + i, seed=20 + i + 10 * round_) for i in range(3)],
                             sampling_params=SP, return_logprob=True, logprob_start_len=52)
        for i in range(3):
            eng.generate(input_ids=random_ids(150, seed=90 + i + 10 * round_), sampling_params=SP)
    return outs


def _cached(outs: list) -> int:
    return sum(o["meta_info"]["cached_tokens"] for o in outs)


@dataclasses.dataclass
class Reference:
    sessions: list  # outputs of _sessions without a cache
    shared: list  # ... of _shared_prefix


@pytest.fixture(scope="module")
def plain():
    eng = engine("tiny", disable_radix_cache=True, **SMALL)
    try:
        yield Reference(_sessions(eng), _shared_prefix(eng))
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def tiered():
    eng = engine("tiny", **SMALL, enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_write_policy="write_back")
    try:
        yield eng
    finally:
        eng.shutdown()


def _use_tier(eng, policy: str, ratio: float = 4.0, io: str = "kernel") -> HostTier:
    """A flushed engine with a fresh host tier of that policy, size and io backend (as the flags build it); the one
    the flags built when it is the same."""
    assert eng.flush_cache()
    runner = eng.model_runner
    tier = runner.token_allocator.host_tier
    shape = plan_host_tier(runner.model_config, runner.pool_plan, ratio)
    if (tier.write_policy, tier.pool.io_backend, tier.shape) != (policy, io, shape):
        tier = HostTier(runner.token_to_kv_pool, shape, policy, io)
        runner.token_allocator.attach_host_tier(tier)
    return tier


@contextlib.contextmanager
def _device_only(eng):
    """The engine with its host tier detached (the prefix cache on the device alone), flushed after."""
    alloc = eng.model_runner.token_allocator
    tier = alloc.host_tier
    assert eng.flush_cache()
    alloc.cache.tier = alloc.host_tier = None
    try:
        yield
        assert eng.flush_cache()
    finally:
        alloc.attach_host_tier(tier)


def _check_and_flush(eng) -> None:
    """Both tiers hold exactly the tree's copies, within their bounds; a flush empties both."""
    alloc = eng.model_runner.token_allocator
    tier = alloc.host_tier
    alloc.check_all_free()  # with the host tier's check: its held slots are the tree's copies
    assert tier.pages.size - 1 == tier.shape.num_pages and tier.ends.size - 1 == tier.shape.num_ends  # the bound
    assert eng.flush_cache()
    assert alloc.pages.is_full() and alloc.swa_slots.is_full() and tier.pages.is_full() and tier.ends.is_full()
    assert not alloc.cache.root.children and not bool((alloc.full_to_swa != -1).any())


class LateCopies(CpuCopyEngine):
    """Copies land `late` polls after they were submitted, or stage by stage when waited for (`forced`: a wait that
    ran a stage); `overlapped`: layers that ran while a later layer's rows of a load they read had not landed."""

    def __init__(self, late: int) -> None:
        super().__init__()
        self.late, self.polls, self.forced, self.overlapped = late, 0, 0, 0

    def submit(self, *stages):
        ticket = super().submit(*stages)
        ticket.submitted_at = self.polls
        return ticket

    def poll(self) -> None:
        self.polls += 1
        super().poll()

    def _finished(self, ticket) -> bool:
        return self.polls - ticket.submitted_at >= self.late and super()._finished(ticket)

    def wait_device(self, ticket, stage=None) -> None:
        if ticket is not None and not ticket.done:
            self.forced += ticket.landed < (len(ticket.stages) if stage is None else stage + 1)
        super().wait_device(ticket, stage)

    def _complete(self, ticket, block: bool = False) -> None:
        if ticket.finishes and torch.cuda.is_available():  # on a GPU engine (SGLANG_TEST_DEVICE=cuda) a write's
            torch.cuda.synchronize()  # staging buffer lands on the device's stream: let it land before reading it
        super()._complete(ticket, block)


def _late_copies(eng, monkeypatch, late: int) -> LateCopies:
    """The engine's host tier on LateCopies; before each layer of every forward, a check that the loads its requests
    read have landed that layer's rows (stage 0, then one stage per layer)."""
    scheduler, tier = eng.scheduler, eng.model_runner.token_allocator.host_tier
    copies = LateCopies(late)
    monkeypatch.setattr(tier, "copies", copies)

    def check(forward_batch, i: int) -> None:
        rows = set(forward_batch.req_pool_indices_cpu)
        for req in scheduler.running:
            ticket = tier.pending_load(req.cache_node) if req.alloc and req.alloc.req_pool_idx in rows else None
            if ticket is not None:
                assert ticket.landed >= i + 2, f"request {req.rid}'s layer {i} read rows that have not landed"
                copies.overlapped += ticket.landed < len(ticket.stages)

    for i, layer in enumerate(eng.model_runner.model.layers):
        def checked(*args, i=i, forward=layer.forward):
            check(args[3], i)
            return forward(*args)
        monkeypatch.setattr(layer, "forward", checked)
    return copies


@pytest.fixture(scope="module")
def device_hits(tiered) -> int:
    """Cached tokens of the sessions with the prefix cache on the device alone."""
    with _device_only(tiered):
        return _cached(_sessions(tiered))


@pytest.mark.parametrize("policy,ratio,io", [
    ("write_back", 4.0, "kernel"), ("write_through", 4.0, "direct"), ("write_through", 0.4, "kernel")],
    ids=["write_back", "write_through-direct", "write_through-small-host"])
def test_multi_turn_sessions_identical_and_hit_from_host(tiered, plain, device_hits, policy, ratio, io, monkeypatch):
    """write_back runs on copies that land two steps late unless waited for: every layer of every forward reads only
    rows of loads that landed (a request waits for them layer by layer: later layers' rows land while earlier layers
    run), and the outputs are still exact."""
    tier = _use_tier(tiered, policy, ratio, io)
    if policy == "write_back":
        late = _late_copies(tiered, monkeypatch, late=2)
    out = _sessions(tiered)
    _assert_same(out, plain.sessions)
    if policy == "write_back":  # loads still in flight when their readers' forwards came, landing layer by layer
        assert late.forced > 0 and late.overlapped > 0
    assert tier.stats.bytes_to_host > 0
    if ratio > 1:  # the host holds every session: later turns load them back
        assert tier.stats.num_loads > 0 and tier.stats.bytes_to_device > 0 and tier.stats.host_hit_tokens > 0
        assert _cached(out) > device_hits
    _check_and_flush(tiered)


def test_speculative_sessions_identical_and_hit_from_host():
    """The same with MTP speculative decoding (the host keeps the ends' MTP window rows): the same drafts accepted."""
    eng = engine("tiny", disable_radix_cache=True, **SMALL, **SPEC)
    try:
        ref = _sessions(eng)
    finally:
        eng.shutdown()
    eng = engine("tiny", **SMALL, **SPEC, enable_hierarchical_cache=True, hicache_ratio=4.0,
                 hicache_write_policy="write_back")
    try:
        with _device_only(eng):
            device_only = _cached(_sessions(eng))
        out = _sessions(eng)
        _assert_same(out, ref)
        stats = eng.model_runner.token_allocator.host_tier.stats
        assert stats.num_loads > 0 and stats.bytes_to_device > 0 and stats.host_hit_tokens > 0
        assert _cached(out) > device_only
        _check_and_flush(eng)
    finally:
        eng.shutdown()


def test_host_ends_kept_where_sessions_resume(tiered):
    """Six chats, three turns, host ends for eight: each turn's new end leaves the last one inside the path; those go
    first, so every next turn finds its whole history (LRU alone drops the ends of chats not yet come around)."""
    tier, page = _use_tier(tiered, "write_through", ratio=2.0), tiered.model_runner.token_allocator.page_size
    assert tier.shape.num_ends == 8
    history = [random_ids(40, seed=60 + i) for i in range(6)]
    last = [0] * len(history)
    for turn in range(3):
        for i, h in enumerate(history):
            out = tiered.generate(input_ids=h, sampling_params=dict(SP, max_new_tokens=1))
            if turn:  # the previous prompt and its output token, whole pages of them
                assert out["meta_info"]["cached_tokens"] == (last[i] + 1) // page * page, (turn, i)
            last[i] = len(h)
            h += out["output_ids"] + random_ids(31, seed=70 + 10 * i + turn)
    assert tier.stats.host_hit_tokens > 0
    _check_and_flush(tiered)


def test_shared_prefix_batch_selective_copy_and_load(tiered, plain):
    """write_through_selective: the shared system prompt, matched by the batch, is copied to the host; other traffic
    then evicts it from the device, and the next batch loads it back (48 cached tokens each), outputs identical."""
    tier = _use_tier(tiered, "write_through_selective")
    got = _shared_prefix(tiered)
    _assert_same(got[1:], plain.shared[1:])
    assert got[0]["output_ids"] == plain.shared[0]["output_ids"]
    assert [o["meta_info"]["cached_tokens"] for o in got[4:]] == [48, 48, 48]  # the second batch: from the host
    assert tier.stats.num_loads > 0
    _check_and_flush(tiered)


def test_abort_mid_load_frees_both_tiers(tiered, monkeypatch):
    """A request admitted on a prefix loaded from the host and aborted while that load is in flight (copies land
    only when waited for): the device pool's usage is what it was before it came, before and after the load lands,
    both tiers holding exactly the tree's copies (the room the load made was written to the host); the loaded prefix
    stays cached on both tiers, and the next turn reuses it with the outputs of a run without it."""
    tier = _use_tier(tiered, "write_back")
    alloc = tiered.model_runner.token_allocator
    first = SESSIONS[0][:60] + [3, 4]
    tiered.generate(input_ids=first, sampling_params=SP)
    for i in range(1, 4):  # evict the first chat from the device
        tiered.generate(input_ids=random_ids(150, seed=60 + i), sampling_params=SP)
    late = _late_copies(tiered, monkeypatch, late=10**9)

    def usage():
        return alloc.available_pages(), alloc.available_window_slots(), alloc.available_req_slots()

    before, loads = usage(), tier.stats.num_loads
    req = Req(rid="a", origin_input_ids=first + [7, 8], sampling_params=SamplingParams(max_new_tokens=4))
    tiered.scheduler.add_request(req)
    tiered.scheduler._admit()  # admission runs the match and submits the load, not the prefill
    assert tier.stats.num_loads == loads + 1 and req.cached_tokens == 48
    assert late.busy() and not req.alloc.pending.done
    assert tiered.scheduler.abort_request("a") is req
    assert usage() == before
    alloc.check_all_free()  # with the host tier's check: its slots held are the tree's copies
    late.drain()  # the load lands
    assert usage() == before and not copies_held(alloc, tier)
    alloc.check_all_free()
    again = dict(input_ids=first + [7, 8], sampling_params=SP, return_logprob=True, logprob_start_len=55)
    out = tiered.generate(**again)
    assert out["meta_info"]["cached_tokens"] == 48
    _check_and_flush(tiered)
    cold = tiered.generate(**again)
    assert cold["meta_info"]["cached_tokens"] == 0
    _assert_same([out], [cold])
    _check_and_flush(tiered)


def copies_held(alloc, tier) -> int:
    return sum(tier.copies.held(p) for p in (alloc.pages, alloc.swa_slots, alloc.state_slots, tier.pages, tier.ends))


def test_pages_under_write_are_not_reused(tiered, monkeypatch):
    """write_back copies a node's pages and end to the host as the device evicts them; until the copy has landed
    (here: when waited for) they stay out of the free lists, counted as available: whoever takes every free page
    meanwhile and overwrites it cannot touch them, and the host copy is the device's rows."""
    tier = _use_tier(tiered, "write_back")
    alloc = tiered.model_runner.token_allocator
    tiered.generate(input_ids=SESSIONS[0][:60], sampling_params=SP)
    copies = _late_copies(tiered, monkeypatch, late=10**9)
    nodes = [n for n in alloc.cache.nodes() if n.pages]
    rows = [[dev[_page_rows(n.pages, k)].clone() for dev, _, k in tier.pool.page_buffers] for n in nodes]
    available, free, cached = alloc.available_pages(), alloc.pages.available(), alloc.cache.num_pages
    evicted = alloc.cache.evict_pages(cached)
    assert evicted == cached > 0 and copies.busy()
    assert alloc.pages.available() == free and copies.held(alloc.pages) == evicted
    assert copies.held(alloc.swa_slots) > 0 and copies.held(alloc.state_slots) > 0  # the end's tail and state
    assert alloc.available_pages() == available
    taken = alloc.pages.alloc(alloc.pages.available())  # the next owners write their rows
    for dev, _, k in tier.pool.page_buffers:
        dev.view(torch.uint8)[_page_rows(taken, k)] = 0xAB
    alloc.pages.free(taken)
    copies.drain()
    assert alloc.pages.available() == free + evicted and copies.held(alloc.pages) == 0
    for n, want in zip(nodes, rows):
        assert not n.pages and n.host_pages is not None
        for (_, host, k), w in zip(tier.pool.page_buffers, want):
            assert torch.equal(host[_page_rows(n.host_pages, k)].view(torch.uint8), w.cpu().view(torch.uint8))
    _check_and_flush(tiered)


def _file_engine(storage_dir, **kwargs):
    extra = json.dumps({"storage_dir": str(storage_dir)})
    return engine("tiny", **SMALL, enable_hierarchical_cache=True, hicache_ratio=4.0,
                  hicache_write_policy="write_through", hicache_storage_backend="file",
                  hicache_storage_backend_extra_config=extra, hicache_storage_prefetch_policy="wait_complete", **kwargs)


def _second_turns(plain) -> list:
    """The sessions' second-turn prompts (what the reference answered to their first turn, then the user's)."""
    return [s + o["output_ids"] + random_ids(7, seed=100 * i) for i, (s, o) in enumerate(zip(SESSIONS, plain.sessions))]


def test_file_tier_outlives_the_server(tiered, plain, tmp_path, caplog):
    """--hicache-storage-backend file: a server writes what its host tier holds to files; the next server on the
    directory (the first shut down) starts with an empty tree and loads the sessions' second turns from the files,
    outputs identical to no cache. A truncated file is a miss (logged; written again once recomputed), a server of
    another model sees none of the files, /flush_cache keeps them and a weight update deletes them."""
    eng = _file_engine(tmp_path)
    try:
        _assert_same(_sessions(eng), plain.sessions)
        first = eng.model_runner.token_allocator.host_tier
        assert first.stats.bytes_to_file > 0 and first.files.store.index
        identity = eng.model_runner.model_path
    finally:
        eng.shutdown()
    tier = _use_tier(tiered, "write_through")
    assert "--hicache-storage-backend" in tiered.scheduler.clear_hicache_storage()  # none yet: nothing to clear
    tier.files = FileTier(tier.pool, FileTierConfig(str(tmp_path)), "wait_complete", identity)
    store = tier.files.store
    names = list(store.index)
    with open(store._path(names[0]), "r+b") as f:  # truncated
        f.truncate(40)
    prompts = _second_turns(plain)
    out = [tiered.generate(input_ids=p, sampling_params=SP, return_logprob=True, logprob_start_len=len(p) - 4)
           for p in prompts]
    _assert_same(out, plain.sessions[4:])
    assert tier.stats.file_hit_tokens > 0 and tier.stats.bytes_from_file > 0
    assert sum(o["meta_info"]["cached_tokens"] > 0 for o in out) >= 3  # a damaged file costs at most one session
    assert "truncated header" in caplog.text and store.get(bytes.fromhex(names[0])) is not None  # recomputed
    tiered.model_runner.token_allocator.check_all_free()
    assert tiered.flush_cache() and store.index and all(os.path.exists(store._path(n)) for n in store.index)
    _clear_storage_keeps_the_other_tiers(tiered, prompts[0])

    hits = tier.stats.file_hit_tokens
    tier.files = FileTier(tier.pool, FileTierConfig(str(tmp_path)), "wait_complete", identity + "-other")
    assert tier.files.store.dir != store.dir and not tier.files.store.index
    assert tiered.generate(input_ids=prompts[2], sampling_params=SP)["meta_info"]["cached_tokens"] == 0
    assert tier.stats.file_hit_tokens == hits
    tier.files = FileTier(tier.pool, FileTierConfig(str(tmp_path)), "wait_complete", identity)
    tiered.model_runner.token_allocator.flush_cache(storage=True)  # what a weight update does
    assert tier.files is None and not os.listdir(store.dir)
    _check_and_flush(tiered)


def _clear_storage_keeps_the_other_tiers(eng, prompt: list) -> None:
    """/clear_hicache_storage_backend's work: every file deleted (the copies in flight, which save files, landed
    first), while the device and host tiers keep what they hold and serve the next turn."""
    alloc = eng.model_runner.token_allocator
    tier, out = alloc.host_tier, eng.generate(input_ids=prompt, sampling_params=SP)
    store, kept = tier.files.store, (alloc.cache.num_pages, tier.pages.available(), tier.ends.available())
    assert store.index and eng.scheduler.clear_hicache_storage() is None
    assert not store.index and not os.listdir(store.dir)
    assert (alloc.cache.num_pages, tier.pages.available(), tier.ends.available()) == kept
    read = tier.stats.bytes_from_file
    again = eng.generate(input_ids=prompt, sampling_params=SP)
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == out["output_ids"]
    assert tier.stats.bytes_from_file == read  # served by the device and host tiers


def test_prefetch_policies(tiered, plain, tmp_path):
    """Room for a match's files in a host tier full of copies: best_effort drops only copies the device also holds
    (no host-only prefix is lost), wait_complete the least recently used of any; timeout stops reading at its deadline
    (a match past it starts where the tree's own copies end), outputs identical."""
    tier = _use_tier(tiered, "write_through", ratio=1.0)
    _sessions(tiered)  # every cached node copied to a host tier too small for the sessions: it fills up
    host_only = lambda: sum(1 for n in tier.cache.nodes() if not n.pages)  # noqa: E731
    before, free = host_only(), tier.pages.available()
    need = tier.shape.num_pages  # more than the device-backed copies
    for policy, loses in (("best_effort", False), ("wait_complete", True)):
        files = FileTier(tier.pool, FileTierConfig(str(tmp_path)), policy, "m")
        assert not files.room(tier, need, 0) if policy == "best_effort" else files.room(tier, need, 0)
        assert (host_only() < before) == loses and tier.pages.available() > free
    assert tiered.flush_cache()
    tier.files = FileTier(tier.pool, FileTierConfig(str(tmp_path)), "wait_complete", "m")
    prompts = _second_turns(plain)
    tiered.generate(input_ids=prompts[0], sampling_params=SP)  # its files written (write_back: at eviction)
    for i in range(1, 4):
        tiered.generate(input_ids=random_ids(150, seed=60 + i), sampling_params=SP)
    assert tiered.flush_cache() and tier.files.store.index
    tier.files.store.drain()
    tier.files = FileTier(tier.pool, FileTierConfig(str(tmp_path), prefetch_timeout_base=1e-9), "timeout", "m")
    assert tier.files.store.index
    out = tiered.generate(input_ids=prompts[0], sampling_params=SP, return_logprob=True,
                          logprob_start_len=len(prompts[0]) - 4)
    _assert_same([out], plain.sessions[4:5])
    assert out["meta_info"]["cached_tokens"] == 0 and tier.stats.file_hit_tokens == 0
    _check_and_flush(tiered)


def test_chain_hashes_name_the_whole_prefix():
    """A page's hash covers every token before it: the same for a node however the tree splits it, different when an
    earlier token differs; computed down a path of any depth (no recursion)."""
    cache = RadixCache(4, 4, CacheCallbacks(lambda p: None, lambda f, s: None, lambda s: None))
    tokens = list(range(40))
    flat = chain_hashes(b"", tokens, 4)
    node = cache.root
    for i in range(0, 40, 8):  # a path of five nodes of two pages
        node.children[tuple(tokens[i:i + 4])] = node = TreeNode(node, tokens[i:i + 8], [0, 0])
    assert node_hashes(node, 4) == flat[8:]
    upper = cache._split(node.parent, 1)  # the fourth node cut after its first page
    assert node_hashes(upper, 4) == [flat[6]] and upper.children[tuple(tokens[28:32])].page_hashes == [flat[7]]
    assert chain_hashes(b"", [1] + tokens[1:], 4)[-1] != flat[-1]
    deep = cache.root
    for i in range(5000):
        deep = TreeNode(deep, [i, i, i, i], [0])
    assert len(node_hashes(deep, 4)) == 1


def test_file_store_bounds_and_rejects(tmp_path):
    """The directory stays within max_size_gb, least recently used files deleted first (a read counts as a use);
    a file of another layout, with a wrong key, a changed byte or cut short is a miss, and deleted."""
    layout = b"L" * 32
    store = FileStore(str(tmp_path), layout, max_bytes=3 * (FILE_HEADER.size + 100))
    keys = [bytes([i]) * 32 for i in range(4)]
    for k in keys[:3]:
        store.put(k, bytes(100))
    assert store.get(keys[0]) == bytes(100)  # now the most recent (read from memory or disk: the write is queued)
    store.put(keys[3], bytes(100))
    store.drain()
    assert keys[1] not in store and all(k in store for k in (keys[0], keys[2], keys[3]))
    assert store.nbytes == 3 * (FILE_HEADER.size + 100) and len(os.listdir(store.dir)) == 3
    assert FileStore(str(tmp_path), layout, 1 << 30).index.keys() == store.index.keys()  # read back at start
    other = FileStore(str(tmp_path), b"M" * 32, 1 << 30)
    assert not other.index and other.dir != store.dir
    shutil.copy(store._path(keys[0].hex()), other._path(keys[0].hex()))
    shutil.copy(store._path(keys[2].hex()), other._path(keys[3].hex()))
    other = FileStore(str(tmp_path), b"M" * 32, 1 << 30)
    assert other.get(keys[0]) is None and other.get(keys[3]) is None and not other.index
    with open(store._path(keys[2].hex()), "r+b") as f:  # one payload byte changed
        f.seek(-1, 2)
        f.write(b"\x01")
    with open(store._path(keys[3].hex()), "r+b") as f:
        f.truncate(FILE_HEADER.size + 50)
    assert store.get(keys[2]) is None and store.get(keys[3]) is None and store.get(keys[0]) is not None
    assert list(store.index) == [keys[0].hex()] and len(os.listdir(store.dir)) == 1  # the bad ones deleted


def test_file_store_writes_behind(tmp_path):
    """Writes queue on the writer thread: a file is readable (from memory) before it reaches the disk, and one dropped
    before its write (evicted past the bound) never lands."""
    store = FileStore(str(tmp_path), b"L" * 32, max_bytes=FILE_HEADER.size + 100)
    gate = threading.Event()
    store._writer.submit(gate.wait)  # the writer is busy
    first, second = b"\x01" * 32, b"\x02" * 32
    store.put(first, bytes(100))
    assert first in store and store.get(first) == bytes(100) and not os.listdir(store.dir)
    store.put(second, b"\x07" * 100)  # past the bound: the first is dropped while queued
    gate.set()
    store.drain()
    assert os.listdir(store.dir) == [second.hex() + ".kv"] and list(store.index) == [second.hex()]
    assert store.get(second) == b"\x07" * 100


@pytest.mark.parametrize("extra,message", [
    ("{not json", "not JSON"), ('{"storage_dir": "/x", "size": 1}', "unknown key 'size'"),
    ('{"max_size_gb": 0}', "max_size_gb"), ("[1]", "JSON object")])
def test_file_tier_config_errors_are_named(extra, message):
    with pytest.raises(ValueError, match="--hicache-storage-backend-extra-config.*" + message):
        FileTierConfig.parse(extra, "/tmp/x")


@pytest.mark.parametrize("num_requests", [60])  # 1,000 run by hand: SGLANG_SOAK_REQUESTS=1000
def test_soak_host_tier_bounded_and_rss_flat(tiered, num_requests):
    """soak.py's chats on the 512-token device pool with a host tier of the same size (write_back): both tiers evict
    and load all along; after every batch they hold exactly the tree's copies, the host's buffers never grow, and the
    process's memory is flat after the first third."""
    tier = _use_tier(tiered, "write_back", ratio=1.0)
    host_bytes = tier.pool.nbytes
    soak(tiered, num_requests, "host-tier soak")
    assert tier.pool.nbytes == host_bytes and tier.stats.num_loads > 0 and tier.stats.bytes_to_host > 0
    _check_and_flush(tiered)


def test_retraction_under_pressure_identical():
    """The oversubscribed workload of test_retraction.py (a 192-token pool, retractions mid-decode) with the host tier
    on: the outputs of the un-pressured run."""
    stops, ref = retraction._stops(), retraction._unpressured()
    eng = retraction._pressured(enable_hierarchical_cache=True, hicache_write_policy="write_back")
    try:
        got = retraction._drive(eng, stops)
        retraction._assert_retracted_mid_decode(eng)
        retraction._assert_same(got, ref)
        assert eng.model_runner.token_allocator.host_tier.stats.bytes_to_host > 0
        _check_and_flush(eng)
    finally:
        eng.shutdown()


def test_metrics_report_tiers_and_bytes():
    metrics = MetricsCollector("m")
    stats = HostTierStats(host_hit_tokens=30, bytes_to_host=4096, bytes_to_device=1024, num_loads=2,
                          load_seconds=[0.002, 0.004])
    metrics.observe_stats(SchedulerStats(0, 0, 0.0, 0, cache_hit_rate=0.5, cache_queried_tokens=100,
                                         hicache=stats.take()))
    assert stats.load_seconds == []  # each load's latency is observed once
    text = metrics.render().decode()
    assert 'sglang:cache_tier_hit_rate{model_name="m",tier="host"} 0.3' in text
    assert 'sglang:cache_tier_hit_rate{model_name="m",tier="device"} 0.2' in text
    assert 'sglang:hicache_bytes_total{direction="to_host",model_name="m"} 4096.0' in text
    assert 'sglang:hicache_load_latency_seconds_count{model_name="m"} 2.0' in text
    # the file tier's hits are loads through the host: their share moves from the host's rate to the file's
    stats.file_hit_tokens, stats.bytes_to_file, stats.bytes_from_file = 10, 2048, 512
    metrics.observe_stats(SchedulerStats(0, 0, 0.0, 0, cache_hit_rate=0.5, cache_queried_tokens=100,
                                         hicache=stats.take()))
    text = metrics.render().decode()
    assert 'sglang:cache_tier_hit_rate{model_name="m",tier="file"} 0.1' in text
    assert 'sglang:cache_tier_hit_rate{model_name="m",tier="host"} 0.2' in text
    assert 'sglang:hicache_bytes_total{direction="to_file",model_name="m"} 2048.0' in text
    assert 'sglang:hicache_bytes_total{direction="from_file",model_name="m"} 512.0' in text
    assert 'sglang:hicache_bytes_total{direction="to_host",model_name="m"} 4096.0' in text  # counted once


def test_host_tier_size_from_ratio_or_gb():
    """--hicache-ratio scales the device pool's pages and prefix ends; --hicache-size (GB) wins, in the same
    proportion; a size that holds nothing is refused, naming the flag."""
    plan, config = _flash_plan()
    by_ratio = plan_host_tier(config, plan, 2.0)
    assert (by_ratio.num_pages, by_ratio.num_ends) == (2 * (plan.shape.num_pages - 1), 2 * plan.shape.num_state_slots)
    by_size = plan_host_tier(config, plan, 2.0, hicache_size_gb=by_ratio.nbytes / 2 / 2**30)
    assert abs(by_size.num_pages - by_ratio.num_pages // 2) <= 1 and by_size.nbytes <= by_ratio.nbytes / 2
    with pytest.raises(ValueError, match="--hicache-size"):
        plan_host_tier(config, plan, 2.0, hicache_size_gb=1e-9)
    assert "host tier" in dataclasses.replace(plan, host=by_ratio).format()


def _flash_plan() -> tuple:
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.configs.hub_configs import FLASH

    config = DeepseekV4Config.from_dict(FLASH)
    plan = plan_pools(config, page_size=256, max_running_requests=64, context_length=65536, chunked_prefill_size=8192,
                      swa_full_tokens_ratio=0.1, budget_bytes=20 * 2**30, kv_entry_bytes=584, index_entry_bytes=68,
                      num_window_layers=config.num_hidden_layers, prefix_cache=True)
    return plan, config


@pytest.mark.parametrize("kwargs,message", [
    (dict(hicache_write_policy="write_around"), "--hicache-write-policy"),
    (dict(hicache_io_backend="nixl"), "--hicache-io-backend"),
    (dict(hicache_ratio=0), "--hicache-ratio"),
    (dict(hicache_size=-1), "--hicache-size"),
    (dict(enable_hierarchical_cache=True, disable_radix_cache=True), "--disable-radix-cache"),
    (dict(hicache_storage_backend="file"), "--enable-hierarchical-cache"),
    (dict(enable_hierarchical_cache=True, hicache_storage_backend="mooncake"), "--hicache-storage-backend"),
    (dict(enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_prefetch_policy="eager"),
     "--hicache-storage-prefetch-policy"),
    (dict(enable_hierarchical_cache=True, hicache_storage_backend="file",
          hicache_storage_backend_extra_config='{"dir": 1}'), "--hicache-storage-backend-extra-config"),
])
def test_bad_flags_are_named(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path=str(tmp_path), **kwargs).validate()
