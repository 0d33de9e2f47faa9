"""The prefix cache (mem_cache/radix_cache.py) is exact (CPU, fp32): greedy outputs identical and prompt logprobs
within 1e-5 (other prefill shapes) with and without it, for multi-turn chats, a concurrent batch sharing a system
prompt, interleaved sessions evicting each other's window tails and pages, and chunked prefill, with and without
speculative decoding (where the draft's acceptance is also the same: its window rows at a cached end are exact);
later turns report cached tokens; nothing leaks (what is held is exactly what the cache keeps), and after a flush
every pool is free. The flush is refused while requests wait or run."""

from __future__ import annotations

import pytest

from oracle import engine, random_ids
from soak import soak
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _run_sessions(eng, sessions: list, turns: int, logprob_tail: int = 4, sampling_params: dict = GREEDY) -> list:
    """Multi-turn chats, interleaved turn by turn: each turn resends the conversation plus new tokens (test_hicache.py
    runs them too)."""
    history = [list(s) for s in sessions]
    outs = []
    for t in range(turns):
        for i, h in enumerate(history):
            out = eng.generate(input_ids=h, sampling_params=sampling_params, return_logprob=True,
                               logprob_start_len=len(h) - logprob_tail)
            outs.append(out)
            h += out["output_ids"] + random_ids(7, seed=100 * i + t)
    return outs


SPEC = dict(speculative_algorithm="EAGLE", speculative_num_steps=2)


def _assert_same(got: list, ref: list) -> None:
    for g, r in zip(got, ref):
        assert g["output_ids"] == r["output_ids"]
        # speculative: the same drafts accepted (the draft's window at the cached end is what it computed itself)
        assert g["meta_info"].get("spec_accept_length") == r["meta_info"].get("spec_accept_length")
        a = [lp for lp, _, _ in g["meta_info"]["input_token_logprobs"] if lp is not None]
        b = [lp for lp, _, _ in r["meta_info"]["input_token_logprobs"] if lp is not None]
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5


def _both(run, **kwargs) -> tuple:
    """run(engine) with the cache and without; the cached engine's allocator is checked and flushed."""
    results = []
    for cache in (True, False):
        eng = engine("tiny", disable_radix_cache=not cache, **kwargs)
        try:
            results.append(run(eng))
            alloc = eng.model_runner.token_allocator
            alloc.check_all_free()  # held == what the cache keeps
            assert alloc.is_all_free()  # the per-step counters agree
            if cache:
                assert alloc.cache.num_pages > 0
                leaked = alloc.state_slots.alloc(1)  # a prefix-state slot nobody holds: seen by the counters too
                assert not alloc.is_all_free()
                alloc.state_slots.free(leaked)
                assert eng.flush_cache()
                assert alloc.cache.num_pages == 0 and alloc.pages.is_full() and alloc.swa_slots.is_full()
                assert not bool((alloc.full_to_swa != -1).any())
        finally:
            eng.shutdown()
    return results


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_multi_turn_sessions_identical_and_cached(spec):
    sessions = [random_ids(45, seed=1), random_ids(30, seed=2)]
    cached, plain = _both(lambda eng: _run_sessions(eng, sessions, turns=3), **(SPEC if spec else {}))
    _assert_same(cached, plain)
    later = [o["meta_info"]["cached_tokens"] for o in cached[2:]]
    assert all(c > 0 and c % 16 == 0 for c in later), later
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in plain)


