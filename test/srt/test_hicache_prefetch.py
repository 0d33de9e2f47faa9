"""The file tier's reads happen while a request waits, behind the scheduler (mem_cache/file_prefetch.py): with a read
held back, the running request keeps decoding; --hicache-storage-prefetch-policy decides the waiting request's
admission (wait_complete: once the read landed, with the file's prefix; best_effort: at once, without it, or with it
when the read landed while the request waited for a slot; timeout: once its deadline passed, on a test clock,
without it); its outputs equal a cold run's (no cached token) under each policy; a request aborted before or during
its read, or admitted before it, frees every host slot it reserved; a read that raises is a logged miss. The
restart case (a second engine on the directory) is test_hicache.py's test_file_tier_outlives_the_server.

One engine for the module (a file tier on a temporary directory); the reader replaced by one that runs reads only
when the test releases them. About 10 s of wall time on 2 cores, a third of it the engine's start."""

from __future__ import annotations

import json

import pytest

from oracle import engine, random_ids
from sglang.srt.managers.io_struct import SchedulerStats
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.host_tier import HostTierStats
from sglang.srt.metrics.collector import MetricsCollector
from sglang.srt.sampling.sampling_params import SamplingParams

SMALL = dict(max_total_tokens=512, chunked_prefill_size=64, max_running_requests=2)
STORED = random_ids(100, seed=41)  # its first 96 tokens (6 pages and the end there) are on file, not in the tree
PROMPT = STORED[:96] + random_ids(8, seed=42)
LOGPROB_START = 100  # the prompt's last 4 logprobs: a match may still reach 96
CLOCK = [0.0]  # the prefetcher's clock (the timeout policy's deadline)


class HeldReader:
    """Reads queue until `release` runs them, on the caller's thread."""

    def __init__(self) -> None:
        self.jobs = []

    def submit(self, job) -> None:
        self.jobs.append(job)

    def release(self) -> None:
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    extra = json.dumps({"storage_dir": str(tmp_path_factory.mktemp("hicache"))})
    e = engine("tiny", **SMALL, enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_write_policy="write_through",
               hicache_storage_backend="file", hicache_storage_backend_extra_config=extra,
               hicache_storage_prefetch_policy="wait_complete")
    try:
        e.generate(input_ids=STORED, sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
        yield e
    finally:
        e.shutdown()


@pytest.fixture
def files(eng, monkeypatch):
    """The engine's file tier, the tree flushed (STORED's prefix on file only), reads held, on a test clock."""
    assert eng.flush_cache()
    tier = eng.model_runner.token_allocator.host_tier
    tier.files.store.drain()
    CLOCK[0] = 0.0
    monkeypatch.setattr(tier.files.prefetcher, "reader", HeldReader())
    monkeypatch.setattr(tier.files.prefetcher, "clock", lambda: CLOCK[0])
    yield tier.files
    assert not tier.files.prefetcher.busy()
    eng.model_runner.token_allocator.check_all_free()
    assert eng.flush_cache()


def _req(rid: str, ids: list, n: int = 4) -> Req:
    return Req(rid=rid, origin_input_ids=list(ids), return_logprob=True, logprob_start_len=LOGPROB_START,
               sampling_params=SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))


def _run(sched, reqs: list) -> None:
    while not all(r.finished for r in reqs):
        sched.step()


