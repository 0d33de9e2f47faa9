"""Overlap scheduling: step N+1 is launched (its input tokens still on the device) before step N's tokens are read,
and outputs are those of --disable-overlap-schedule token for token: requests finishing at different steps,
requests admitted while others decode, an abort while a step is in flight, seeded sampling, penalties (those batches
run synchronously) and max_new_tokens 1. Failures in flight are covered by test_step_isolation.py (overlap is on
there by default)."""

from __future__ import annotations

import pytest

from oracle import engine, random_ids
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams


def _req(i: int, n: int, prompt: int, **params) -> Req:
    """Greedy unless `params` say otherwise (sampling is seeded: unseeded draws depend on the order of the steps)."""
    return Req(rid=f"r{i}", origin_input_ids=random_ids(prompt, seed=100 + i),
               sampling_params=SamplingParams.from_dict({"max_new_tokens": n, "ignore_eos": True, "temperature": 0,
                                                         **params}),
               return_logprob=True)


def _drive(eng, arrivals: dict, abort: dict) -> dict:
    """Step the scheduler; `arrivals` {step: [Req]} are added before that step, `abort` {step: rid} aborted before
    it. Returns {rid: (output_ids, output logprobs, finish type)}."""
    sched, reqs, step = eng.scheduler, [], 0
    while step <= max(arrivals) or sched.has_work():
        for req in arrivals.get(step, []):
            sched.add_request(req)
            reqs.append(req)
        if step in abort:
            sched.abort_request(abort[step])
        sched.step()
        step += 1
        assert step < 2000
    eng.model_runner.token_allocator.check_all_free()
    return {r.rid: (list(r.output_ids), list(r.output_token_logprobs), r.finished_reason.type) for r in reqs}


def _workload():
    return {0: [_req(0, 30, 20), _req(1, 5, 33, temperature=0.8, seed=3), _req(2, 1, 9),
                _req(3, 17, 12, temperature=0.7, top_p=0.9, seed=4)],
            6: [_req(4, 12, 40)],  # admitted while the others decode: a prefill step in between
            9: [_req(5, 8, 15, frequency_penalty=0.5, seed=6, temperature=0.5)],  # penalties: synchronous batches
            11: [_req(6, 10, 18, logit_bias={str(t): 2.0 for t in range(0, 512, 3)})]}  # bias alone: overlapped


@pytest.mark.parametrize("abort", [{}, {12: "r0"}])
def test_overlap_outputs_equal_synchronous(abort):
    ref = _drive(engine("tiny", disable_overlap_schedule=True), _workload(), abort)
    got = _drive(engine("tiny"), _workload(), abort)
    assert got.keys() == ref.keys()
    for rid in ref:
        if rid in abort.values():  # aborted at a step count: overlap commits later (a step in flight, and a
            a, b = got[rid][0], ref[rid][0]  # launch-only step after each change of batch), so it has fewer tokens
            assert got[rid][2] == "abort" and len(a) < 30 and a == b[:len(a)], (a, b)
            continue
        assert got[rid][0] == ref[rid][0], rid
        assert got[rid][2] == ref[rid][2], rid
        assert max((abs(a - b) for a, b in zip(got[rid][1], ref[rid][1])), default=0) <= 1e-5, rid


def test_next_step_launches_before_the_previous_is_read(monkeypatch):
    from sglang.srt.utils.device_readback import ReadBack

    eng = engine("tiny")
    assert eng.scheduler.overlap
    events = []
    runner = eng.model_runner
    real_forward, real_wait = runner.forward_decode, ReadBack.wait
    monkeypatch.setattr(runner, "forward_decode",
                        lambda ids, slots, input_ids_device=None: events.append(
                            "host" if input_ids_device is None else "device")
                        or real_forward(ids, slots, input_ids_device))
    monkeypatch.setattr(ReadBack, "wait", lambda self: events.append("read") or real_wait(self))
    out = eng.generate(input_ids=[random_ids(10, seed=1), random_ids(14, seed=2)],
                       sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert [len(o["output_ids"]) for o in out] == [6, 6]
    decode = events[events.index("host"):]  # after the prefill's synchronous read
    # the first decode step is launched from host tokens, each next one from the device before the previous read
    assert decode[:4] == ["host", "device", "read", "device"], events
    eng.model_runner.token_allocator.check_all_free()


def test_overlap_off_reads_every_step_before_the_next():
    eng = engine("tiny", disable_overlap_schedule=True)
    assert not eng.scheduler.overlap
    out = eng.generate(input_ids=random_ids(10, seed=1), sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert len(out["output_ids"]) == 4 and eng.scheduler.in_flight is None


def test_penalised_requests_run_synchronously():
    eng = engine("tiny")
    sched = eng.scheduler
    sched.add_request(_req(0, 6, 10, repetition_penalty=1.3))
    while sched.has_work():
        sched.step()
        assert sched.in_flight is None
    eng.model_runner.token_allocator.check_all_free()
