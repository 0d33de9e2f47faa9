"""Admission by estimate and retraction under pressure (managers/schedule_policy.py, Scheduler._retract).

An oversubscribed workload (the pool holds a fraction of what the requests really generate; lengths short and long;
greedy and seeded sampling; stop tokens) finishes every request with the output of an un-pressured run, with
retractions, in bounded steps, and leaves every pool free; the same with speculative decoding. Requests with
max_new_tokens up to the context (a chat request without max_tokens) all run at once on a pool that holds their real
answers. The policy's arithmetic is checked on its own.
"""

from __future__ import annotations

import functools

import pytest

from oracle import engine, random_ids
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import NewTokenRatio, expected_tokens, retraction_order
from sglang.srt.sampling.sampling_params import SamplingParams

NUM_REQS = 12


def _params(i: int, stop_token: int = -1) -> dict:
    """Two in three sampled (seeded), the rest greedy; long (96) and short (24) lengths; stop tokens on some."""
    p = {"max_new_tokens": 96 if i % 2 == 0 else 24, "ignore_eos": True}
    p.update({"temperature": 0.8, "top_p": 0.95, "seed": 50 + i} if i % 3 != 0 else {"temperature": 0})
    if stop_token >= 0:
        p["stop_token_ids"] = [stop_token]
    return p


def _prompts() -> list:
    return [random_ids(5 + (11 * i) % 37, seed=300 + i) for i in range(NUM_REQS)]  # 5..41 tokens


def _drive(eng, stops: dict, max_steps: int = 4000) -> dict:
    """Run the workload; returns {rid: (output ids, output logprobs, finish type, prompt logprobs)} and checks the
    pools end free. `eng.retracted` lists (rid, generated tokens, temperature) of every retraction."""
    sched = eng.scheduler
    eng.retracted, retract = [], sched._retract

    def spy(req):
        eng.retracted.append((req.rid, len(req.output_ids), req.sampling_params.temperature))
        retract(req)

    sched._retract = spy
    reqs = [Req(rid=f"r{i}", origin_input_ids=p, sampling_params=SamplingParams.from_dict(_params(i, stops.get(i, -1))),
                return_logprob=True, logprob_start_len=0) for i, p in enumerate(_prompts())]
    for req in reqs:
        sched.add_request(req)
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < max_steps, "no progress: livelock or deadlock"
    eng.model_runner.token_allocator.check_all_free()
    return {r.rid: (list(r.output_ids), list(r.output_token_logprobs), r.finished_reason.type,
                    [lp for _, lp in r.input_token_logprobs]) for r in reqs}


@functools.lru_cache(maxsize=None)
def _reference_engine():
    """The un-pressured engine: its pool holds every request at once."""
    return engine("tiny", chunked_prefill_size=32)


@functools.lru_cache(maxsize=None)
def _stops() -> dict:
    """Stop tokens for a few long requests, taken from an un-pressured run: they end early, at different steps."""
    out = _drive(_reference_engine(), {})
    stops = {}
    for i in (0, 4, 6):  # long
        ids = out[f"r{i}"][0]
        j = next(j for j in range(30 + 3 * i, len(ids)) if ids[j] not in ids[:j])  # first occurrence: stops there
        stops[i] = ids[j]
    return stops


@functools.lru_cache(maxsize=None)
def _unpressured() -> dict:
    """The workload with its stops on an un-pressured pool, the reference of both schedules (the overlapped and the
    synchronous one give the same outputs: a pressured run differing from it fails either way)."""
    return _drive(_reference_engine(), _stops())


def _assert_retracted_mid_decode(eng) -> None:
    """Retractions happened, greedy and seeded requests among them, after they had generated tokens (so the resumed
    prefill, the kept generator state and, when speculating, the kept draft are all exercised)."""
    assert eng.scheduler.num_retractions == len(eng.retracted) > 0
    assert any(n > 0 and t > 0 for _, n, t in eng.retracted), eng.retracted
    assert any(n > 0 and t == 0 for _, n, t in eng.retracted), eng.retracted


def _assert_same(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for rid in ref:
        assert got[rid][0] == ref[rid][0], rid
        assert got[rid][2] == ref[rid][2], rid
        for a, b in ((got[rid][1], ref[rid][1]), (got[rid][3], ref[rid][3])):  # output and prompt logprobs
            assert len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b)), default=0) <= 1e-4, rid


def _pressured(**kwargs):
    """A 192-token pool (12 pages of 16), with admission counting at most 8 of a request's max_new_tokens: scaled to
    the tiny pool as upstream's 4096 is to a real one, so running requests outgrow their estimates as real ones do."""
    with envs.SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.override(8):  # read when the scheduler is built
        return engine("tiny", **{"chunked_prefill_size": 32, "max_total_tokens": 192, **kwargs})


@pytest.mark.parametrize("overlap", [True, False])
def test_oversubscribed_workload_equals_unpressured(overlap):
    """12 requests needing about 900 positions at their real lengths on a 192-token pool."""
    stops, ref = _stops(), _unpressured()
    assert {ref[f"r{i}"][2] for i in stops} == {"stop"} and len(ref["r0"][0]) < 80
    eng = _pressured(disable_overlap_schedule=not overlap)
    got = _drive(eng, stops)
    _assert_retracted_mid_decode(eng)
    ratio = eng.scheduler.new_token_ratio
    assert ratio.value > ratio.floor  # raised by the retractions
    _assert_same(got, ref)
    eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})  # arrives at an idle scheduler
    assert ratio.value == pytest.approx(ratio.init)  # started afresh (its one step is a prefill: no decay)


