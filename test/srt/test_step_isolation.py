"""One request must never take down others: sampling parameters are refused at admission when they could fail a
step, and a step that fails anyway (a fault injected for one marked request, in the sampler, the model, the
result processing, or the speculative draft) aborts only that request with a 500; the requests batched with it
finish with the outputs they have without it, and every pool slot is free afterwards. Consecutive failed steps
make the scheduler unhealthy until a step serves again (test/server/test_health_state.py: what /health answers).
The engine tests here run on a GPU too (scripts/gpu_validate.sh)."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest

import sglang.srt.managers.scheduler as scheduler_module
import sglang.srt.managers.scheduler_output_processor_mixin as output_module
from oracle import DEVICE, engine, random_ids
from sglang.srt.managers.io_struct import UNHEALTHY_AFTER_FAILED_STEPS
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_process import SchedulerProcess
from sglang.srt.sampling.sampling_params import SamplingParams

CULPRIT = random_ids(30, 99)
GOOD = [random_ids(40, 1), random_ids(9, 2), random_ids(25, 3)]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SEEDED = {"temperature": 1.0, "top_k": 20, "seed": 5, "max_new_tokens": 8, "ignore_eos": True}
GOOD_PARAMS = [GREEDY, SEEDED, GREEDY]
FAIL_AFTER = 2  # the culprit fails once it has this many output tokens (mid-generation, slots held)


# ---- admission -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", 10**400), ("temperature", True),
    ("top_p", math.nan), ("min_p", math.nan), ("frequency_penalty", -math.inf), ("presence_penalty", math.nan),
    ("repetition_penalty", math.inf), ("top_k", True), ("max_new_tokens", False), ("ignore_eos", "yes"),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", True), ("seed", 1.5),
])
def test_bad_sampling_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"'{field}'") as error:
        SamplingParams.from_dict({field: value})
    assert error.value.param == field


def test_tiny_temperatures_are_greedy_and_64_bit_seeds_accepted():
    for t in (1e-40, 5e-324, 9.9e-7):
        params = SamplingParams.from_dict({"temperature": t})
        assert params.temperature == 0 and params.is_greedy
    assert SamplingParams(temperature=1e-40).is_greedy  # also when built without verify()
    assert not SamplingParams.from_dict({"temperature": 1e-6}).is_greedy
    for seed in (2**64 - 1, -(2**63), 0):
        assert SamplingParams.from_dict({"seed": seed}).seed == seed


# ---- isolation in the scheduler ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def isolation_engine(speculative: bool):
    spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=2) if speculative else {}
    return engine("tiny", chunked_prefill_size=32, **spec)


@functools.lru_cache(maxsize=None)
def reference(speculative: bool) -> tuple:
    outs = isolation_engine(speculative).generate(input_ids=GOOD, sampling_params=GOOD_PARAMS)
    return tuple(tuple(o["output_ids"]) for o in outs)


def culprit_in(reqs) -> bool:
    return any(r.origin_input_ids == CULPRIT and len(r.output_ids) >= FAIL_AFTER for r in reqs)


def inject(monkeypatch, eng, where: str) -> None:
    """Make every step that holds the culprit (past FAIL_AFTER tokens) raise at `where`."""
    sched, runner = eng.scheduler, eng.model_runner

    def holds_culprit(req_pool_indices) -> bool:
        return culprit_in(r for r in sched.running if r.alloc and r.alloc.req_pool_idx in req_pool_indices)

    def in_forward(forward_batch) -> bool:
        return holds_culprit(forward_batch.req_pool_indices_cpu)

    def failing(real, is_culprit):
        def wrapper(*args, **kwargs):
            if is_culprit(*args):  # before the call: nothing of it ran
                raise RuntimeError(f"injected failure in {where}")
            return real(*args, **kwargs)
        return wrapper

    def failing_after(real, is_culprit):
        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)  # the pools were written: the step must be undone
            if is_culprit(*args):
                raise RuntimeError(f"injected failure after {where}")
            return out
        return wrapper

    if where == "sample":
        for module, name in ((output_module, "sample"), (scheduler_module, "sample_async")):  # async: overlap
            monkeypatch.setattr(module, name, failing(getattr(module, name), lambda _, reqs, *rest: culprit_in(reqs)))
    elif where == "forward":
        monkeypatch.setattr(runner, "forward", failing_after(runner.forward, in_forward))
        # decode steps run through the static buffers (replayed CUDA graphs on a GPU)
        monkeypatch.setattr(runner, "forward_decode", failing_after(
            runner.forward_decode, lambda ids, slots, *_: holds_culprit(slots[0].tolist())))
    elif where == "forward_draft":
        monkeypatch.setattr(runner, "forward_draft",
                            failing_after(runner.forward_draft, lambda forward_batch, *_: in_forward(forward_batch)))
    elif where == "append_token":  # after the requests before it in the batch got their token
        monkeypatch.setattr(sched, "append_token", failing(sched.append_token, lambda req, *_: culprit_in([req])))
    else:
        raise AssertionError(where)
    if where.startswith("forward") and runner.graph_runner is not None and runner.graph_runner.rows_per_req > 1:
        # a greedy speculative cycle (drafts, verify, draft-extend) runs as one replay of the static buffers
        cycles = runner.graph_runner
        monkeypatch.setattr(cycles, "forward", failing_after(cycles.forward,
                                                             lambda slots, *_: holds_culprit(slots[0].tolist())))


@pytest.mark.parametrize("speculative, where", [
    (False, "sample"), (False, "forward"), (False, "append_token"),
    (True, "forward"), (True, "forward_draft"), (True, "append_token"),
])
def test_a_failing_request_fails_alone(monkeypatch, speculative, where):
    eng = isolation_engine(speculative)
    expected = reference(speculative)
    inject(monkeypatch, eng, where)
    outs = eng.generate(input_ids=[GOOD[0], CULPRIT, *GOOD[1:]],
                        sampling_params=[GOOD_PARAMS[0], GREEDY, *GOOD_PARAMS[1:]])
    culprit = outs.pop(1)
    assert tuple(tuple(o["output_ids"]) for o in outs) == expected
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    reason = culprit["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and "internal error" in reason["message"]
    assert culprit["output_ids"]  # it failed mid-generation and keeps the tokens of the steps that succeeded
    eng.model_runner.token_allocator.check_all_free()
    sched = eng.scheduler
    assert not sched.running and not sched.waiting and sched.consecutive_failed_steps == 0
    assert sched.num_generated_tokens >= sum(len(o) for o in expected)


def test_consecutive_failed_steps_flip_health_and_recover(monkeypatch):
    eng = isolation_engine(False)
    proc = SimpleNamespace(scheduler=eng.scheduler, dp_rank=0, kv=None)  # SchedulerProcess._stats: what outputs carry
    assert SchedulerProcess._stats(proc).healthy

    def broken(*args):
        raise RuntimeError("the device is gone")

    with monkeypatch.context() as patch:
        patch.setattr(output_module, "sample", broken)
        for i in range(UNHEALTHY_AFTER_FAILED_STEPS):
            assert SchedulerProcess._stats(proc).healthy
            out = eng.generate(input_ids=GOOD[1], sampling_params=GREEDY)  # one step, which fails
            assert out["meta_info"]["finish_reason"]["status_code"] == 500
            assert SchedulerProcess._stats(proc).consecutive_failed_steps == i + 1
        stats = SchedulerProcess._stats(proc)
        assert not stats.healthy and stats.pools_all_free
    out = eng.generate(input_ids=GOOD[1], sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert SchedulerProcess._stats(proc).healthy and eng.scheduler.consecutive_failed_steps == 0


# ---- undone exactly: the compressor staging rings ---------------------------------------------------------------
# A forward reads the staging rows of the positions its completed windows span and writes its last positions' rows.
# A prefill chunk wraps onto rows its own rerun reads (the pool copies them first); a decode step and the one launched
# behind it under overlap scheduling fit the ring's slack of one row (a chained step is rebased once the step before
# it commits, so undoing it never reruns three positions).
def test_staging_rows_at_risk():
    from sglang.srt.mem_cache.deepseek_v4_pool import CompressorState, PoolShape, ring_size

    shape = PoolShape(page_size=16, num_pages=4, num_swa_slots=8, max_num_reqs=2)
    csa, hca = CompressorState(4, True, 2, shape, "cpu"), CompressorState(8, False, 2, shape, "cpu")
    assert (csa.ring, hca.ring) == (ring_size(4, True), ring_size(8, False)) == (9, 9)
    # a chunk [25, 40) reads rows of 20..24 (CSA's windows from 24 and the one before) or 24 (HCA's windows from 24)
    # and keeps 31..39, a whole ring; a chunk [25, 31) keeps 25..30, on the rows of 16..21
    assert csa.rows_at_risk([(1, 25, 40)]) == [9 + p % 9 for p in range(20, 25)]
    assert hca.rows_at_risk([(2, 25, 40)]) == [18 + p % 9 for p in range(24, 25)]
    assert csa.rows_at_risk([(1, 25, 31)]) == [9 + p % 9 for p in range(20, 22)]
    assert csa.rows_at_risk([(1, 0, 40), (2, 24, 29)]) == []  # nothing before 0; a chunk within the slack
    for state in (csa, hca):
        assert not any(state.rows_at_risk([(1, s, s + 2)]) for s in range(64))  # a decode step and the one behind
        assert any(state.rows_at_risk([(1, s, s + 3)]) for s in range(64))  # why a chained step is rebased


def drive(eng, arrivals: dict) -> dict:
    """Step the scheduler, adding `arrivals` {step: [(name, ids)]} (greedy, 8 tokens) before that step; returns
    {name: (output_ids, their logprobs)}."""
    sched, reqs, step = eng.scheduler, {}, 0
    while step <= max(arrivals) or sched.has_work():
        for name, ids in arrivals.get(step, []):
            reqs[name] = Req(rid=name, origin_input_ids=ids, sampling_params=SamplingParams.from_dict(GREEDY),
                             return_logprob=True)
            sched.add_request(reqs[name])
        sched.step()
        step += 1
        assert step < 500
    eng.model_runner.token_allocator.check_all_free()
    return {name: (list(r.output_ids), list(r.output_token_logprobs)) for name, r in reqs.items()}


def alone(eng, ids: list) -> tuple:
    out = eng.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def assert_same(got: tuple, expected: tuple) -> None:
    """Same tokens, logprobs within batch-shape rounding (a wrong staging row moved them by 5e-2 in these scenarios,
    without flipping a greedy token; on a GPU the kernels round differently per batch shape)."""
    assert got[0] == expected[0]
    assert max(abs(a - b) for a, b in zip(got[1], expected[1])) < (1e-4 if DEVICE == "cpu" else 2e-3)


def test_a_failed_prefill_chunk_is_undone_exactly(monkeypatch):
    """A request failing at its second token, batched with another's second prefill chunk [25, 40): that chunk
    overwrites staging rows it reads, and runs again after the bisection."""
    eng = engine("tiny", chunked_prefill_size=32, disable_radix_cache=True)
    long_prompt = random_ids(40, 7)
    expected = alone(eng, long_prompt)
    culprit = random_ids(7, 98)
    checkpoints = []
    pool = eng.model_runner.token_to_kv_pool
    real_checkpoint = pool.checkpoint_staging
    monkeypatch.setattr(pool, "checkpoint_staging", lambda spans: checkpoints.append(real_checkpoint(spans))
                        or checkpoints[-1])
    for module, name in ((output_module, "sample"), (scheduler_module, "sample_async")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda logits, reqs, *rest, _real=real: _raise_for(reqs, culprit, 1)
                            or _real(logits, reqs, *rest))
    outs = drive(eng, {0: [("culprit", culprit), ("long", long_prompt)]})
    assert_same(outs["long"], expected)
    assert len(outs["culprit"][0]) == 1
    assert any(cp is not None for cp in checkpoints)  # the failed step had rows at risk


def test_a_failed_step_in_flight_is_undone_exactly(monkeypatch):
    """Overlap scheduling: a request failing while its tokens are committed (the step behind it is in flight);
    requests at every position modulo the CSA window run again from their checkpoints."""
    eng = isolation_engine(False)
    prompts = {f"good{n}": random_ids(n, n) for n in range(5, 9)}  # one prefill chunk: 4 positions mod 4
    expected = {name: alone(eng, ids) for name, ids in prompts.items()}
    culprit = random_ids(5, 97)
    failed_in_flight = []
    monkeypatch.setattr(scheduler_module.logger, "warning", lambda msg, *args: failed_in_flight.append(
        msg.startswith("an overlapped decode step failed")))
    sched = eng.scheduler
    real_append = sched.append_token
    monkeypatch.setattr(sched, "append_token", lambda req, *rest: _raise_for([req], culprit, 3)
                        or real_append(req, *rest))
    outs = drive(eng, {0: list(prompts.items()), 1: [("culprit", culprit)]})
    for name in prompts:
        assert_same(outs[name], expected[name])
    assert len(outs["culprit"][0]) == 3
    assert any(failed_in_flight)


def _raise_for(reqs, ids: list, after: int) -> None:
    if any(r.origin_input_ids == ids and len(r.output_ids) >= after for r in reqs):
        raise RuntimeError("injected failure")
