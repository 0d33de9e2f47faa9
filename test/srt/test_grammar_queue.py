"""Grammars compile off the scheduler loop (constrained/grammar_queue.py) on the built-in tiny model (the real
vocabulary): a 1 MB JSON schema compiles while a greedy request decodes to its end, counted in scheduler steps; the
compile cache is an LRU bounded in bytes; a compile past SGLANG_GRAMMAR_TIMEOUT and a grammar that does not compile
end as 400s naming the field; an abort while compiling leaves no queued request, no pool slot and no queued compile;
requests with the same grammar share one compile; under tensor parallelism (and DP attention) every rank admits and
refuses the same requests at the same step even when their compiles end at different times."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
from concurrent import futures

import pytest
import torch

import sglang
from oracle import DEVICE
from sglang.srt.constrained.xgrammar_backend import CompiledGrammarCache, XGrammarBackend
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

MAX_STEPS = 60_000  # bounds every loop below (an idle step waits 10 ms for a compile: about 10 minutes)


@functools.lru_cache(maxsize=None)
def engine():
    return sglang.Engine(model_path="tiny-deepseek-v4", device=DEVICE, dtype="float32", log_level="warning",
                         max_running_requests=8, context_length=512)


def _req(rid: str, ids: list, **params) -> Req:
    return Req(rid=rid, origin_input_ids=ids, sampling_params=SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": 8, **params}))


def _run(sched, until) -> list:
    """Step until `until()`; every request the steps returned."""
    returned = []
    for _ in range(MAX_STEPS):
        if until():
            return returned
        returned += sched.step()
    raise AssertionError("the scheduler did not get there")


@pytest.fixture
def hold(monkeypatch):
    """hold(text) -> (started, release): that grammar's compile waits until release is set; every hold is released
    when the test ends."""
    backend = engine().scheduler._grammar()
    real, held = backend.compile, {}

    def compile_(kind, text):
        if text in held:
            held[text][0].set()
            held[text][1].wait()
        return real(kind, text)

    monkeypatch.setattr(backend, "compile", compile_)

    def add(text):
        held[text] = (threading.Event(), threading.Event())
        return held[text]

    yield add
    for _, release in held.values():
        release.set()


def _queued(sched) -> list:
    return [job.req for job in sched.grammar_queue.jobs]


def test_large_schema_compiles_while_others_decode():
    """A 1 MB schema (45,000 alternatives: seconds of compile) arrives while a greedy request decodes: the greedy
    request gets all its tokens in the steps that run during the compile, and the constrained request is admitted
    only afterwards, its output in the schema's language."""
    sched = engine().scheduler
    schema = json.dumps({"type": "array", "items": {"anyOf": [{"const": f"c{i:07d}"} for i in range(45_000)]}})
    assert len(schema) > 1_000_000
    n = 16
    greedy = _req("greedy", [5, 6, 7], max_new_tokens=n, ignore_eos=True)
    big = _req("big", [8, 9], max_new_tokens=6, json_schema=schema)
    sched.add_request(greedy)
    sched.step()  # prefilled: its first token
    sched.add_request(big)  # returns at once: the compile runs in a worker thread
    assert _queued(sched) == [big] and big not in sched.waiting
    _run(sched, lambda: big in sched.running or big.finished)
    assert greedy.finished and len(greedy.output_ids) == n  # every token came while the schema compiled
    _run(sched, lambda: not sched.has_work())
    assert big.finished_reason.type in ("stop", "length"), big.finished_reason
    matcher = sched.grammar_backend.matcher("json_schema", schema)  # from the cache: no second compile
    assert all(matcher.accept_token(t) for t in big.output_ids)
    assert ("json_schema", schema) in sched.grammar_backend.cache.keys()
    engine().model_runner.token_allocator.check_all_free()


class _Compiled:
    def __init__(self, nbytes: int) -> None:
        self.memory_size_bytes = nbytes


