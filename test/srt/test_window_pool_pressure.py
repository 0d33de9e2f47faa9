"""The window pool under requests that start on cached prefixes (issue: a fuzz pass, 2026-12-05). Each such request
reads its prefix's cached window tail, locked while it does, beside the window slots of its own new positions: up
to two windows per running request. With a pool sized for one window per request (--swa-full-tokens-ratio 0.01),
eight requests on eight cached 256-token prefixes failed their decode steps with a 500 (window KV pool exhausted).
The pool is now sized for both windows with the prefix cache on, and a decode step that still lacks window slots
retracts a request instead of failing."""

from __future__ import annotations

import pytest

import sglang.srt.mem_cache.pool_sizing as pool_sizing
from oracle import engine, random_ids

GREEDY = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
# the outputs of the workload's prompts run one at a time with nothing cached, filled by the first test that runs
ALONE: list = []
ARGS = dict(page_size=256, max_running_requests=8, chunked_prefill_size=32, swa_full_tokens_ratio=0.01,
            max_total_tokens=8192)


def _workload(eng) -> tuple:
    prefixes = [random_ids(256, seed=900 + i) for i in range(8)]
    for p in prefixes:  # one at a time: each prefix ends up in the cache
        eng.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 1})
    prompts = [p + random_ids(3, seed=950 + i) for i, p in enumerate(prefixes)]
    return prompts, eng.generate(input_ids=prompts, sampling_params=[GREEDY] * len(prompts))


@pytest.mark.parametrize("windows_per_request", [2, 1])
def test_requests_on_cached_prefixes_fit_the_window_pool(monkeypatch, windows_per_request):
    """2: the pool's sizing (no retraction needed); 1: the old sizing, where the scheduler must retract instead of
    failing a step. Either way every request gets the output it gets alone."""
    monkeypatch.setattr(pool_sizing, "CACHED_WINDOWS_PER_REQUEST", windows_per_request)
    eng = engine("tiny", **ARGS)
    try:
        prompts, outs = _workload(eng)
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * len(outs)
        assert all(o["meta_info"]["cached_tokens"] == 256 for o in outs[:4])
        retracted = eng.scheduler.num_retractions
        assert (retracted == 0) == (windows_per_request == 2), retracted
        eng.flush_cache()
        if not ALONE:  # each prompt alone is far from either sizing's limit: its output is computed once
            ALONE.extend(eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts)
        assert [o["output_ids"] for o in outs] == ALONE
        eng.model_runner.token_allocator.check_all_free()
    finally:
        eng.shutdown()