def _cold(eng, monkeypatch, ids: list) -> dict:
    """The prompt on an empty tree with the file tier detached: computed in full."""
    assert eng.flush_cache()
    tier = eng.model_runner.token_allocator.host_tier
    with monkeypatch.context() as m:
        m.setattr(tier, "files", None)
        out = eng.generate(input_ids=ids, return_logprob=True, logprob_start_len=LOGPROB_START,
                           sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
        assert out["meta_info"]["cached_tokens"] == 0
        assert eng.flush_cache()
    return out


def _host_usage(eng) -> tuple:
    alloc = eng.model_runner.token_allocator
    return (alloc.host_tier.pages.available(), alloc.host_tier.ends.available(), alloc.available_pages(),
            alloc.available_req_slots())


@pytest.mark.parametrize("policy", ["wait_complete", "best_effort", "timeout"])
def test_running_requests_decode_while_a_read_is_held(eng, files, policy, monkeypatch):
    """A request decodes; one whose prefix is on file arrives and its read is held back: steps go on and the running
    request's tokens come out. wait_complete keeps the new request waiting until the read is released, then admits
    it on the file's 96 tokens; best_effort admits it at once without them (the read, released later, is dropped);
    timeout keeps it waiting until its deadline passes on the clock, then admits it without them. Its outputs and
    prompt logprobs are a cold run's."""
    monkeypatch.setattr(files, "prefetch_policy", policy)
    sched, reader = eng.scheduler, files.prefetcher.reader
    stats = eng.model_runner.token_allocator.host_tier.stats
    hits, read_bytes = stats.file_hit_tokens, stats.bytes_from_file
    seed = {"wait_complete": 5, "best_effort": 6, "timeout": 7}[policy]  # a prompt on no file: each computed once
    other = _req("running", random_ids(40, seed=seed), n=30)
    sched.add_request(other)
    while len(other.output_ids) < 2:
        sched.step()
    req = _req("on-file", PROMPT)
    sched.add_request(req)
    sched.step()
    assert len(reader.jobs) == 1  # its read is queued, held
    before = len(other.output_ids)
    for _ in range(3):
        sched.step()
    assert len(other.output_ids) >= before + 2  # the running request kept decoding meanwhile
    if policy == "best_effort":
        assert req.alloc is not None and req.cached_tokens == 0 and req.prefetch is None
        assert files.prefetcher.reserved(eng.model_runner.token_allocator.host_tier.pages) == 0  # freed at admission
        reader.release()  # the read runs after the request's admission: dropped, nothing read
    else:
        assert req in sched.waiting and req.alloc is None and req.prefetch is not None
        if policy == "wait_complete":
            reader.release()
        else:
            CLOCK[0] = files.config.prefetch_timeout_base + 1.0
        sched.step()
        assert req.alloc is not None
        assert req.cached_tokens == (96 if policy == "wait_complete" else 0)
        reader.release()
    _run(sched, [req, other])
    if policy == "wait_complete":
        assert stats.file_hit_tokens == hits + 96 and stats.bytes_from_file > read_bytes
        assert stats.file_read_seconds  # the read's latency, for /metrics
    else:
        assert stats.file_hit_tokens == hits and stats.bytes_from_file == read_bytes
    assert not files.prefetcher.busy()
    eng.model_runner.token_allocator.check_all_free()
    cold = _cold(eng, monkeypatch, PROMPT)
    assert req.output_ids == cold["output_ids"]
    got = [lp for _, lp in req.input_token_logprobs]
    want = [lp for lp, _, _ in cold["meta_info"]["input_token_logprobs"] if lp is not None]
    assert len(got) == len(want) == 4 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5


def test_best_effort_admits_with_what_landed(eng, files, monkeypatch):
    """best_effort: a request kept waiting by the scheduler anyway (both request slots taken) whose read lands
    meanwhile is admitted on the file's prefix, outputs as a cold run's."""
    monkeypatch.setattr(files, "prefetch_policy", "best_effort")
    sched, reader = eng.scheduler, files.prefetcher.reader
    running = [_req("long", random_ids(40, seed=8), n=12), _req("short", random_ids(24, seed=9), n=2)]
    for r in running:
        sched.add_request(r)
    sched.step()
    req = _req("on-file", PROMPT)
    sched.add_request(req)
    sched.step()
    assert req in sched.waiting and len(sched.running) == 2 and len(reader.jobs) == 1
    reader.release()
    _run(sched, running[1:])
    sched.step()
    assert req.alloc is not None and req.cached_tokens == 96
    _run(sched, [req, running[0]])
    assert req.output_ids == _cold(eng, monkeypatch, PROMPT)["output_ids"]


def test_abort_before_or_during_the_read_frees_its_slots(eng, files, monkeypatch):
    """A request aborted while its read is queued gives back every host slot it reserved at once; one aborted while
    its read is in progress gives them back once the reader stops (the next poll), the host's accounting as before
    it came; neither leaves a node in the tree."""
    sched, alloc = eng.scheduler, eng.model_runner.token_allocator
    reader = files.prefetcher.reader
    before = _host_usage(eng)
    sched.add_request(_req("queued", PROMPT))
    sched._admit()  # looks for its files: 6 page slots and an end slot reserved, the read queued
    assert _host_usage(eng)[:2] == (before[0] - 6, before[1] - 1) and len(reader.jobs) == 1
    assert sched.abort_request("queued") is not None
    assert _host_usage(eng) == before and not files.prefetcher.busy()
    reader.release()  # the read comes after the abort: nothing read
    assert _host_usage(eng) == before and not alloc.cache.root.children

    get, calls = files.store.get, []

    def abort_on_first_read(key):
        if not calls:
            assert sched.abort_request("reading") is not None  # the read in progress
        calls.append(key)
        return get(key)
    monkeypatch.setattr(files.store, "get", abort_on_first_read)
    sched.add_request(_req("reading", PROMPT))
    sched._admit()
    reader.release()
    assert len(calls) == 1 and files.prefetcher.draining  # stopped after the page it was reading
    assert _host_usage(eng)[:2] == (before[0] - 6, before[1] - 1)  # the reader had the slots: still held
    alloc.check_all_free()  # counted as the prefetch's, not leaked
    alloc.poll_copies()
    assert _host_usage(eng) == before and not files.prefetcher.busy() and not alloc.cache.root.children


def test_metrics_report_prefetch_latency():
    metrics = MetricsCollector("m")
    stats = HostTierStats(bytes_from_file=512, file_read_seconds=[0.01, 0.02, 0.5])
    metrics.observe_stats(SchedulerStats(0, 0, 0.0, 0, cache_hit_rate=0.0, cache_queried_tokens=10,
                                         hicache=stats.take()))
    text = metrics.render().decode()
    assert 'sglang:hicache_prefetch_latency_seconds_count{model_name="m"} 3.0' in text
    assert 'sglang:hicache_bytes_total{direction="from_file",model_name="m"} 512.0' in text


def test_failed_read_is_a_logged_miss(eng, files, monkeypatch, caplog):
    """A read that raises (wait_complete) ends the request's wait: it is admitted without the file's prefix, the
    failure logged, every slot it reserved freed; outputs as a cold run's."""
    sched, reader = eng.scheduler, files.prefetcher.reader
    tier = eng.model_runner.token_allocator.host_tier

    def broken(key):
        raise RuntimeError("disk gone")
    monkeypatch.setattr(files.store, "get", broken)
    req = _req("broken", PROMPT)
    sched.add_request(req)
    sched.step()
    assert req in sched.waiting and len(reader.jobs) == 1
    reader.release()
    sched.step()
    assert req.alloc is not None and req.cached_tokens == 0 and "a prefetch read failed" in caplog.text
    assert not files.prefetcher.busy() and files.prefetcher.reserved(tier.pages) == 0
    assert files.prefetcher.reserved(tier.ends) == 0 and not any(not n.pages for n in tier.cache.nodes())
    _run(sched, [req])
    monkeypatch.undo()
    assert req.output_ids == _cold(eng, monkeypatch, PROMPT)["output_ids"]