def test_compile_cache_is_lru_bounded_in_bytes():
    cache = CompiledGrammarCache(capacity_bytes=100)
    a, b, c = ("regex", "a"), ("regex", "b"), ("regex", "c")
    cache.put(a, _Compiled(40))  # 41 bytes with its text
    cache.put(b, _Compiled(40))
    assert cache.get(a) is not None  # a is now the most recently used
    cache.put(c, _Compiled(40))  # 123 > 100: the least recently used (b) goes
    assert cache.keys() == [a, c] and cache.get(b) is None and cache.nbytes == 82
    cache.put(("regex", "huge"), _Compiled(500))  # larger than the whole cache: not kept, nothing evicted
    assert cache.keys() == [a, c]
    # the backend compiles a text once and keeps it; SGLANG_GRAMMAR_CACHE_MB sets the bound (0: nothing kept)
    backend = engine().scheduler._grammar()
    assert backend.compile("regex", "[a-c]{2}x") is backend.compile("regex", "[a-c]{2}x")
    assert backend.cache.capacity_bytes == envs.SGLANG_GRAMMAR_CACHE_MB.get() << 20
    with envs.SGLANG_GRAMMAR_CACHE_MB.override(0):
        small = XGrammarBackend(engine().tokenizer, backend.vocab_size, [1])
    assert small.compile("regex", "[a-c]{2}y") is not small.compile("regex", "[a-c]{2}y") and not small.cache.keys()
    for var, bad in ((envs.SGLANG_GRAMMAR_CACHE_MB, "-1"), (envs.SGLANG_GRAMMAR_TIMEOUT, "0")):
        with var.override(bad), pytest.raises(ValueError, match=var.name):
            var.get()


def test_compile_timeout_is_a_400_naming_the_field(hold, monkeypatch):
    """A compile still running at its deadline: the request ends with a 400 naming the field (the in-process engine
    raises it as refused at admission); the compile, never interrupted, cannot stall anything."""
    sched = engine().scheduler
    monkeypatch.setattr(sched.grammar_queue, "timeout_s", 0.05)
    hold("(slow){2}[0-9]")
    req = _req("slow", [1, 2, 3], regex="(slow){2}[0-9]")
    sched.add_request(req)
    returned = _run(sched, lambda: req.finished)
    reason = req.finished_reason
    assert returned == [req] and (reason.type, reason.status_code, reason.param) == ("abort", 400, "regex")
    assert "regex did not compile within 0.05 s (SGLANG_GRAMMAR_TIMEOUT)" in reason.message
    hold("(slower){2}[0-9]")
    with pytest.raises(ValueError, match="regex did not compile within") as err:
        engine().generate(input_ids=[4, 5], sampling_params={"regex": "(slower){2}[0-9]", "max_new_tokens": 4})
    assert err.value.param == "regex"
    assert not sched.has_work()
    engine().model_runner.token_allocator.check_all_free()


def test_compile_failure_is_a_400_naming_the_field():
    sched = engine().scheduler
    bad = _req("bad", [1, 2, 3], json_schema='{"type": 5}')
    ok = _req("ok", [4, 5], ignore_eos=True)
    sched.add_request(bad)  # queued: the compile says what is wrong
    sched.add_request(ok)
    returned = _run(sched, lambda: not sched.has_work())
    reason = bad.finished_reason
    assert bad in returned and (reason.type, reason.status_code, reason.param) == ("abort", 400, "json_schema")
    assert reason.message.startswith("json_schema does not compile") and reason.to_json()["param"] == "json_schema"
    assert len(ok.output_ids) == 8 and not bad.output_ids
    engine().model_runner.token_allocator.check_all_free()


def test_abort_while_compiling_frees_the_request_and_its_compile(hold):
    """Two compiles hold both worker threads, a third waits for a thread: aborting the third cancels its compile,
    aborting the first two leaves nothing queued; their compiles, once started, end and fill the cache (nothing else
    keeps them), and the threads serve the next request."""
    sched = engine().scheduler
    grammars = [f"held{i}[0-9]" for i in range(3)]
    holds = [hold(g) for g in grammars[:2]]
    reqs = [_req(f"abort{i}", [1, 2, 3 + i], regex=g) for i, g in enumerate(grammars)]
    for req in reqs:
        sched.add_request(req)
    assert all(started.wait(60) for started, _ in holds)  # both threads are busy with the first two
    compiles = [job.future for job in sched.grammar_queue.jobs]
    assert not compiles[2].running()
    assert sched.abort_request("abort2") is reqs[2] and compiles[2].cancelled()
    for req in reqs[:2]:
        assert sched.abort_request(req.rid) is req and req.finished_reason.type == "abort"
    assert not sched.grammar_queue.jobs and not sched.has_work() and not sched.waiting
    for _, release in holds:
        release.set()
    futures.wait(compiles[:2])
    assert all(f.exception() is None for f in compiles[:2]) and not sched.grammar_queue._compiling
    assert {("regex", g) for g in grammars[:2]} <= set(sched._grammar().cache.keys())
    after = _req("after", [4, 5], regex=grammars[2])
    sched.add_request(after)
    _run(sched, lambda: not sched.has_work())
    assert after.finished_reason.type in ("stop", "length") and after.output_ids
    engine().model_runner.token_allocator.check_all_free()