def test_shared_system_prompt_batch():
    system = random_ids(50, seed=7)

    def run(eng):
        first = eng.generate(input_ids=system + [5, 6], sampling_params=GREEDY)
        batch = eng.generate(input_ids=[system + random_ids(6 + i, seed=20 + i) for i in range(4)],
                             sampling_params=GREEDY, return_logprob=True, logprob_start_len=52)
        return [first] + batch

    cached, plain = _both(run)
    _assert_same(cached[1:], plain[1:])
    assert cached[0]["output_ids"] == plain[0]["output_ids"]
    # the warm request cached its last page boundary (48 of the 52 tokens); the batch reuses it
    assert all(o["meta_info"]["cached_tokens"] == 48 for o in cached[1:])


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_shared_system_prompt_after_a_longer_prompt(spec):
    """The first prompt goes on past the shared system prompt, so the cache's end is past where the others leave
    it: the second request ends a chunk there and gives the cache an end (its tail and state) on the first one's
    pages, which the rest reuse."""
    system = random_ids(50, seed=7)

    def run(eng):
        prompts = [system + random_ids(40, seed=8)] + [system + random_ids(30 + i, seed=20 + i) for i in range(3)]
        return [eng.generate(input_ids=p, sampling_params=GREEDY, return_logprob=True, logprob_start_len=52)
                for p in prompts]

    cached, plain = _both(run, **(SPEC if spec else {}))
    _assert_same(cached, plain)
    assert [o["meta_info"]["cached_tokens"] for o in cached] == [0, 0, 48, 48]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_eviction_under_pressure_and_chunked_prefill(spec):
    """Small pools: sessions evict each other's tails and pages; chunks of 16 tokens."""
    sessions = [random_ids(60, seed=30 + i) for i in range(4)]
    kwargs = dict(max_total_tokens=512, chunked_prefill_size=16, max_running_requests=2, **(SPEC if spec else {}))
    cached, plain = _both(lambda eng: _run_sessions(eng, sessions, turns=3), **kwargs)
    _assert_same(cached, plain)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_speculative_end_needs_the_same_next_token(spec):
    """A cached end whose next token differs: reused without speculative decoding; with it the end is passed over
    (its last MTP row was computed with the other token), the outputs identical either way."""
    system = random_ids(48, seed=9)  # ends exactly at a page boundary: the next token is the user's

    def run(eng):
        return [eng.generate(input_ids=system + tail, sampling_params=GREEDY, return_logprob=True,
                             logprob_start_len=50) for tail in ([5, 6, 7], [5, 6, 9], [8, 6, 9])]

    cached, plain = _both(run, **(SPEC if spec else {}))
    _assert_same(cached, plain)
    assert [o["meta_info"]["cached_tokens"] for o in cached] == [0, 48, 0 if spec else 48]


def test_speculative_draft_state_at_a_cached_end_is_exact():
    """The first draft after a prefill that started on a cached end: the MTP's output streams equal those of the
    engine without the cache (they read the cached tail's MTP rows, the last one computed with this request's
    token; a finished request gives no end past its last draft-extended row)."""
    system = random_ids(48, seed=9)
    # sampled (seeded): its cycles run eagerly and its last cycle's MTP rows are never the committed tokens'; with 14
    # tokens the page boundary at 64 falls in that cycle, so the cache keeps its sequence only up to 48
    FIRST = {"temperature": 1.0, "seed": 3, "max_new_tokens": 14, "ignore_eos": True}
    streams, cached_tokens = [], []
    for cache in (True, False):
        eng = engine("tiny", disable_radix_cache=not cache, **SPEC)
        try:
            first = system + [5, 6, 7]
            out = eng.generate(input_ids=first, sampling_params=FIRST)["output_ids"]
            for prompt in (system + [5, 6, 9], system + [8, 6, 9], first + out + [3, 4]):
                req = Req(rid=str(len(streams)), origin_input_ids=prompt,
                          sampling_params=SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
                eng.scheduler.add_request(req)
                while req.spec is None:
                    eng.scheduler.step()
                streams.append(req.spec.draft_streams.clone())
                cached_tokens.append(req.cached_tokens)
                while not req.finished:
                    eng.scheduler.step()
        finally:
            eng.shutdown()
    assert cached_tokens == [48, 0, 48, 0, 0, 0]
    for cached, plain in zip(streams[:3], streams[3:]):
        assert (cached - plain).abs().max().item() <= 1e-5


def test_flush_refused_while_requests_wait():
    eng = engine("tiny")
    try:
        eng.generate(input_ids=random_ids(40, seed=1), sampling_params=GREEDY)
        req = Req(rid="w", origin_input_ids=random_ids(20, seed=2), sampling_params=SamplingParams(max_new_tokens=2))
        eng.scheduler.add_request(req)
        assert not eng.flush_cache()
        while not req.finished:
            eng.scheduler.step()
        assert eng.flush_cache() and eng.model_runner.token_allocator.cache.num_pages == 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("num_requests", [150])  # 1,000 run by hand: SGLANG_SOAK_REQUESTS=1000
def test_soak_no_leak(num_requests):
    """soak.py's chats with small pools: the pools stay consistent and memory flat. The five chats at their longest
    (5 x 100 tokens, in pages of 16) overfill the pool (512 tokens), so the tree evicts, and every 20 rounds each is
    cut back to its first 20 tokens, as at 1,000 requests on a pool twice the size."""
    eng = engine("tiny", max_total_tokens=512, max_running_requests=4)
    try:
        soak(eng, num_requests, "soak")
        alloc = eng.model_runner.token_allocator
        assert alloc.cache.hit_rate() > 0.3
        assert eng.flush_cache() and alloc.pages.is_full() and alloc.swa_slots.is_full()
    finally:
        eng.shutdown()
