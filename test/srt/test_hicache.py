"""The host tier under the prefix cache (mem_cache/host_tier.py, --enable-hierarchical-cache) is exact (CPU, fp32):
with a device pool too small for the sessions, greedy outputs and prompt logprobs equal the engine without a cache,
while later turns hit prefixes the device evicted, loaded back from the host (more cached tokens than the device
alone), for each write policy and io backend, with speculative decoding and under retraction; the host stays within
its bound and holds exactly the tree's copies; a request aborted right after its load frees everything on both tiers;
a flush empties both.

One engine per configuration for the module: the reference without a cache, and the tiered engine (built by the
flags, write_back), whose host tier each test replaces (another policy, io backend or size, as the flags would
build it) after a flush; its device-only runs are the same engine with the tier detached. About 40 s on 2 cores."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

import test_retraction as retraction
from oracle import engine, random_ids
from sglang.srt.managers.io_struct import SchedulerStats
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.metrics.collector import MetricsCollector
from sglang.srt.mem_cache.host_tier import HostTier, HostTierStats
from sglang.srt.mem_cache.pool_sizing import plan_host_tier, plan_pools
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from test_prefix_cache import SPEC, _assert_same

# 512 tokens of device pool (32 pages of 16): four sessions of 100-120 tokens evict each other every turn
SMALL = dict(max_total_tokens=512, chunked_prefill_size=64, max_running_requests=2)
SESSIONS = [random_ids(100, seed=30 + i) for i in range(4)]
SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _sessions(eng, turns: int = 2) -> list:
    """Multi-turn chats, interleaved turn by turn: each turn resends the conversation plus new tokens."""
    history = [list(s) for s in SESSIONS]
    outs = []
    for t in range(turns):
        for i, h in enumerate(history):
            out = eng.generate(input_ids=h, sampling_params=SP, return_logprob=True, logprob_start_len=len(h) - 4)
            outs.append(out)
            h += out["output_ids"] + random_ids(7, seed=100 * i + t)
    return outs


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


@pytest.fixture(scope="module")
def device_hits(tiered) -> int:
    """Cached tokens of the sessions with the prefix cache on the device alone."""
    with _device_only(tiered):
        return _cached(_sessions(tiered))


@pytest.mark.parametrize("policy,ratio,io", [
    ("write_back", 4.0, "kernel"), ("write_through", 4.0, "direct"), ("write_through", 0.4, "kernel")],
    ids=["write_back", "write_through-direct", "write_through-small-host"])
def test_multi_turn_sessions_identical_and_hit_from_host(tiered, plain, device_hits, policy, ratio, io):
    tier = _use_tier(tiered, policy, ratio, io)
    out = _sessions(tiered)
    _assert_same(out, plain.sessions)
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


def test_abort_right_after_a_load_frees_both_tiers(tiered):
    """A request admitted on a prefix loaded from the host and aborted before its prefill: every device slot it held
    is free again, the loaded prefix stays cached on both tiers, and the next turn reuses it."""
    tier = _use_tier(tiered, "write_back")
    first = SESSIONS[0][:60] + [3, 4]
    tiered.generate(input_ids=first, sampling_params=SP)
    for i in range(1, 4):  # evict the first session from the device
        tiered.generate(input_ids=random_ids(150, seed=60 + i), sampling_params=SP)
    loads = tier.stats.num_loads
    req = Req(rid="a", origin_input_ids=first + [7, 8], sampling_params=SamplingParams(max_new_tokens=4))
    tiered.scheduler.add_request(req)
    tiered.scheduler._admit()  # admission runs the match and the load, not the prefill
    assert tier.stats.num_loads == loads + 1 and req.cached_tokens == 48
    assert tiered.scheduler.abort_request("a") is req
    tiered.model_runner.token_allocator.check_all_free()
    out = tiered.generate(input_ids=first + [7, 8], sampling_params=SP)
    assert out["meta_info"]["cached_tokens"] == 48
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
])
def test_bad_flags_are_named(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path=str(tmp_path), **kwargs).validate()
