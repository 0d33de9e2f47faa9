"""Engine vs HF transformers DeepseekV4ForCausalLM on the same random weights (CPU, fp32).

For three configs (the docs' tiny one; the real HCA ratio 128 with prompts over 300 tokens; a Pro-like one with
no window-only layer and index_topk below the visible entries): prompt logprobs within 1e-4 and 64 greedy tokens
identical, for one full prefill, uneven chunked prefill, prefill then decode, and a staggered batch of 4
requests of different lengths. After each scenario every pool slot is free again.
"""

from __future__ import annotations

import functools

import pytest

from oracle import ORACLE_CONFIGS, assert_matches_hf, engine, greedy_run, hf_reference, random_ids
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams

NEW_TOKENS = 64
PROMPT_LENS = {"tiny": 77, "hca128": 321, "pro_like": 101}
CONFIGS = list(ORACLE_CONFIGS)


def reference(name: str, n: int, seed: int, new_tokens: int = NEW_TOKENS) -> tuple:
    """(ids, HF prompt logprobs, HF greedy tokens, their logprobs) for a random prompt."""
    return hf_reference(name, tuple(random_ids(n, seed)), new_tokens)


@functools.lru_cache(maxsize=None)
def shared_engine(name: str):
    return engine(name, chunked_prefill_size=-1)


def greedy_params() -> dict:
    return {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.mark.parametrize("name", CONFIGS)
def test_full_prefill_then_decode(name):
    ref = reference(name, PROMPT_LENS[name], seed=1)
    eng = shared_engine(name)
    out = greedy_run(eng, ref[0], NEW_TOKENS)
    assert_matches_hf(out, ref)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
    eng.model_runner.token_allocator.check_all_free()


@pytest.mark.parametrize("name", CONFIGS)
def test_uneven_chunked_prefill(name):
    """Chunks of 5, 3, 9, 1, 1, 1, 2 tokens, then the rest in chunks of 37, then decode."""
    ref = reference(name, PROMPT_LENS[name], seed=2)
    ids = ref[0]
    eng = shared_engine(name)
    sched = eng.scheduler
    req = Req(rid="chunked", origin_input_ids=list(ids), sampling_params=SamplingParams.from_dict(greedy_params()),
              return_logprob=True, logprob_start_len=0)
    sched.add_request(req)
    sched._admit()
    chunks = [5, 3, 9, 1, 1, 1, 2]
    while sum(chunks) < len(ids):
        chunks.append(min(37, len(ids) - sum(chunks)))
    for n in chunks:
        sched.run_batch(ScheduleBatch(ForwardMode.EXTEND, [req], [n]))
    while not req.finished:
        sched.step()
    assert_matches_hf(eng._output(req, 0.0), ref)
    eng.model_runner.token_allocator.check_all_free()


@pytest.mark.parametrize("name", CONFIGS)
def test_engine_chunked_prefill_size(name):
    """The scheduler's own chunking (--chunked-prefill-size 7) gives the same result."""
    ref = reference(name, PROMPT_LENS[name], seed=1)
    eng = engine(name, chunked_prefill_size=7)
    out = greedy_run(eng, ref[0], NEW_TOKENS)
    assert_matches_hf(out, ref)
    eng.model_runner.token_allocator.check_all_free()


@pytest.mark.parametrize("name", CONFIGS)
def test_staggered_batch(name):
    """4 requests of different lengths admitted at different steps, prefill chunks interleaved with decodes of
    others, each equal to running alone (= HF). The first is the other scenarios' prompt (its HF reference computed
    once) decoding 64 tokens; the later three decode 16, still while the others' chunks and decodes run."""
    base = PROMPT_LENS[name]
    refs = [reference(name, base, seed=1)]
    refs += [reference(name, n, seed=11 + i, new_tokens=16) for i, n in enumerate((base // 2 + 3, base - 17, 29))]
    eng = engine(name, chunked_prefill_size=24)
    sched = eng.scheduler
    reqs = [Req(rid=f"r{i}", origin_input_ids=list(r[0]), return_logprob=True, logprob_start_len=0,
                sampling_params=SamplingParams.from_dict({**greedy_params(), "max_new_tokens": len(r[2])}))
            for i, r in enumerate(refs)]
    admit_at = {0: reqs[0], 3: reqs[1], 7: reqs[2], 12: reqs[3]}
    step = 0
    while step <= max(admit_at) or sched.has_work():
        if step in admit_at:
            sched.add_request(admit_at[step])
        sched.step()
        step += 1
    for req, ref in zip(reqs, refs):
        assert_matches_hf(eng._output(req, 0.0), ref)
    eng.model_runner.token_allocator.check_all_free()
