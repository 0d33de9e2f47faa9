"""Seeded random schedules against the requests alone: greedy and seeded requests arrive at random steps beside
requests that fail at their 1st-3rd token (in the sampler or while their tokens are committed, so also while the
step behind is in flight) and one aborted at a random step. Each schedule is deterministic (its seed); every request
that neither failed nor was aborted must produce the tokens it produces alone, and every pool slot is free after.
The same on a pool small enough that running requests are retracted (and resumed) between the failures.
test_step_isolation.py pins each mechanism with a scenario of its own; this covers their combinations."""

from __future__ import annotations

import random

import pytest

import sglang.srt.managers.scheduler as scheduler_module
import sglang.srt.managers.scheduler_output_processor_mixin as output_module
from oracle import engine, random_ids
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from test_step_isolation import isolation_engine

MARK = [7, 7, 7]  # a failing request's prompt: MARK + [tokens it gets first] + filler
PROMPTS = [random_ids(n, 300 + n) for n in (6, 13, 22, 41)]
PARAMS = [{"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
          {"temperature": 0.8, "top_k": 50, "seed": 7, "max_new_tokens": 10, "ignore_eos": True}]


LONG_PARAMS = [{**PARAMS[0], "max_new_tokens": 40}, {**PARAMS[1], "max_new_tokens": 60}]
_ALONE: dict = {}


def _alone(params: list) -> dict:
    """{(prompt, params): output ids} of each request run alone (no failure injected), computed once per params list
    for both failure sites."""
    key = id(params)
    if key not in _ALONE:
        eng = isolation_engine(False)
        _ALONE[key] = {(i, j): eng.generate(input_ids=p, sampling_params=params[j])["output_ids"]
                       for i, p in enumerate(PROMPTS) for j in range(2)}
    return _ALONE[key]


def _fails(reqs) -> None:
    for r in reqs:
        if r.origin_input_ids[:3] == MARK and len(r.output_ids) >= r.origin_input_ids[3]:
            raise RuntimeError("injected failure")


def _inject(monkeypatch, sched, where: str) -> None:
    if where == "sample":
        for module, name in ((output_module, "sample"), (scheduler_module, "sample_async")):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda logits, reqs, *rest, _real=real: _fails(reqs)
                                or _real(logits, reqs, *rest))
    else:
        real_append = sched.append_token
        monkeypatch.setattr(sched, "append_token", lambda req, *rest: _fails([req]) or real_append(req, *rest))


def _schedules(eng, alone: dict, seeds: range, params: list, fail_by: int, arrive_by: int) -> None:
    """Run one random schedule per seed on `eng` and check it against `alone` {(prompt, params): output ids}."""
    sched = eng.scheduler
    for seed in seeds:
        rng = random.Random(seed)
        reqs = [(("good", i, j), PROMPTS[i], params[j]) for i, j in enumerate(rng.choices((0, 1), k=4))]
        reqs += [(("bad", k, 0), MARK + [rng.randint(1, fail_by)] + random_ids(rng.randint(2, 30), k), params[0])
                 for k in range(3)]
        reqs.append((("abort", 0, 0), random_ids(12, 99), {**params[0], "max_new_tokens": 40}))
        rng.shuffle(reqs)
        arrivals = sorted(rng.randint(0, arrive_by) for _ in reqs)
        abort_at = rng.randint(1, 12)
        made = [(key, Req(rid=f"s{seed}-{n}", origin_input_ids=list(ids), sampling_params=SamplingParams.from_dict(p)))
                for n, (key, ids, p) in enumerate(reqs)]
        step = 0
        while step <= max(arrivals) or sched.has_work():
            for (key, req), at in zip(made, arrivals):
                if at == step:
                    sched.add_request(req)
                if key[0] == "abort" and step == abort_at:
                    sched.abort_request(req.rid)
            sched.step()
            step += 1
            assert step < 2000
        eng.model_runner.token_allocator.check_all_free()
        for (kind, i, j), req in made:
            if kind == "good":
                assert req.output_ids == alone[(i, j)], (seed, i, j)
            elif kind == "bad":
                assert req.finished_reason.status_code == 500, (seed, req.finished_reason)


@pytest.mark.parametrize("where", ["sample", "append_token"])
def test_random_schedules_match_the_requests_alone(monkeypatch, where):
    eng, alone = isolation_engine(False), _alone(PARAMS)  # alone: before any failure is injected
    _inject(monkeypatch, eng.scheduler, where)
    _schedules(eng, alone, range(6), PARAMS, fail_by=3, arrive_by=4)


@pytest.mark.parametrize("where", ["sample", "append_token"])
def test_random_schedules_under_retraction_match_the_requests_alone(monkeypatch, where):
    """A 192-token pool with admission counting 8 of a request's max_new_tokens (test_retraction.py's pressure):
    longer requests (40-60 tokens) outgrow it, so running ones are retracted and resumed between failures that come
    up to their 30th token."""
    params = LONG_PARAMS
    alone = _alone(params)
    with envs.SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.override(8):  # read when the scheduler is built
        eng = engine("tiny", chunked_prefill_size=32, max_total_tokens=192)
    _inject(monkeypatch, eng.scheduler, where)
    _schedules(eng, alone, range(3), params, fail_by=30, arrive_by=20)
    assert eng.scheduler.num_retractions > 0