def test_oversubscribed_speculative_equals_unpressured():
    kwargs = dict(chunked_prefill_size=32, speculative_algorithm="EAGLE", speculative_num_steps=2)
    stops = _stops()
    ref = _drive(engine("tiny", **kwargs), stops)
    eng = _pressured(**kwargs)
    got = _drive(eng, stops)
    _assert_retracted_mid_decode(eng)
    _assert_same(got, ref)


def test_requests_without_max_tokens_run_together():
    """8 requests whose max_new_tokens reach the context length (what a chat request without max_tokens gets) on a
    pool of 512 tokens: the estimate admits all 8 at once (the worst-case reservation admitted one at a time, each
    needing the whole pool). The clip is scaled to the tiny pool as upstream's 4096 is to a real one."""
    with envs.SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.override(24):  # read when the scheduler is built
        eng = engine("tiny", chunked_prefill_size=64, max_total_tokens=512)
    sched, context = eng.scheduler, eng.server_args.context_length
    assert sched.clip_max_new_tokens == 24
    reqs = [Req(rid=f"c{i}", origin_input_ids=random_ids(20, seed=700 + i),
                sampling_params=SamplingParams.from_dict({"temperature": 0, "max_new_tokens": context - 20,
                                                          "ignore_eos": True})) for i in range(8)]
    for req in reqs:
        sched.add_request(req)
    assert reqs[0].sampling_params.max_new_tokens == 512 - 20  # clipped to the pool, not refused
    most = 0
    while min(len(r.output_ids) for r in reqs) < 8:  # "short answers": 8 tokens each
        sched.step()
        most = max(most, len(sched.running))
    assert most == 8 and sched.num_retractions == 0
    for req in reqs:
        sched.abort_request(req.rid)
    while sched.has_work():
        sched.step()
    eng.model_runner.token_allocator.check_all_free()


def test_abort_of_a_retracted_request_frees_everything():
    """A retracted request waits in the queue holding nothing; aborting it there leaves every pool free. (6 requests
    of 30 + 64 tokens on a 256-token pool: it runs out mid-decode.)"""
    eng = engine("tiny", chunked_prefill_size=32, max_total_tokens=256)
    sched = eng.scheduler
    reqs = [Req(rid=f"a{i}", origin_input_ids=random_ids(30, seed=800 + i),
                sampling_params=SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 64,
                                                          "ignore_eos": True})) for i in range(6)]
    for req in reqs:
        sched.add_request(req)
    while not any(r.num_retractions for r in reqs):
        sched.step()
    victim = next(r for r in reqs if r.num_retractions and r in sched.waiting)
    assert victim.alloc is None and victim.output_ids
    sched.abort_request(victim.rid)
    assert victim.finished_reason.type == "abort"
    while sched.has_work():
        sched.step()
    eng.model_runner.token_allocator.check_all_free()
    assert all(len(r.output_ids) == 64 for r in reqs if r is not victim)


# ---- the policy on its own ----------------------------------------------------------------------------------------
def _req(prompt: int, generated: int, max_new: int) -> Req:
    req = Req(rid="x", origin_input_ids=[1] * prompt, sampling_params=SamplingParams(max_new_tokens=max_new))
    req.output_ids = [2] * generated
    return req


def test_new_token_ratio_decays_to_its_floor_and_rises_after_retraction():
    ratio = NewTokenRatio.from_conservativeness(1.0)
    assert ratio.value == pytest.approx(0.7) and ratio.floor == pytest.approx(0.098)
    for _ in range(300):
        ratio.step()
    assert ratio.value == pytest.approx(0.7 - 300 * (0.7 - 0.098) / 600)
    for _ in range(400):
        ratio.step()
    assert ratio.value == pytest.approx(0.098)
    running = [_req(10, 30, 100), _req(10, 10, 100)]  # (40 decoded + 20 x 2) / 200 = 0.4
    ratio.raise_after_retraction(running, clip=4096)
    assert ratio.value == pytest.approx(0.4)
    ratio.raise_after_retraction(running, clip=40)  # (40 + 40) / 80, capped at 1
    assert ratio.value == 1.0
    ratio.reset()
    assert ratio.value == pytest.approx(0.7)
    assert NewTokenRatio.from_conservativeness(2.0).value == 1.0  # capped


def test_expected_tokens_and_retraction_order():
    req = _req(10, 5, 1000)
    assert expected_tokens(req, 0.5, 4096, 0) == 10 + 5 + 498  # ceil(0.5 x 995)
    assert expected_tokens(req, 0.5, 100, 3) == 10 + 5 + 50 + 3  # the clip bounds the remaining tokens
    a, b, c = _req(50, 3, 100), _req(10, 0, 100), _req(90, 0, 100)
    assert retraction_order([a, b, c]) == [c, b, a]  # fewest generated first, then the longest context


def test_schedule_conservativeness_flag():
    with pytest.raises(ValueError, match="schedule-conservativeness"):
        engine("tiny", schedule_conservativeness=0)
    eng = engine("tiny", schedule_conservativeness=0.5)
    assert eng.scheduler.new_token_ratio.value == pytest.approx(0.35)