def test_same_grammar_shares_one_compile(hold):
    """Requests with one grammar share its compile; aborting one of them leaves it to the others (not cancelled
    while queued behind two held compiles)."""
    sched = engine().scheduler
    holds = [hold(f"busy{i}[0-9]") for i in range(2)]
    busy = [_req(f"busy{i}", [1, 2 + i], regex=f"busy{i}[0-9]") for i in range(2)]
    reqs = [_req(f"shared{i}", [7, 8 + i], regex="(shared|one)[0-9]") for i in range(3)]
    for req in busy + reqs:
        sched.add_request(req)
    assert all(started.wait(60) for started, _ in holds)
    shared = {id(job.future) for job in sched.grammar_queue.jobs[2:]}
    assert len(shared) == 1
    assert sched.abort_request("shared0") is reqs[0]
    assert not any(job.future.cancelled() for job in sched.grammar_queue.jobs)  # the others still wait for it
    for _, release in holds:
        release.set()
    _run(sched, lambda: not sched.has_work())
    assert all(r.finished_reason.type in ("stop", "length") and r.output_ids for r in busy + reqs[1:])
    engine().model_runner.token_allocator.check_all_free()


_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_grammar_worker.py")


@pytest.mark.parametrize("parallel", [{"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}], ids=["tp4-dp2"])
def test_ranks_decide_grammars_alike(parallel):
    """Rank 1 compiles a grammar a second after its group's first rank, and the first rank's compile of another
    outlives its deadline while rank 1's ends at once: every rank of a group still starts, refuses and decodes each
    request at the same step (the first rank decides, and broadcasts).

    One run covers plain tensor parallelism too: the decision is broadcast over the attention TP group
    (Scheduler._poll_grammars), which under --tp 2 is the whole TP group and here is each DP group's two ranks, so
    each group here is a --tp 2 engine's pair (a leader, a follower whose compile ends later), twice, beside the DP
    rounds that keep the groups stepping together."""
    world = parallel["tp_size"]
    if DEVICE != "cpu" and torch.cuda.device_count() < world:  # NCCL refuses two ranks on one device
        pytest.skip(f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} here")
    kwargs = dict(model_path="tiny-deepseek-v4", device=DEVICE, dtype="float32", log_level="warning",
                  max_running_requests=4, context_length=256, disable_cuda_graph=True, **parallel)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = f"{tmp}/spec.json"
        with open(spec_path, "w") as f:
            json.dump({"init_method": f"file://{tmp}/rendezvous", "engine": kwargs, "out": f"{tmp}/out"}, f)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        procs = [subprocess.Popen([sys.executable, _WORKER, spec_path, str(r)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(world)]
        try:
            logs = [p.communicate(timeout=600)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        for r, (p, log) in enumerate(zip(procs, logs)):
            assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
        outs = [json.load(open(f"{tmp}/out.{r}")) for r in range(world)]
    group = world // parallel.get("dp_size", 1)
    for r, out in enumerate(outs):
        assert out == outs[r - r % group], f"rank {r} decided otherwise than its group's first rank"
        assert out["plain"]["finish"]["type"] == "length" and out["regex"]["finish"]["type"] == "stop"
        assert out["bad"]["finish"]["status_code"] == 400 and "does not compile" in out["bad"]["finish"]["message"]
        assert "SGLANG_GRAMMAR_TIMEOUT" in out["slow"]["finish"]["message"] and out["slow"]["started"] is None
        assert out["regex"]["started"] is not None
